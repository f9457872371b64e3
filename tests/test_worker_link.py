"""WorkerLink's outbox: batching, and an abort that overtakes its own assignment."""

from __future__ import annotations

from metroserve.common.request_limits import RequestLimits
from metroserve.common.sampling_params import SamplingParams
from metroserve.rpc import cluster_pb2, generation_pb2
from metroserve.scheduler.request_state import Placement, RequestState
from metroserve.scheduler.worker_link import WorkerLink

LIMITS = RequestLimits(vocab_size=512, max_model_len=2048, max_num_seqs=8, block_size=16, num_blocks=100)


def _link() -> WorkerLink:
    return WorkerLink(cluster_pb2.Register(worker_id="w", epoch=1, model="m"), LIMITS)


def _placement(request_id: str) -> Placement:
    state = RequestState(request_id, [1, 2, 3], SamplingParams(), generation_pb2.SamplingParams())
    return Placement(state, 0, 1, [], [b"h" * 16])


def _take(link: WorkerLink) -> cluster_pb2.SchedulerMessage:
    msg = link.take_message()
    assert msg is not None, "the outbox is empty"
    return msg


def test_assignments_leave_as_one_message():
    link = _link()
    placements = [_placement(f"r{i}") for i in range(3)]
    for p in placements:
        link.assign(p, cluster_pb2.Assignment(placement_id=p.placement_id))
    msg = _take(link)
    assert [a.placement_id for a in msg.assign] == [p.placement_id for p in placements]
    assert link.take_message() is None
    assert link.num_placed_seqs == 3 and link.inflight_blocks[b"h" * 16] == 3


def test_abort_before_the_assignment_left_cancels_it_silently():
    link = _link()
    gone, kept = _placement("gone"), _placement("kept")
    link.assign(gone, cluster_pb2.Assignment(placement_id=gone.placement_id))
    link.assign(kept, cluster_pb2.Assignment(placement_id=kept.placement_id))
    link.release(gone, abort=True)
    msg = _take(link)
    assert [a.placement_id for a in msg.assign] == [kept.placement_id]
    assert list(msg.end) == []  # the worker never heard of it: no abort to send
    assert link.num_placed_seqs == 1 and link.inflight_blocks[b"h" * 16] == 1


def test_abort_after_the_assignment_left_is_sent():
    link = _link()
    p = _placement("r")
    link.assign(p, cluster_pb2.Assignment(placement_id=p.placement_id))
    link.take_message()
    link.release(p, abort=True)
    assert [e.placement_id for e in _take(link).end] == [p.placement_id]
    assert link.num_placed_seqs == 0 and not link.inflight_blocks


def test_an_ended_placement_tells_the_worker_each_sequences_reason():
    link = _link()
    p = _placement("r")
    link.assign(p, cluster_pb2.Assignment(placement_id=p.placement_id))
    link.take_message()
    link.release(p, abort=True, finish_reasons=["stop"])
    (end,) = _take(link).end
    assert list(end.finish_reasons) == ["stop"]
    link.release(p, abort=True)  # a second release of the same placement sends nothing
    assert link.take_message() is None
