"""SchedulerCore driven by calls, without processes or ports: admission, queue order, placement,
completion, migration from the gateway's tokens, leases, drain, Abort, rejection by a worker,
recovery after a scheduler restart and a gateway's reconnection.

Gateways and workers are real GatewayLink and WorkerLink objects; what each would be sent is read
from its take_message(). Times are explicit: every core here starts at 0.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

import pytest

from metroserve.common.block_hash import hash_prompt_blocks
from metroserve.common.request_limits import RequestLimits, check_request, fits, max_token_id
from metroserve.common.sampling_params import SamplingParams
from metroserve.kvstore import MemoryKVStore
from metroserve.rpc import cluster_pb2, generation_pb2
from metroserve.scheduler.core import CoreOptions, ErrorCode, RequestError, SchedulerCore, report_interval_s
from metroserve.scheduler.gateway_link import GatewayLink
from metroserve.scheduler.request_state import RequestState
from metroserve.scheduler.worker_link import WorkerLink

LIMITS = dict(vocab_size=512, max_model_len=256, max_num_seqs=4, block_size=16, num_blocks=64)
TIMEOUT = 30.0  # worker heartbeat timeout
GRACE = 5.0  # gateway grace
WINDOW = 3.0  # recovery window of a restarted core


def make_core(recovery_window_s: float = 0.0, **options) -> SchedulerCore:
    """A core started at time 0; by default its recovery window is over at once."""
    return SchedulerCore(CoreOptions(heartbeat_timeout_s=TIMEOUT, gateway_grace_s=GRACE,
                                     recovery_window_s=recovery_window_s, **options), MemoryKVStore(), now=0.0)


def restarted_core() -> SchedulerCore:
    """A core just restarted at time 0: gateways and workers report what they own until WINDOW."""
    return make_core(recovery_window_s=WINDOW)


def running(placement_id: str, request_id: str, base_index: int = 0, num_seqs: int = 1,
            gateway_id: str = "g") -> cluster_pb2.RunningPlacement:
    return cluster_pb2.RunningPlacement(placement_id=placement_id, request_id=request_id, gateway_id=gateway_id,
                                        base_index=base_index, num_seqs=num_seqs)


def add_worker(core: SchedulerCore, worker_id: str, now: float = 0.0,
               running: Iterable[cluster_pb2.RunningPlacement] = (), **limits) -> WorkerLink:
    register = cluster_pb2.Register(worker_id=worker_id, epoch=1, model="m", address=f"{worker_id}:7000",
                                    limits=cluster_pb2.RequestLimits(**{**LIMITS, **limits}), running=list(running))
    return core.worker_registered(register, now)


def gen(prompt: list[int], *, request_id: str = "r", n: int = 1, max_tokens: int = 8, priority: int = 0,
        cache_salt: str = "", **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=generation_pb2.TokenIds(ids=prompt), priority=priority,
        cache_salt=cache_salt, params=generation_pb2.SamplingParams(n=n, max_tokens=max_tokens, **params))


def add_gateway(core: SchedulerCore, gateway_id: str = "g", now: float = 0.0,
                in_flight: Iterable[generation_pb2.GenerateRequest] = ()) -> GatewayLink:
    register = cluster_pb2.GatewayRegister(gateway_id=gateway_id,
                                           in_flight=[cluster_pb2.Submission(request=r) for r in in_flight])
    return core.gateway_registered(register, now)


# -- what each side is sent -------------------------------------------------------------------

def control(gateway: GatewayLink) -> cluster_pb2.GatewayControl:
    msg = gateway.take_message()
    return msg if msg is not None else cluster_pb2.GatewayControl()


def statuses(gateway: GatewayLink) -> dict[str, cluster_pb2.RequestStatus]:
    return {s.request_id: s for s in control(gateway).status}


def resume_queries(gateway: GatewayLink) -> list[cluster_pb2.ResumeQuery]:
    return list(control(gateway).resume)


def sent(link: WorkerLink) -> tuple[list[cluster_pb2.Assignment], list[cluster_pb2.PlacementEnd]]:
    msg = link.take_message()
    return (list(msg.assign), list(msg.end)) if msg is not None else ([], [])


def assigned(link: WorkerLink) -> list[cluster_pb2.Assignment]:
    assignments, ends = sent(link)
    assert ends == []
    return assignments


def ended(link: WorkerLink) -> list[cluster_pb2.PlacementEnd]:
    assignments, ends = sent(link)
    assert assignments == []
    return ends


# -- what each side says ----------------------------------------------------------------------

def submit(core: SchedulerCore, gateway: GatewayLink, request: generation_pb2.GenerateRequest,
           now: float = 1.0) -> cluster_pb2.RequestStatus:
    """The gateway submits one request; returns the scheduler's answer to it (for a request placed
    at once, the acknowledgment that waits for the next message, read here at once)."""
    core.gateway_message(gateway, cluster_pb2.GatewayMessage(submit=[cluster_pb2.Submission(request=request)]), now)
    gateway.flush_placed()
    return statuses(gateway)[request.request_id]


def admit(core: SchedulerCore, gateway: GatewayLink, request: generation_pb2.GenerateRequest,
          now: float = 1.0) -> RequestState:
    status = submit(core, gateway, request, now)
    assert status.code == "", status.message
    return core.requests[request.request_id]


def refusal(core: SchedulerCore, gateway: GatewayLink,
            request: generation_pb2.GenerateRequest) -> cluster_pb2.RequestStatus:
    status = submit(core, gateway, request)
    assert status.code != "", f"{request.request_id} was admitted"
    return status


def abort(core: SchedulerCore, gateway: GatewayLink, request_id: str,
          ended: Iterable[generation_pb2.SequenceEnd] = (), now: float = 2.0) -> None:
    msg = cluster_pb2.GatewayMessage(abort=[generation_pb2.AbortRequest(request_id=request_id, ended=list(ended))])
    core.gateway_message(gateway, msg, now)


def answer(core: SchedulerCore, gateway: GatewayLink, placement_id: str, tokens: list[list[int]],
           finish_reasons: list[str] | None = None, now: float = 2.0) -> None:
    """The gateway's ResumeState: the tokens it delivered per sequence, and how those it saw end ended."""
    resume = cluster_pb2.ResumeState(placement_id=placement_id, tokens=[generation_pb2.TokenIds(ids=t) for t in tokens],
                                     finish_reasons=finish_reasons or [""] * len(tokens))
    core.gateway_message(gateway, cluster_pb2.GatewayMessage(resume=[resume]), now)


def finish(core: SchedulerCore, link: WorkerLink, placement_id: str, finish_reasons: list[str], num_tokens: list[int],
           num_cached_tokens: int = 0, now: float = 1.0) -> None:
    msg = cluster_pb2.WorkerMessage(finished=[cluster_pb2.PlacementFinish(
        placement_id=placement_id, finish_reasons=finish_reasons, num_tokens=num_tokens,
        num_cached_tokens=num_cached_tokens)])
    core.worker_message(link, msg, now)


def by_index(assignments: list[cluster_pb2.Assignment]) -> list[tuple[int, list[int], int]]:
    """(base_index, resume tokens, n) per assignment, in sequence order."""
    return sorted((a.base_index, list(a.resume_token_ids), a.params.n) for a in assignments)


def request_log(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "metroserve.requests"]


# -- admission --------------------------------------------------------------------------------

def test_admission_refusals_carry_their_code_retry_after_and_field():
    core = make_core(max_queue_len=1)
    gw = add_gateway(core)
    none = refusal(core, gw, gen([1, 2, 3], request_id="early"))
    assert (none.code, none.retry_after_s) == ("UNAVAILABLE", 1)
    add_worker(core, "a", max_num_seqs=1)
    empty = refusal(core, gw, gen([], request_id="empty"))
    assert (empty.code, empty.param, empty.retry_after_s) == ("INVALID_ARGUMENT", "prompt", 0)
    assert "prompt is empty" in empty.message
    bad = [  # (request, the field at fault)
        (generation_pb2.GenerateRequest(request_id="text", text="hello"), ""),
        (gen([1, 2, 3], request_id="temperature", temperature=-1.0), "temperature"),
        (gen([1, 2, 3], request_id="context", max_tokens=300), "max_tokens"),
        (gen([1, 999], request_id="vocab"), "prompt"),
        (generation_pb2.GenerateRequest(request_id="model", model="other", token_ids=generation_pb2.TokenIds(ids=[1])),
         ""),
        (gen([1, 2, 3], request_id=""), ""),
    ]
    for request, param in bad:
        status = refusal(core, gw, request)
        assert (status.code, status.param) == ("INVALID_ARGUMENT", param), request
    admit(core, gw, gen([1, 2, 3], request_id="running"))  # takes the only slot
    duplicate = refusal(core, gw, gen([1, 2, 3], request_id="running"))
    assert duplicate.code == "INVALID_ARGUMENT" and "already in use" in duplicate.message
    admit(core, gw, gen([1, 2, 3], request_id="queued"))
    assert [p.request.request_id for p in core.queue] == ["queued"]
    full = refusal(core, gw, gen([4, 5, 6], request_id="full"))
    assert (full.code, full.retry_after_s) == ("RESOURCE_EXHAUSTED", 1)
    assert core.rejections == {"UNAVAILABLE": 1, "INVALID_ARGUMENT": 8, "RESOURCE_EXHAUSTED": 1}
    assert set(core.requests) == {"running", "queued"}
    status = core.status()
    assert (status.num_rejected, status.num_admitted, status.queue_depth) == (10, 2, 1)


def test_requests_with_the_same_settings_share_one_conversion_and_a_bad_setting_is_refused_every_time():
    core = make_core()
    gw = add_gateway(core)
    add_worker(core, "a")
    first = admit(core, gw, gen([1, 2], request_id="one", max_tokens=5, temperature=0.5, logit_bias={3: 1.0, 7: -2.0}))
    # Same values, map entries in the other order: the same deterministic bytes, the same object.
    second = admit(core, gw, gen([3, 4], request_id="two", max_tokens=5, temperature=0.5, logit_bias={7: -2.0, 3: 1.0}))
    other = admit(core, gw, gen([3, 4], request_id="three", max_tokens=6, temperature=0.5))
    assert second.params is first.params and other.params is not first.params
    assert (first.params.max_tokens, first.params.temperature, other.params.max_tokens) == (5, 0.5, 6)
    for request_id in ("bad1", "bad2"):  # a refusal is not cached as if it were admitted
        status = refusal(core, gw, gen([1, 2], request_id=request_id, temperature=-1.0))
        assert (status.code, status.param) == ("INVALID_ARGUMENT", "temperature")


def test_a_request_goes_only_to_workers_whose_limits_admit_it():
    core = make_core()
    gw = add_gateway(core)
    small = add_worker(core, "small", max_model_len=64, num_blocks=8)
    big = add_worker(core, "big")
    long_prompt = list(range(100))
    for i in range(3):  # the idle small worker would win on cost; it cannot hold the prompt
        admit(core, gw, gen(long_prompt, request_id=f"long{i}"))
    assert assigned(small) == [] and len(assigned(big)) == 3
    admit(core, gw, gen([1, 2, 3], request_id="short"))
    assert [a.request_id for a in assigned(small)] == ["short"]
    # No live worker admits it: refused at admission with what the largest one objects to.
    too_long = refusal(core, gw, gen(list(range(300)), request_id="too_long"))
    assert "maximum context length is 256" in too_long.message and too_long.param == "prompt"
    core.worker_message(big, cluster_pb2.WorkerMessage(draining=True), 1.0)
    assert "maximum context length is 64" in refusal(core, gw, gen(long_prompt, request_id="long3")).message


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
    gw = add_gateway(core)
    big = add_worker(core, "big")
    state = admit(core, gw, gen(list(range(100)), request_id="long"))
    (first,) = assigned(big)
    small = add_worker(core, "small", max_model_len=64, num_blocks=8)
    core.worker_lost(big)
    (query,) = resume_queries(gw)
    answer(core, gw, query.placement_id, [[]])  # nothing delivered yet
    assert [p.request for p in core.queue] == [state] and assigned(small) == []
    admit(core, gw, gen([1, 2, 3], request_id="short"))
    assert [a.request_id for a in assigned(small)] == ["short"]
    assert [p.request for p in core.queue] == [state]
    big = add_worker(core, "big")
    (assignment,) = assigned(big)
    assert assignment.request_id == "long" and assignment.placement_id != first.placement_id
    assert list(state.placements) == [assignment.placement_id] and not core.queue


# -- queue and placement ----------------------------------------------------------------------

def test_an_assignment_names_its_request_owner_and_first_sequence():
    core = make_core()
    gw = add_gateway(core, "gw1")
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2, max_tokens=5, priority=3, cache_salt="salt",
                                temperature=0.5))
    (assignment,) = assigned(a)
    assert (assignment.request_id, assignment.gateway_id, assignment.base_index) == ("r", "gw1", 0)
    assert list(assignment.prompt_token_ids) == [1, 2, 3] and list(assignment.resume_token_ids) == []
    assert (assignment.params.n, assignment.params.max_tokens, assignment.params.temperature) == (2, 5, 0.5)
    assert (assignment.priority, assignment.cache_salt) == (3, "salt")
    assert list(state.placements) == [assignment.placement_id] and state.gateway_id == "gw1"
    assert a.num_placed_seqs == 2 and core.placements_by_worker == {"a": 1}
    assert list(control(gw).resume) == []  # placement is between scheduler and worker only


def test_queue_runs_by_priority_then_arrival():
    core = make_core()
    gw = add_gateway(core)
    link = add_worker(core, "a", max_num_seqs=1)
    admit(core, gw, gen([1, 2, 3], request_id="first"))
    for request_id, priority in [("low", 5), ("high1", 0), ("high2", 0), ("mid", 2)]:
        admit(core, gw, gen([1, 2, 3], request_id=request_id, priority=priority))
    assert [p.request.request_id for p in core.queue] == ["high1", "high2", "mid", "low"]
    order = []
    (placed,) = assigned(link)
    while True:
        order.append(placed.request_id)
        finish(core, link, placed.placement_id, ["length"], [8])
        nxt = assigned(link)
        if not nxt:
            break
        (placed,) = nxt
    assert order == ["first", "high1", "high2", "mid", "low"]
    assert not core.requests and not core.queue and link.num_placed_seqs == 0 and core.num_finished == 5


def test_prefix_overlap_wins_and_without_it_the_idle_worker_wins():
    core = make_core()
    gw = add_gateway(core)
    a, b = add_worker(core, "a"), add_worker(core, "b")
    prompt = list(range(64))
    core.worker_message(a, cluster_pb2.WorkerMessage(blocks_stored=hash_prompt_blocks(prompt, 16)), 1.0)
    for i in range(2):  # whichever worker the tie-breaking rotation lists first
        admit(core, gw, gen(prompt, request_id=f"shared{i}"))
    assert len(assigned(a)) == 2 and assigned(b) == []
    assert core.placement_hit_tokens_by_worker["a"] == 2 * 63  # the last token is always computed
    admit(core, gw, gen([500] * 40, request_id="other"))  # no overlap anywhere: the idle worker
    assert assigned(a) == [] and len(assigned(b)) == 1


def test_gateways_hear_of_every_change_to_the_workers():
    core = make_core()
    gw = add_gateway(core)
    first = control(gw)
    assert first.workers_changed and list(first.workers) == []
    a = add_worker(core, "a")
    add_worker(core, "b")
    core.worker_lost(a)
    msg = control(gw)  # the latest list replaced the unsent ones
    assert msg.workers_changed and [(w.worker_id, w.epoch, w.address) for w in msg.workers] == [("b", 1, "b:7000")]
    assert [(m.id, m.max_model_len, m.vocab_size) for m in msg.models] == [("m", 256, 512)]
    assert gw.take_message() is None


# -- completion -------------------------------------------------------------------------------

def test_a_finished_placement_frees_its_slot_and_its_request_is_counted_and_forgotten(caplog):
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a", max_num_seqs=2)
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2))
    admit(core, gw, gen([4, 5, 6], request_id="waiting", n=2))
    (assignment,) = assigned(a)
    assert a.capacity == 0 and [p.request.request_id for p in core.queue] == ["waiting"]
    with caplog.at_level(logging.INFO, logger="metroserve.requests"):
        finish(core, a, assignment.placement_id, ["stop", "length"], [3, 8], num_cached_tokens=2)
    assert state.finish_reasons == ["stop", "length"] and state.num_tokens == [3, 8]
    assert state.done and "r" not in core.requests and core.num_finished == 1
    assert state.usage() == generation_pb2.Usage(prompt_tokens=3, completion_tokens=11, cached_tokens=2)
    (line,) = request_log(caplog)
    assert (line["request_id"], line["finish_reasons"], line["completion_tokens"]) == ("r", ["stop", "length"], 11)
    (nxt,) = assigned(a)  # the freed slots went to the queue
    assert nxt.request_id == "waiting" and a.num_placed_seqs == 2
    finish(core, a, assignment.placement_id, ["stop", "stop"], [1, 1])  # a repeated report changes nothing
    assert core.num_finished == 1 and a.num_placed_seqs == 2 and state.num_tokens == [3, 8]
    assert (core.status().num_finished, core.status().num_active_requests) == (1, 1)
    assert list(control(gw).status) == []  # the gateway saw the end on its token stream


def complete(core: SchedulerCore, gateway: GatewayLink, request_id: str, finish_reasons: list[str],
             num_tokens: list[int], num_cached_tokens: int = 0, now: float = 1.0, held_s: float = 0.0) -> None:
    msg = cluster_pb2.GatewayMessage(completed=[cluster_pb2.Completion(
        request_id=request_id, finish_reasons=finish_reasons, num_tokens=num_tokens,
        num_cached_tokens=num_cached_tokens, held_s=held_s)])
    core.gateway_message(gateway, msg, now)


def test_a_completions_time_is_when_its_gateway_saw_the_request_end_not_when_it_arrived(caplog):
    core = make_core()
    gw = add_gateway(core)
    add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r"))
    with caplog.at_level(logging.INFO, logger="metroserve.requests"):
        complete(core, gw, "r", ["length"], [4], now=state.arrival_time + 2.0, held_s=0.5)
    (line,) = request_log(caplog)
    assert line["e2e_s"] == 1.5  # the 0.5 s the completion waited at the gateway is not the request's


def test_a_gateways_completion_frees_the_slots_at_once_and_the_blocks_count_until_the_workers_finish(caplog):
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a", max_num_seqs=2)
    prompt = list(range(1, 41))  # two full blocks
    hashes = hash_prompt_blocks(prompt, LIMITS["block_size"])
    state = admit(core, gw, gen(prompt, request_id="r", n=2))
    admit(core, gw, gen([4, 5, 6], request_id="waiting", n=2))
    (assignment,) = assigned(a)
    assert len(hashes) == 2 and all(a.inflight_blocks[h] == 1 for h in hashes)
    with caplog.at_level(logging.INFO, logger="metroserve.requests"):
        complete(core, gw, "r", ["stop", "length"], [3, 8], num_cached_tokens=16)
    assert state.done and "r" not in core.requests and core.num_finished == 1
    assert state.usage() == generation_pb2.Usage(prompt_tokens=40, completion_tokens=11, cached_tokens=16)
    (line,) = request_log(caplog)
    assert (line["request_id"], line["finish_reasons"]) == ("r", ["stop", "length"])
    (nxt,) = assigned(a)  # the slots went to the queue; nothing was sent to end "r": it ended there
    assert nxt.request_id == "waiting" and a.num_placed_seqs == 2
    assert all(a.inflight_blocks[h] == 1 for h in hashes)  # not indexed yet: still counted as placed
    finish(core, a, assignment.placement_id, ["stop", "length"], [3, 8])  # the worker's report, later
    assert not any(h in a.inflight_blocks for h in hashes) and not a.completed
    assert core.num_finished == 1 and a.num_placed_seqs == 2 and a.take_message() is None
    complete(core, gw, "r", ["stop", "stop"], [1, 1])  # over already: changes nothing
    assert core.num_finished == 1 and state.num_tokens == [3, 8] and list(control(gw).status) == []


def test_a_completion_must_name_every_sequence_and_come_from_the_owning_gateway():
    core = make_core()
    gw, other = add_gateway(core, "g"), add_gateway(core, "other")
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2))
    assigned(a)
    complete(core, other, "r", ["stop", "stop"], [1, 1])
    complete(core, gw, "r", ["stop"], [1])
    status = statuses(gw)["r"]
    assert status.code == "INVALID_ARGUMENT" and "2 sequences" in status.message
    assert not state.done and a.num_placed_seqs == 2 and statuses(other) == {}


def test_gateways_hear_when_requests_start_and_stop_waiting_in_the_queue():
    core = make_core()
    gw = add_gateway(core)
    control(gw)
    a = add_worker(core, "a", max_num_seqs=1)
    control(gw)
    gw.wakeup.clear()  # as the stream's writer does once it has sent everything
    core.gateway_message(gw, cluster_pb2.GatewayMessage(submit=[cluster_pb2.Submission(
        request=gen([1, 2, 3], request_id="placed"))]), 1.0)
    assigned(a)
    assert not gw.wakeup.is_set()  # placed at once: no message of its own, no news of the queue
    core.check_leases(1.5)  # the tick sends the acknowledgment
    assert gw.wakeup.is_set() and [(s.request_id, s.code) for s in control(gw).status] == [("placed", "")]
    gw.wakeup.clear()
    core.gateway_message(gw, cluster_pb2.GatewayMessage(submit=[cluster_pb2.Submission(
        request=gen([4, 5, 6], request_id="queued"))]), 1.0)
    msg = control(gw)  # admitted (it waits), and the queue's news, at once
    assert [(s.request_id, s.code) for s in msg.status] == [("queued", "")]
    assert msg.HasField("requests_waiting") and msg.requests_waiting
    late = add_gateway(core, "late")
    assert control(late).requests_waiting  # a gateway that connects now is told
    complete(core, gw, "placed", ["stop"], [2])
    assert [x.request_id for x in assigned(a)] == ["queued"] and not core.queue
    assert gw.take_message() is None  # the queue emptied: news that waits for the next message
    core.gateway_message(gw, cluster_pb2.GatewayMessage(submit=[cluster_pb2.Submission(
        request=gen([1] * 300, request_id="too-long"))]), 1.0)
    msg = control(gw)
    assert [s.code for s in msg.status] == ["INVALID_ARGUMENT"]
    assert msg.HasField("requests_waiting") and not msg.requests_waiting


def report_sent(link: WorkerLink) -> float:
    msg = link.take_message()
    assert msg is not None and not msg.assign and not msg.end
    return msg.report_interval_s


def test_workers_report_less_often_as_they_grow_in_number_but_within_the_heartbeat_timeout():
    assert [report_interval_s(w, 30.0) for w in (1, 4, 5, 8, 9, 16, 17, 32, 33)] == [1, 1, 2, 2, 4, 4, 8, 8, 10]
    assert report_interval_s(10_000, 30.0) == 10.0  # a busy worker's reports are its heartbeats
    core = make_core()
    links = [add_worker(core, f"w{i}") for i in range(4)]
    assert core.report_interval_s == 1.0 and all(w.take_message() is None for w in links)
    links.append(add_worker(core, "w4"))  # 5 workers: every one hears the new interval, once
    assert [report_sent(w) for w in links] == [2.0] * 5
    add_worker(core, "w5")
    assert all(w.take_message() is None for w in links)
    core.worker_lost(links[0])
    core.worker_lost(links[1])  # 4 again
    assert [report_sent(w) for w in links[2:]] == [1.0] * 3


# -- migration, leases, drain -----------------------------------------------------------------

def test_a_lost_workers_sequences_resume_from_the_tokens_their_gateway_delivered():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2, max_tokens=3))
    (assignment,) = assigned(a)
    b = add_worker(core, "b")
    control(gw)
    core.worker_message(b, cluster_pb2.WorkerMessage(), 29.0)  # b's heartbeat keeps its lease
    assert core.check_leases(now=31.5) == [a]
    assert set(core.workers) == {"b"} and a.closed.is_set()
    (query,) = resume_queries(gw)
    assert (query.placement_id, query.request_id, query.base_index, query.num_seqs) == \
        (assignment.placement_id, "r", 0, 2)
    assert assigned(b) == [] and not core.queue  # nothing moves before the gateway answers
    answer(core, gw, query.placement_id, [[10, 11], [20]], now=32.0)
    moved = assigned(b)
    assert by_index(moved) == [(0, [10, 11], 1), (1, [20], 1)]  # each sequence alone, from its own tokens
    assert all(list(m.prompt_token_ids) == [1, 2, 3] and (m.request_id, m.gateway_id) == ("r", "g") for m in moved)
    assert b.num_placed_seqs == 2 and core.num_migrations == 1 and state.num_migrations == 1
    finish(core, a, assignment.placement_id, ["length", "length"], [3, 3])  # the lost worker's late report
    assert state.finish_reasons == [None, None] and "r" in core.requests
    for m in moved:
        finish(core, b, m.placement_id, ["length"], [3], now=33.0)
    assert state.finish_reasons == ["length", "length"] and state.num_tokens == [3, 3]
    assert not core.requests and b.num_placed_seqs == 0 and core.num_finished == 1


def test_a_single_sequence_resumes_from_exactly_the_delivered_tokens():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    admit(core, gw, gen([1, 2, 3], request_id="r"))
    assigned(a)
    b = add_worker(core, "b")
    core.worker_lost(a)
    (query,) = resume_queries(gw)
    answer(core, gw, query.placement_id, [[7, 8, 9]])
    (moved,) = assigned(b)
    assert (moved.base_index, list(moved.resume_token_ids), moved.params.n) == (0, [7, 8, 9], 1)
    # Its prefix is prompt + resume tokens: what the new worker has to compute.
    assert core.requests["r"].placements[moved.placement_id].num_tokens == 6


def test_a_placement_lost_before_any_output_moves_whole():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2))
    assigned(a)
    b = add_worker(core, "b")
    core.worker_lost(a)
    (query,) = resume_queries(gw)
    answer(core, gw, query.placement_id, [[], []])
    (moved,) = assigned(b)
    assert (moved.base_index, moved.params.n, list(moved.resume_token_ids)) == (0, 2, [])
    assert list(state.placements) == [moved.placement_id]


def test_a_request_whose_workers_keep_dying_under_it_fails_instead_of_moving_on():
    """An engine bug one request triggers would otherwise crash every worker in turn (the REST
    fuzzer found one: a worker crash-looped on a request that moved to it after each restart)."""
    from metroserve.scheduler.core import MAX_WORKERS_LOST

    core = make_core()
    gw = add_gateway(core)
    worker = add_worker(core, "w0")
    admit(core, gw, gen([1, 2, 3], request_id="r", n=2))
    for life in range(1, MAX_WORKERS_LOST + 1):
        assert assigned(worker)
        core.worker_lost(worker)
        worker = add_worker(core, f"w{life}")  # restarted
        if life < MAX_WORKERS_LOST:
            (query,) = resume_queries(gw)
            answer(core, gw, query.placement_id, [[], []])
    status = statuses(gw)["r"]
    assert status.code == "INTERNAL" and "workers failed" in status.message
    assert not core.requests and not core.queue and not core.resuming and assigned(worker) == []


def test_a_sequence_its_gateway_saw_finish_is_not_placed_again():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=3))
    assigned(a)
    b = add_worker(core, "b")
    core.worker_lost(a)
    (query,) = resume_queries(gw)
    answer(core, gw, query.placement_id, [[10], [20, 21], []], ["stop", "", ""])
    moved = assigned(b)
    assert by_index(moved) == [(1, [20, 21], 1), (2, [], 1)]  # the one without tokens goes alone too
    assert state.finish_reasons == ["stop", None, None] and state.num_tokens[0] == 1
    for m in moved:
        finish(core, b, m.placement_id, ["length"], [4])
    assert state.num_tokens == [1, 4, 4] and not core.requests and core.num_finished == 1


def test_a_placement_whose_sequences_all_finished_at_the_gateway_ends_its_request():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2))
    assigned(a)
    b = add_worker(core, "b")
    core.worker_lost(a)
    (query,) = resume_queries(gw)
    answer(core, gw, query.placement_id, [[1], [2, 3]], ["stop", "length"])
    assert assigned(b) == [] and not core.queue and not core.resuming
    assert state.finish_reasons == ["stop", "length"] and state.num_tokens == [1, 2]
    assert not core.requests and core.num_finished == 1 and core.num_migrations == 0


def test_only_the_owning_gateway_answers_for_a_placement():
    core = make_core()
    gw, other = add_gateway(core, "g"), add_gateway(core, "h")
    a = add_worker(core, "a")
    admit(core, gw, gen([1, 2, 3], request_id="r"))
    assigned(a)
    b = add_worker(core, "b")
    control(other)
    core.worker_lost(a)
    assert resume_queries(other) == []
    (query,) = resume_queries(gw)
    answer(core, other, query.placement_id, [[99]])  # not its request: ignored
    answer(core, gw, "r/unknown", [[98]])  # no such placement: ignored
    assert assigned(b) == [] and list(core.resuming) == [query.placement_id]
    answer(core, gw, query.placement_id, [[10]])
    (moved,) = assigned(b)
    assert list(moved.resume_token_ids) == [10]
    answer(core, gw, query.placement_id, [[10, 11]])  # answered already
    assert assigned(b) == [] and core.num_migrations == 1


def test_a_gateway_away_when_its_placement_moves_is_asked_when_it_reconnects():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    admit(core, gw, gen([1, 2, 3], request_id="r"))
    (placed,) = assigned(a)
    b = add_worker(core, "b")
    core.gateway_lost(gw, now=2.0)
    core.worker_lost(a)
    assert list(control(gw).resume) == []  # the old link is not asked
    back = add_gateway(core, now=3.0, in_flight=[gen([1, 2, 3], request_id="r")])
    msg = control(back)
    assert [(s.request_id, s.code) for s in msg.status] == [("r", "")]
    assert [(q.placement_id, q.request_id) for q in msg.resume] == [(placed.placement_id, "r")]
    answer(core, back, placed.placement_id, [[5]])
    assert [list(m.resume_token_ids) for m in assigned(b)] == [[5]]


def test_draining_worker_takes_nothing_new_and_its_handed_back_work_is_replaced():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", max_tokens=4))
    (first,) = assigned(a)
    b = add_worker(core, "b")
    prompt = list(range(64))
    core.worker_message(a, cluster_pb2.WorkerMessage(draining=True, blocks_stored=hash_prompt_blocks(prompt, 16)),
                        1.0)
    admit(core, gw, gen(prompt, request_id="new"))  # a holds its prefix, but drains
    assert assigned(a) == [] and [x.request_id for x in assigned(b)] == ["new"]
    control(gw)
    core.worker_message(a, cluster_pb2.WorkerMessage(handed_back=[first.placement_id]), 2.0)
    assert a.num_placed_seqs == 0 and "a" in core.workers  # handing back is not leaving
    (query,) = resume_queries(gw)
    assert query.placement_id == first.placement_id
    answer(core, gw, query.placement_id, [[10]])
    (moved,) = assigned(b)
    assert list(moved.resume_token_ids) == [10] and moved.placement_id in state.placements
    assert core.num_migrations == 1 and assigned(a) == []
    core.worker_message(b, cluster_pb2.WorkerMessage(draining=True), 3.0)
    assert refusal(core, gw, gen([1, 2, 3], request_id="late")).code == ErrorCode.UNAVAILABLE.name


# -- ending requests --------------------------------------------------------------------------

def test_abort_with_ended_sequences_tells_the_worker_each_reason_and_token_count(caplog):
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2, max_tokens=16))
    (assignment,) = assigned(a)
    ends = [generation_pb2.SequenceEnd(index=0, finish_reason="stop", num_tokens=3, stop_reason="\n"),
            generation_pb2.SequenceEnd(index=1, finish_reason="length", num_tokens=16)]
    with caplog.at_level(logging.INFO, logger="metroserve.requests"):
        abort(core, gw, "r", ends)
    (end,) = ended(a)
    assert end.placement_id == assignment.placement_id
    assert (list(end.finish_reasons), list(end.num_tokens)) == (["stop", "length"], [3, 16])
    assert state.finish_reasons == ["stop", "length"] and state.usage().completion_tokens == 19
    (line,) = request_log(caplog)
    assert line["finish_reasons"] == ["stop", "length"] and line["completion_tokens"] == 19
    assert a.take_message() is None and a.num_placed_seqs == 0
    assert not core.requests and core.num_finished == 1 and list(control(gw).status) == []
    assert not core.abort("g", "r")


def test_abort_of_some_sequences_leaves_the_workers_counts_of_a_shared_placement():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2, max_tokens=16))
    assigned(a)
    assert core.abort("g", "r", [generation_pb2.SequenceEnd(index=0, num_tokens=3)])  # no reason: "stop"
    (end,) = ended(a)
    # One count for the placement's two sequences is not known: the worker keeps its own.
    assert (list(end.finish_reasons), list(end.num_tokens)) == (["stop", "abort"], [])
    assert state.finish_reasons == ["stop", "abort"] and state.num_tokens == [3, 0]


def test_abort_ends_each_placement_with_its_own_sequences_reasons_and_counts():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r", n=2, max_tokens=16))
    assigned(a)
    b = add_worker(core, "b")
    core.worker_lost(a)
    (query,) = resume_queries(gw)
    answer(core, gw, query.placement_id, [[10], [20]])
    by_resume = {tuple(m.resume_token_ids): m.placement_id for m in assigned(b)}
    abort(core, gw, "r", [generation_pb2.SequenceEnd(index=1, finish_reason="stop", num_tokens=1)])
    ends = {e.placement_id: (list(e.finish_reasons), list(e.num_tokens)) for e in ended(b)}
    assert ends == {by_resume[(10,)]: (["abort"], []), by_resume[(20,)]: (["stop"], [1])}
    assert state.usage().completion_tokens == 1 and b.num_placed_seqs == 0


def test_an_abort_while_its_gateway_is_asked_drops_the_moving_placement():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    admit(core, gw, gen([1, 2, 3], request_id="r"))
    assigned(a)
    b = add_worker(core, "b")
    core.worker_lost(a)
    (query,) = resume_queries(gw)
    abort(core, gw, "r")
    assert not core.resuming and not core.requests and core.num_finished == 1
    answer(core, gw, query.placement_id, [[5]])  # the answer crossed the abort: nothing to place
    assert assigned(b) == [] and not core.queue

def test_a_bad_abort_changes_nothing_and_its_gateway_hears_why():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r"))
    assigned(a)
    bad = [generation_pb2.SequenceEnd(index=1), generation_pb2.SequenceEnd(index=0, finish_reason="eos"),
           generation_pb2.SequenceEnd(index=0, num_tokens=-1)]
    for end in bad:
        with pytest.raises(RequestError) as info:
            core.abort("g", "r", [end])
        assert info.value.code == ErrorCode.INVALID_ARGUMENT
        abort(core, gw, "r", [generation_pb2.SequenceEnd(index=0, finish_reason="stop"), end])
        status = statuses(gw)["r"]
        assert status.code == "INVALID_ARGUMENT" and status.message == info.value.message
    assert not state.done and "r" in core.requests and state.finish_reasons == [None]
    assert a.take_message() is None and a.num_placed_seqs == 1


def test_an_abort_from_a_gateway_that_does_not_own_the_request_does_nothing():
    core = make_core()
    gw, other = add_gateway(core, "g"), add_gateway(core, "h")
    a = add_worker(core, "a")
    state = admit(core, gw, gen([1, 2, 3], request_id="r"))
    assigned(a)
    control(other)
    assert not core.abort("h", "r")
    abort(core, other, "r")
    assert "r" in core.requests and not state.done and state.finish_reasons == [None]
    assert a.take_message() is None and a.num_placed_seqs == 1 and other.take_message() is None
    assert not core.abort("g", "missing")


def test_client_gone_aborts_and_an_unsent_assignment_is_just_dropped():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    sent_state = admit(core, gw, gen([1, 2, 3], request_id="sent"))
    assigned(a)
    admit(core, gw, gen([1, 2, 3], request_id="unsent"))  # its Assignment is still in the outbox
    abort(core, gw, "unsent")
    abort(core, gw, "sent")
    assignments, ends = sent(a)
    assert assignments == [] and [(e.placement_id.split("/")[0], list(e.finish_reasons)) for e in ends] == \
        [("sent", ["abort"])]
    assert sent_state.finish_reasons == ["abort"] and not core.requests and a.num_placed_seqs == 0
    assert core.num_finished == 2


def test_worker_rejection_fails_only_that_request_and_its_gateway_hears_it():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    bad = admit(core, gw, gen([1, 2, 3], request_id="bad"))
    good = admit(core, gw, gen([1, 2, 3], request_id="good"))
    rejected, _ = assigned(a)
    core.worker_message(a, cluster_pb2.WorkerMessage(
        rejected=[cluster_pb2.Rejection(placement_id=rejected.placement_id, message="no grammar")]), 1.0)
    status = statuses(gw)["bad"]
    assert (status.code, status.message) == ("INVALID_ARGUMENT", "no grammar")
    assert bad.done and set(core.requests) == {"good"} and not good.done and a.num_placed_seqs == 1
    assert a.take_message() is None  # the worker refused it: nothing to end there


# -- recovery after a scheduler restart -------------------------------------------------------

def test_after_a_restart_reported_placements_are_adopted_and_the_rest_migrates():
    core = restarted_core()
    # The gateway is back before any worker: what it reports was admitted before, so no refusal.
    gw = add_gateway(core, now=0.5, in_flight=[gen([1, 2, 3], request_id="kept"),
                                                gen([4, 5, 6], request_id="lost", n=2)])
    assert {s.request_id: s.code for s in control(gw).status} == {"kept": "", "lost": ""}
    assert set(core.requests) == {"kept", "lost"} and not core.queue
    a = add_worker(core, "a", now=1.0, running=[running("kept/old", "kept")])
    assert a.take_message() is None  # adopted: the worker runs it already
    assert a.num_placed_seqs == 1 and list(core.requests["kept"].placements) == ["kept/old"]
    core.check_leases(2.9)
    assert resume_queries(gw) == [] and a.take_message() is None  # inside the window, nothing moves
    core.check_leases(3.1)
    (query,) = resume_queries(gw)
    assert (query.request_id, query.base_index, query.num_seqs) == ("lost", 0, 2)
    answer(core, gw, query.placement_id, [[40, 41], []], now=3.2)
    assert by_index(assigned(a)) == [(0, [40, 41], 1), (1, [], 1)]
    assert a.num_placed_seqs == 3
    finish(core, a, "kept/old", ["stop"], [5], now=3.3)
    assert "kept" not in core.requests and core.num_finished == 1 and a.num_placed_seqs == 2


def test_after_a_restart_only_the_sequences_no_worker_reports_migrate():
    core = restarted_core()
    gw = add_gateway(core, now=0.5, in_flight=[gen([1, 2, 3], request_id="r", n=2)])
    a = add_worker(core, "a", now=1.0, running=[running("r/5", "r", base_index=1)])
    core.check_leases(3.5)
    (query,) = resume_queries(gw)
    assert (query.base_index, query.num_seqs) == (0, 1)
    answer(core, gw, query.placement_id, [[7]])
    (moved,) = assigned(a)
    assert (moved.base_index, list(moved.resume_token_ids)) == (0, [7])
    assert sorted(core.requests["r"].placements) == sorted(["r/5", moved.placement_id])


def test_a_placement_reported_before_its_gateway_is_adopted_when_the_gateway_reports_it():
    core = restarted_core()
    a = add_worker(core, "a", now=0.5, running=[running("r/7", "r", num_seqs=2)])
    assert a.take_message() is None and a.num_placed_seqs == 2  # it holds its slots meanwhile
    gw = add_gateway(core, now=1.0, in_flight=[gen([1, 2, 3], request_id="r", n=2)])
    msg = control(gw)
    assert [(s.request_id, s.code) for s in msg.status] == [("r", "")] and list(msg.resume) == []
    state = core.requests["r"]
    assert list(state.placements) == ["r/7"] and not a.orphans and a.num_placed_seqs == 2
    core.check_leases(3.5)
    assert a.take_message() is None and resume_queries(gw) == [] and not state.recovering
    finish(core, a, "r/7", ["stop", "stop"], [2, 3], now=4.0)
    assert not core.requests and core.num_finished == 1 and a.num_placed_seqs == 0


def test_a_reported_placement_no_gateway_claims_ends_after_the_window():
    core = restarted_core()
    a = add_worker(core, "a", now=0.5, max_num_seqs=2, running=[running("gone/1", "gone", num_seqs=2)])
    gw = add_gateway(core, now=1.0)
    admit(core, gw, gen([1, 2, 3], request_id="new"))  # a new request waits for the slots the orphan holds
    assert a.take_message() is None and [p.request.request_id for p in core.queue] == ["new"]
    core.check_leases(2.9)
    assert a.take_message() is None
    core.check_leases(3.5)
    assignments, ends = sent(a)
    assert [(e.placement_id, list(e.finish_reasons)) for e in ends] == [("gone/1", [])]  # all "abort"
    assert [x.request_id for x in assignments] == ["new"] and not a.orphans and a.num_placed_seqs == 1
    assert "gone" not in core.requests


def test_an_orphan_that_finishes_inside_the_window_frees_its_slots():
    core = restarted_core()
    a = add_worker(core, "a", now=0.5, max_num_seqs=1, running=[running("done/1", "done")])
    gw = add_gateway(core, now=1.0)
    admit(core, gw, gen([1, 2, 3], request_id="new"))
    assert assigned(a) == []
    finish(core, a, "done/1", ["stop"], [4], now=1.5)
    assert [x.request_id for x in assigned(a)] == ["new"] and not a.orphans and a.num_placed_seqs == 1


def test_a_worker_back_with_a_placement_that_has_moved_is_told_to_end_it():
    core = restarted_core()
    gw = add_gateway(core, now=0.5, in_flight=[gen([1, 2, 3], request_id="r")])
    b = add_worker(core, "b", now=1.0)
    core.check_leases(3.5)  # no worker reported it: it moves from the gateway's tokens
    (query,) = resume_queries(gw)
    answer(core, gw, query.placement_id, [[9]], now=3.6)
    (moved,) = assigned(b)
    a = add_worker(core, "a", now=4.0, running=[running("r/old", "r")])  # too late to be adopted
    assert [e.placement_id for e in ended(a)] == ["r/old"] and a.num_placed_seqs == 0
    assert list(core.requests["r"].placements) == [moved.placement_id]
    # The same, without a restart: b's stream breaks, its placement moves, b comes back running it.
    core.worker_lost(b)
    (query,) = resume_queries(gw)
    b = add_worker(core, "b", now=5.0, running=[running(moved.placement_id, "r")])
    assert [e.placement_id for e in ended(b)] == [moved.placement_id] and b.num_placed_seqs == 0
    answer(core, gw, query.placement_id, [[9, 10]], now=5.1)
    placed = assigned(a) + assigned(b)
    assert [list(x.resume_token_ids) for x in placed] == [[9, 10]] and len(core.requests["r"].placements) == 1


def test_a_placement_moving_when_the_window_closes_is_not_placed_twice():
    core = restarted_core()
    gw = add_gateway(core, now=0.5, in_flight=[gen([1, 2, 3], request_id="r")])
    a = add_worker(core, "a", now=1.0, running=[running("r/old", "r")])
    b = add_worker(core, "b", now=1.0)
    core.worker_lost(a)  # the adopted placement must move: its gateway is asked
    (query,) = resume_queries(gw)
    core.check_leases(3.5)  # the window closes before the gateway has answered
    assert resume_queries(gw) == [], \
        "core bug: _recover() migrates sequences whose placement awaits a ResumeState (self.resuming), again"
    answer(core, gw, query.placement_id, [[5]], now=3.6)
    assert [list(x.resume_token_ids) for x in assigned(b)] == [[5]]
    assert len(core.requests["r"].placements) == 1


def test_a_worker_redialling_inside_the_window_with_a_placement_being_moved_is_told_to_end_it():
    core = restarted_core()
    gw = add_gateway(core, now=0.5, in_flight=[gen([1, 2, 3], request_id="r")])
    a = add_worker(core, "a", now=1.0, running=[running("r/old", "r")])
    core.worker_lost(a)  # the gateway is asked, and drops any later output of r/old
    (query,) = resume_queries(gw)
    a = add_worker(core, "a", now=1.5, running=[running("r/old", "r")])
    assert [e.placement_id for e in ended(a)] == ["r/old"], \
        "core bug: worker_registered() adopts a placement that awaits a ResumeState (self.resuming)"
    answer(core, gw, query.placement_id, [[5]], now=1.6)
    assert [list(x.resume_token_ids) for x in assigned(a)] == [[5]]
    assert len(core.requests["r"].placements) == 1


def test_two_workers_reporting_the_same_sequence_before_its_gateway_do_not_both_keep_it():
    core = restarted_core()
    # Before the restart r/1 moved from a (cut off, still running it) to b as r/2.
    a = add_worker(core, "a", now=0.5, running=[running("r/1", "r")])
    b = add_worker(core, "b", now=0.5, running=[running("r/2", "r")])
    add_gateway(core, now=1.0, in_flight=[gen([1, 2, 3], request_id="r")])
    state = core.requests["r"]
    core.check_leases(3.5)
    ends = [e.placement_id for e in ended(a) + ended(b)]
    assert len(state.placements) == 1 and len(ends) == 1 and a.num_placed_seqs + b.num_placed_seqs == 1, \
        "core bug: _adopt_request() adopts every orphan of the request, overlapping ones too (sequence 0 runs twice)"

def test_after_a_restart_a_sequence_that_finished_inside_the_window_does_not_migrate():
    core = restarted_core()
    gw = add_gateway(core, now=0.5, in_flight=[gen([1, 2, 3], request_id="r", n=2)])
    a = add_worker(core, "a", now=1.0, running=[running("r/0", "r", base_index=0)])
    finish(core, a, "r/0", ["length"], [8], now=1.5)
    core.check_leases(3.5)
    (query,) = resume_queries(gw)
    assert (query.base_index, query.num_seqs) == (1, 1), \
        "core bug: _recover() asks to migrate sequence 0, which its worker reported finished"


# -- a gateway's stream breaking ----------------------------------------------------------------

def test_a_gateway_back_within_its_grace_keeps_the_requests_it_reports():
    core = make_core()
    gw = add_gateway(core)
    a = add_worker(core, "a")
    admit(core, gw, gen([1, 2, 3], request_id="kept"))
    admit(core, gw, gen([1, 2, 3], request_id="dropped"))
    placed = {x.request_id: x.placement_id for x in assigned(a)}
    core.gateway_lost(gw, now=2.0)
    assert gw.closed.is_set() and core.status().num_gateways == 0
    core.check_leases(2.0 + GRACE - 0.5)
    assert set(core.requests) == {"kept", "dropped"} and a.take_message() is None
    back = add_gateway(core, now=6.0, in_flight=[gen([1, 2, 3], request_id="kept")])
    assert {r: s.code for r, s in statuses(back).items()} == {"kept": ""}
    assert [e.placement_id for e in ended(a)] == [placed["dropped"]]  # its client is gone
    assert set(core.requests) == {"kept"} and list(core.requests["kept"].placements) == [placed["kept"]]
    assert core.requests["kept"].gateway_id == "g" and a.num_placed_seqs == 1
    core.check_leases(20.0)  # no grace runs any more
    assert "kept" in core.requests and a.take_message() is None
    core.gateway_lost(gw, now=21.0)  # the old link's stream ending late changes nothing
    assert core.gateways == {"g": back} and not core.detached


def test_a_gateway_gone_past_its_grace_ends_its_requests():
    core = make_core()
    gw, other = add_gateway(core, "g"), add_gateway(core, "h")
    a = add_worker(core, "a", max_num_seqs=2)
    admit(core, gw, gen([1, 2, 3], request_id="running", n=2))
    admit(core, gw, gen([1, 2, 3], request_id="queued"))
    kept = admit(core, other, gen([1, 2, 3], request_id="other"))
    (placed,) = assigned(a)
    core.gateway_lost(gw, now=2.0)
    core.check_leases(2.0 + GRACE - 0.1)
    assert a.take_message() is None and len(core.requests) == 3
    core.check_leases(2.0 + GRACE + 0.1)
    assignments, ends = sent(a)
    assert [(e.placement_id, list(e.finish_reasons)) for e in ends] == [(placed.placement_id, ["abort", "abort"])]
    # The slots freed go to the request behind: the other gateway's, not the ended queued one.
    assert [x.request_id for x in assignments] == ["other"] and "other" in core.requests and not kept.done
    assert set(core.requests) == {"other"} and core.num_finished == 2 and not core.detached
