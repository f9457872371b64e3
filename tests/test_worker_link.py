"""The links' outboxes: a WorkerLink batches assignments and ends (an end overtaking its own
assignment cancels it), counts adopted placements and orphans in its slots; a GatewayLink batches
statuses and resume queries, and keeps only the latest worker list."""

from __future__ import annotations

from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.rpc import cluster_pb2, generation_pb2
from metroserve.scheduler.gateway_link import GatewayLink
from metroserve.scheduler.request_state import Placement, RequestState
from metroserve.scheduler.worker_link import WorkerLink

LIMITS = RequestLimits(vocab_size=512, max_model_len=2048, max_num_seqs=8, block_size=16, num_blocks=100)


def _link() -> WorkerLink:
    return WorkerLink(cluster_pb2.Register(worker_id="w", epoch=1, model="m"), LIMITS)


def _placement(request_id: str, n: int = 1, base_index: int = 0, num_seqs: int = 1) -> Placement:
    state = RequestState(request_id, [1, 2, 3], SamplingParams(n=n), generation_pb2.SamplingParams(n=n), "g")
    return Placement(state, base_index, num_seqs, [], [b"h" * 16])


def _take(link: WorkerLink) -> cluster_pb2.SchedulerMessage:
    msg = link.take_message()
    assert msg is not None, "the outbox is empty"
    return msg


def test_assignments_leave_as_one_message():
    link = _link()
    placements = [_placement(f"r{i}") for i in range(3)]
    for p in placements:
        link.assign(p, cluster_pb2.Assignment(placement_id=p.placement_id))
    assert link.wakeup.is_set()
    msg = _take(link)
    assert [a.placement_id for a in msg.assign] == [p.placement_id for p in placements]
    assert link.take_message() is None
    assert link.num_placed_seqs == 3 and link.inflight_blocks[b"h" * 16] == 3
    assert all(p.worker_id == "w" for p in placements) and link.capacity == 5


def test_abort_before_the_assignment_left_cancels_it_silently():
    link = _link()
    gone, kept = _placement("gone"), _placement("kept")
    link.assign(gone, cluster_pb2.Assignment(placement_id=gone.placement_id))
    link.assign(kept, cluster_pb2.Assignment(placement_id=kept.placement_id))
    link.release(gone, abort=True)
    msg = _take(link)
    assert [a.placement_id for a in msg.assign] == [kept.placement_id]
    assert list(msg.end) == []  # the worker never heard of it: no end to send
    assert link.num_placed_seqs == 1 and link.inflight_blocks[b"h" * 16] == 1


def test_abort_after_the_assignment_left_is_sent():
    link = _link()
    p = _placement("r")
    link.assign(p, cluster_pb2.Assignment(placement_id=p.placement_id))
    link.take_message()
    link.release(p, abort=True)
    (end,) = _take(link).end
    assert end.placement_id == p.placement_id and list(end.finish_reasons) == [] and list(end.num_tokens) == []
    assert link.num_placed_seqs == 0 and not link.inflight_blocks


def test_an_ended_placement_tells_the_worker_each_sequences_reason_and_count():
    link = _link()
    p = _placement("r", n=2, num_seqs=2)
    link.assign(p, cluster_pb2.Assignment(placement_id=p.placement_id))
    link.take_message()
    link.release(p, abort=True, finish_reasons=["stop", "abort"], num_tokens=[3, 5])
    (end,) = _take(link).end
    assert (list(end.finish_reasons), list(end.num_tokens)) == (["stop", "abort"], [3, 5])
    link.release(p, abort=True)  # a second release of the same placement sends nothing
    assert link.take_message() is None and link.num_placed_seqs == 0


def test_a_finished_or_handed_back_placement_frees_its_slots_without_a_message():
    link = _link()
    p = _placement("r", n=3, num_seqs=3)
    link.assign(p, cluster_pb2.Assignment(placement_id=p.placement_id))
    link.take_message()
    link.release(p, abort=False)
    assert link.take_message() is None and link.capacity == 8 and not link.inflight_blocks


def test_an_adopted_placement_takes_its_slots_and_sends_nothing():
    link = _link()
    p = _placement("r", n=2, base_index=1, num_seqs=1)
    link.assign(p, None)  # the worker runs it already (reported after a scheduler restart)
    assert link.take_message() is None and not link.wakeup.is_set()
    assert link.num_placed_seqs == 1 and link.placements == {p.placement_id: p} and p.worker_id == "w"


def test_an_orphan_holds_its_slots_until_taken():
    link = _link()
    link.add_orphan(cluster_pb2.RunningPlacement(placement_id="r/1", request_id="r", num_seqs=3))
    assert link.capacity == 5 and link.take_message() is None
    taken = link.take_orphan("r/1")
    assert taken is not None and taken.request_id == "r"
    assert link.take_orphan("r/1") is None and link.capacity == 8
    link.end("r/1")
    assert [e.placement_id for e in _take(link).end] == ["r/1"]


def test_gateway_statuses_and_resume_queries_leave_as_one_message():
    link = GatewayLink("g")
    assert link.take_message() is None
    link.status(cluster_pb2.RequestStatus(request_id="a"))
    link.status(cluster_pb2.RequestStatus(request_id="b", code="UNAVAILABLE", retry_after_s=1))
    link.query_resume(_placement("c", n=4, base_index=2, num_seqs=2))
    assert link.wakeup.is_set()
    msg = link.take_message()
    assert msg is not None and not msg.workers_changed
    assert [(s.request_id, s.code) for s in msg.status] == [("a", ""), ("b", "UNAVAILABLE")]
    (query,) = msg.resume
    assert (query.request_id, query.base_index, query.num_seqs) == ("c", 2, 2) and query.placement_id.startswith("c/")
    assert link.take_message() is None


def test_a_newer_worker_list_replaces_an_unsent_one():
    link = GatewayLink("g")
    for workers in (["a"], ["a", "b"]):
        link.workers_changed(cluster_pb2.GatewayControl(
            workers_changed=True, workers=[cluster_pb2.WorkerEndpoint(worker_id=w) for w in workers]))
    link.status(cluster_pb2.RequestStatus(request_id="r"))
    msg = link.take_message()
    assert msg is not None and msg.workers_changed and [w.worker_id for w in msg.workers] == ["a", "b"]
    assert [s.request_id for s in msg.status] == ["r"] and link.take_message() is None
