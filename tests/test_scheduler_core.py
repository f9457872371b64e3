"""SchedulerCore driven by calls, without processes or ports: admission, queue order, placement,
migration, leases, drain, Abort with caller-ended sequences, rejection by a worker.

Workers are real WorkerLink objects; what a worker would be sent is read from take_message(), what
a client would be sent from RequestState.events.
"""

from __future__ import annotations

import json
import logging

import pytest

from metroserve.common.block_hash import hash_prompt_blocks
from metroserve.common.request_limits import RequestLimits, check_request, fits, max_token_id
from metroserve.common.sampling_params import SamplingParams
from metroserve.kvstore import MemoryKVStore
from metroserve.rpc import cluster_pb2, generation_pb2
from metroserve.scheduler.core import AdmissionError, CoreOptions, ErrorCode, RequestError, SchedulerCore
from metroserve.scheduler.request_state import RequestState
from metroserve.scheduler.worker_link import WorkerLink

LIMITS = dict(vocab_size=512, max_model_len=256, max_num_seqs=4, block_size=16, num_blocks=64)
TIMEOUT = 30.0


def make_core(**options) -> SchedulerCore:
    return SchedulerCore(CoreOptions(heartbeat_timeout_s=TIMEOUT, **options), MemoryKVStore())


def add_worker(core: SchedulerCore, worker_id: str, now: float = 0.0, **limits) -> WorkerLink:
    register = cluster_pb2.Register(worker_id=worker_id, epoch=1, model="m",
                                    limits=cluster_pb2.RequestLimits(**{**LIMITS, **limits}))
    return core.worker_registered(register, now)


def gen(prompt: list[int], *, n: int = 1, max_tokens: int = 8, priority: int = 0, request_id: str = "",
        **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=generation_pb2.TokenIds(ids=prompt), priority=priority,
        params=generation_pb2.SamplingParams(n=n, max_tokens=max_tokens, **params))


def sent(link: WorkerLink) -> tuple[list[cluster_pb2.Assignment], list[cluster_pb2.PlacementEnd]]:
    msg = link.take_message()
    return (list(msg.assign), list(msg.end)) if msg is not None else ([], [])


def assigned(link: WorkerLink) -> list[cluster_pb2.Assignment]:
    assignments, ends = sent(link)
    assert ends == []
    return assignments


def report(core: SchedulerCore, link: WorkerLink, placement_id: str, *seqs: tuple, now: float = 1.0) -> None:
    """The worker's output for one placement: (index, tokens[, finish_reason]) per sequence."""
    deltas = [generation_pb2.SequenceDelta(index=s[0], token_ids=s[1], finish_reason=s[2] if len(s) > 2 else "")
              for s in seqs]
    msg = cluster_pb2.WorkerMessage(outputs=[cluster_pb2.PlacementOutput(placement_id=placement_id, seqs=deltas)])
    core.worker_message(link, msg, now)


def drain_events(state: RequestState) -> list:
    items = []
    while not state.events.empty():
        items.append(state.events.get_nowait())
    return items


def streamed_tokens(items: list) -> dict[int, list[int]]:
    """Tokens per sequence as the client's stream carried them."""
    tokens: dict[int, list[int]] = {}
    for item in items:
        for delta in item.outputs:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
    return tokens


def refusal(core: SchedulerCore, request: generation_pb2.GenerateRequest) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        core.admit(request)
    return info.value


# -- admission --------------------------------------------------------------------------------

def test_admission_refusals_carry_their_code():
    core = make_core(max_queue_len=1)
    assert refusal(core, gen([1, 2, 3])).code == ErrorCode.UNAVAILABLE
    add_worker(core, "a", max_num_seqs=1)
    assert "prompt is empty" in refusal(core, gen([])).message
    bad = [
        generation_pb2.GenerateRequest(text="hello"),
        gen([1, 2, 3], temperature=-1.0),
        gen([1, 2, 3], max_tokens=300),  # past the context length
        gen([1, 999]),  # outside the vocabulary
        generation_pb2.GenerateRequest(model="other", token_ids=generation_pb2.TokenIds(ids=[1])),
    ]
    for request in bad:
        assert refusal(core, request).code == ErrorCode.INVALID_ARGUMENT
    core.admit(gen([1, 2, 3], request_id="running"))  # takes the only slot
    assert refusal(core, gen([1, 2, 3], request_id="running")).code == ErrorCode.INVALID_ARGUMENT
    core.admit(gen([1, 2, 3], request_id="queued"))
    assert [p.request.request_id for p in core.queue] == ["queued"]
    full = refusal(core, gen([4, 5, 6]))
    assert full.code == ErrorCode.RESOURCE_EXHAUSTED and full.retry_after_s == 1
    assert core.rejections == {"UNAVAILABLE": 1, "INVALID_ARGUMENT": 7, "RESOURCE_EXHAUSTED": 1}
    assert set(core.requests) == {"running", "queued"}


def test_a_request_goes_only_to_workers_whose_limits_admit_it():
    core = make_core()
    small = add_worker(core, "small", max_model_len=64, num_blocks=8)
    big = add_worker(core, "big")
    long_prompt = list(range(100))
    for i in range(3):  # the idle small worker would win on cost; it cannot hold the prompt
        core.admit(gen(long_prompt, request_id=f"long{i}"))
    assert assigned(small) == [] and len(assigned(big)) == 3
    core.admit(gen([1, 2, 3], request_id="short"))
    assert [a.placement_id.split("/")[0] for a in assigned(small)] == ["short"]
    # No live worker admits it: refused at admission with what the largest one objects to.
    assert "maximum context length is 256" in refusal(core, gen(list(range(300)))).message
    core.worker_message(big, cluster_pb2.WorkerMessage(draining=True), 1.0)
    assert "maximum context length is 64" in refusal(core, gen(long_prompt)).message


def test_fits_agrees_with_check_request():
    limits = RequestLimits(vocab_size=512, max_model_len=64, max_num_seqs=4, block_size=16, num_blocks=3)
    for num_prompt in (1, 40, 48, 63, 64, 80):
        for max_tokens in (None, 1, 8, 9, 24):
            for token, stop_id in ((1, 2), (511, 2), (512, 2), (1, 512)):
                prompt = [1] * (num_prompt - 1) + [token]
                params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[stop_id])
                try:
                    check_request(prompt, params, limits)
                    admitted = True
                except ValueError:
                    admitted = False
                assert fits(limits, num_prompt, max_token_id(prompt, params), params) == admitted, \
                    (num_prompt, max_tokens, token, stop_id)


def test_a_placement_no_live_worker_fits_waits_without_blocking_the_queue():
    core = make_core()
    big = add_worker(core, "big")
    state = core.admit(gen(list(range(100)), request_id="long"))
    assigned(big)
    small = add_worker(core, "small", max_model_len=64, num_blocks=8)
    core.worker_lost(big)
    core.admit(gen([1, 2, 3], request_id="short"))
    assert [a.placement_id.split("/")[0] for a in assigned(small)] == ["short"]
    assert [p.request for p in core.queue] == [state]
    big = add_worker(core, "big")
    (assignment,) = assigned(big)
    assert assignment.placement_id in state.placements


# -- queue and placement ----------------------------------------------------------------------

def test_queue_runs_by_priority_then_arrival():
    core = make_core()
    link = add_worker(core, "a", max_num_seqs=1)
    core.admit(gen([1, 2, 3], request_id="first"))
    for request_id, priority in [("low", 5), ("high1", 0), ("high2", 0), ("mid", 2)]:
        core.admit(gen([1, 2, 3], request_id=request_id, priority=priority))
    assert [p.request.request_id for p in core.queue] == ["high1", "high2", "mid", "low"]
    order = []
    (running,) = assigned(link)
    while True:
        order.append(running.placement_id.split("/")[0])
        report(core, link, running.placement_id, (0, [7], "length"))
        nxt = assigned(link)
        if not nxt:
            break
        (running,) = nxt
    assert order == ["first", "high1", "high2", "mid", "low"]
    assert not core.requests and not core.queue and link.num_placed_seqs == 0


def test_prefix_overlap_wins_and_without_it_the_idle_worker_wins():
    core = make_core()
    a, b = add_worker(core, "a"), add_worker(core, "b")
    prompt = list(range(64))
    core.worker_message(a, cluster_pb2.WorkerMessage(blocks_stored=hash_prompt_blocks(prompt, 16)), 1.0)
    for i in range(2):  # whichever worker the tie-breaking rotation lists first
        core.admit(gen(prompt, request_id=f"shared{i}"))
    assert len(assigned(a)) == 2 and assigned(b) == []
    assert core.placement_hit_tokens_by_worker["a"] == 2 * 63  # the last token is always computed
    core.admit(gen([500] * 40, request_id="other"))  # no overlap anywhere: the idle worker
    assert assigned(a) == [] and len(assigned(b)) == 1


# -- migration, leases, drain -----------------------------------------------------------------

def test_lost_worker_sequences_resume_on_another_with_their_tokens():
    core = make_core()
    a = add_worker(core, "a")
    state = core.admit(gen([1, 2, 3], n=2, max_tokens=3))
    (assignment,) = assigned(a)
    b = add_worker(core, "b")
    report(core, a, assignment.placement_id, (0, [10, 11]), (1, [20]), now=1.0)
    core.worker_message(b, cluster_pb2.WorkerMessage(), 29.0)  # b's heartbeat keeps its lease
    assert core.check_leases(now=31.5) == [a]
    assert set(core.workers) == {"b"} and a.closed.is_set()
    moved = assigned(b)
    assert sorted(list(m.resume_token_ids) for m in moved) == [[10, 11], [20]]
    assert all(m.params.n == 1 and list(m.prompt_token_ids) == [1, 2, 3] for m in moved)
    report(core, a, assignment.placement_id, (0, [99]), now=2.0)  # late output from the lost worker: dropped
    for m in moved:
        report(core, b, m.placement_id, (0, [12] if len(m.resume_token_ids) == 2 else [21, 22], "length"), now=32.0)
    items = drain_events(state)
    assert streamed_tokens(items) == {0: [10, 11, 12], 1: [20, 21, 22]}
    assert items[-1].usage.completion_tokens == 6 and state.finish_reasons == ["length", "length"]
    assert core.num_migrations == 1 and not core.requests and core.kvstore.get_request(state.request_id) is None
    assert b.num_placed_seqs == 0


def test_a_placement_lost_before_any_output_moves_whole():
    core = make_core()
    a = add_worker(core, "a")
    state = core.admit(gen([1, 2, 3], n=2))
    assigned(a)
    b = add_worker(core, "b")
    core.worker_lost(a)
    (moved,) = assigned(b)
    assert moved.params.n == 2 and list(moved.resume_token_ids) == []
    assert list(state.placements) == [moved.placement_id]


def test_draining_worker_takes_nothing_new_and_its_handed_back_work_is_replaced():
    core = make_core()
    a = add_worker(core, "a")
    state = core.admit(gen([1, 2, 3], max_tokens=4))
    (first,) = assigned(a)
    b = add_worker(core, "b")
    prompt = list(range(64))
    core.worker_message(a, cluster_pb2.WorkerMessage(draining=True, blocks_stored=hash_prompt_blocks(prompt, 16)),
                        1.0)
    core.admit(gen(prompt, request_id="new"))  # a holds its prefix, but drains
    assert assigned(a) == [] and [x.placement_id.split("/")[0] for x in assigned(b)] == ["new"]
    report(core, a, first.placement_id, (0, [10]))
    core.worker_message(a, cluster_pb2.WorkerMessage(handed_back=[first.placement_id]), 2.0)
    (moved,) = assigned(b)
    assert list(moved.resume_token_ids) == [10] and moved.placement_id in state.placements
    assert a.num_placed_seqs == 0 and core.num_migrations == 1
    core.worker_message(b, cluster_pb2.WorkerMessage(draining=True), 3.0)
    assert refusal(core, gen([1, 2, 3])).code == ErrorCode.UNAVAILABLE


# -- ending requests ----------------------------------------------------------------------------

def test_abort_with_ended_sequences_keeps_the_clients_finish_reasons_and_usage(caplog):
    core = make_core()
    a = add_worker(core, "a")
    state = core.admit(gen([1, 2, 3], n=2, max_tokens=16, request_id="r"))
    (assignment,) = assigned(a)
    report(core, a, assignment.placement_id, (0, [10, 11, 12, 13, 14]), (1, [20, 21, 22]))
    ended = [generation_pb2.SequenceEnd(index=0, finish_reason="stop", num_tokens=3, stop_reason="\n")]
    with caplog.at_level(logging.INFO, logger="metroserve.requests"):
        assert core.abort("r", ended)
        core.stream_closed(state)  # the gateway then reads the stream to its end: nothing more happens
    assert state.finish_reasons == ["stop", "abort"] and state.outputs[0] == [10, 11, 12]
    assert drain_events(state)[-1].usage.completion_tokens == 6
    (end,) = sent(a)[1]
    assert end.placement_id == assignment.placement_id and list(end.finish_reasons) == ["stop", "abort"]
    assert a.take_message() is None and a.num_placed_seqs == 0
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "metroserve.requests"]
    assert line["finish_reasons"] == ["stop", "abort"] and line["completion_tokens"] == 6
    assert not core.requests and core.kvstore.get_request("r") is None
    assert not core.abort("r")


def test_abort_ends_each_placement_with_its_own_sequences_reasons():
    core = make_core()
    a = add_worker(core, "a")
    state = core.admit(gen([1, 2, 3], n=2, max_tokens=16, request_id="r"))
    (assignment,) = assigned(a)
    report(core, a, assignment.placement_id, (0, [10]), (1, [20]))
    b = add_worker(core, "b")
    core.worker_lost(a)
    by_resume = {tuple(m.resume_token_ids): m.placement_id for m in assigned(b)}
    assert core.abort("r", [generation_pb2.SequenceEnd(index=1, finish_reason="stop", num_tokens=1)])
    reasons = {e.placement_id: list(e.finish_reasons) for e in sent(b)[1]}
    assert reasons == {by_resume[(10,)]: ["abort"], by_resume[(20,)]: ["stop"]}
    assert drain_events(state)[-1].usage.completion_tokens == 2


def test_a_bad_abort_changes_nothing():
    core = make_core()
    add_worker(core, "a")
    state = core.admit(gen([1, 2, 3], request_id="r"))
    for end in [generation_pb2.SequenceEnd(index=1), generation_pb2.SequenceEnd(index=0, finish_reason="eos"),
                generation_pb2.SequenceEnd(index=0, num_tokens=-1)]:
        with pytest.raises(RequestError) as info:
            core.abort("r", [end])
        assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert not state.done and "r" in core.requests and state.finish_reasons == [None]


def test_client_gone_aborts_and_an_unsent_assignment_is_just_dropped():
    core = make_core()
    a = add_worker(core, "a")
    sent_state = core.admit(gen([1, 2, 3], request_id="sent"))
    assigned(a)
    unsent_state = core.admit(gen([1, 2, 3], request_id="unsent"))  # still in the outbox
    core.stream_closed(unsent_state)
    core.stream_closed(sent_state)
    assignments, ends = sent(a)
    assert assignments == [] and [list(e.finish_reasons) for e in ends] == [["abort"]]
    assert sent_state.finish_reasons == ["abort"] and not core.requests and a.num_placed_seqs == 0


def test_worker_rejection_fails_only_that_request():
    core = make_core()
    a = add_worker(core, "a")
    bad = core.admit(gen([1, 2, 3], request_id="bad"))
    good = core.admit(gen([1, 2, 3], request_id="good"))
    rejected, _ = assigned(a)
    core.worker_message(a, cluster_pb2.WorkerMessage(
        rejected=[cluster_pb2.Rejection(placement_id=rejected.placement_id, message="no grammar")]), 1.0)
    (error,) = drain_events(bad)
    assert isinstance(error, RequestError) and error.code == ErrorCode.INVALID_ARGUMENT
    assert error.message == "no grammar"
    assert bad.done and set(core.requests) == {"good"} and not good.done and a.num_placed_seqs == 1
    assert a.take_message() is None  # the worker refused it: nothing to end there
