"""The gateway's side of the cluster (services/cluster_client.py), driven without processes: the
scheduler's answers and the workers' token batches are fed to it directly."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from metroserve.rpc import cluster_pb2, generation_pb2
from metroserve.rpc.auth import ClusterCredentials
from metroserve.services.cluster_client import COMPLETION_DELAY_S, ClusterClient, UpstreamError


def _output(placement: str, tokens: list[int], count: int, finish: str = "", base: int = 0):
    return cluster_pb2.PlacementOutput(placement_id=placement, request_id="r", base_index=base, num_tokens=[count],
                                       seqs=[generation_pb2.SequenceDelta(index=0, token_ids=tokens,
                                                                          finish_reason=finish)])


async def _admitted(client: ClusterClient):
    stream = client.generate(generation_pb2.GenerateRequest(request_id="r",
                                                            token_ids=generation_pb2.TokenIds(ids=[1, 2, 3])))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    client._on_status(cluster_pb2.RequestStatus(request_id="r"))
    assert not (await first).outputs  # the acknowledgment
    return stream


def test_resume_answers_what_was_delivered_and_drops_the_old_placements_late_output():
    async def run():
        client = ClusterClient("127.0.0.1:1", ClusterCredentials(secret="s"), gateway_id="g")
        stream = await _admitted(client)
        client._deliver(cluster_pb2.TokenBatch(outputs=[_output("r/0", [7, 8], 2)]))
        assert list((await anext(stream)).outputs[0].token_ids) == [7, 8]
        client._on_resume_query(cluster_pb2.ResumeQuery(placement_id="r/0", request_id="r", num_seqs=1))
        (resume,) = client._resume
        assert list(resume.tokens[0].ids) == [7, 8] and list(resume.finish_reasons) == [""]
        client._deliver(cluster_pb2.TokenBatch(outputs=[_output("r/0", [9], 3)]))  # late: dropped
        client._deliver(cluster_pb2.TokenBatch(outputs=[_output("r/1", [9, 5], 4, "length")]))  # the new placement
        last = await anext(stream)
        assert list(last.outputs[0].token_ids) == [9, 5] and last.usage.completion_tokens == 4

    asyncio.run(run())


def test_a_lost_batch_fails_the_request_instead_of_leaving_a_hole():
    async def run():
        client = ClusterClient("127.0.0.1:1", ClusterCredentials(secret="s"), gateway_id="g")
        stream = await _admitted(client)
        client._deliver(cluster_pb2.TokenBatch(outputs=[_output("r/0", [7], 1)]))
        await anext(stream)
        client._deliver(cluster_pb2.TokenBatch(outputs=[_output("r/0", [9], 3)]))  # token 2 never arrived
        with pytest.raises(UpstreamError) as err:
            await anext(stream)
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert [a.request_id for a in client._abort] == ["r"]  # ended on its worker too

    asyncio.run(run())


def test_a_request_placed_at_once_is_admitted_by_its_workers_first_output():
    async def run():
        client = ClusterClient("127.0.0.1:1", ClusterCredentials(secret="s"), gateway_id="g")
        stream = client.generate(generation_pb2.GenerateRequest(request_id="r",
                                                                token_ids=generation_pb2.TokenIds(ids=[1, 2, 3])))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert not first.done()  # no word yet
        client._deliver(cluster_pb2.TokenBatch(outputs=[cluster_pb2.PlacementOutput(placement_id="r/0",
                                                                                    request_id="r")]))
        assert not (await first).outputs  # the acknowledgment, and nothing else from the empty output
        client._deliver(cluster_pb2.TokenBatch(outputs=[_output("r/0", [7], 1, "stop")]))
        last = await anext(stream)
        assert list(last.outputs[0].token_ids) == [7] and last.usage.completion_tokens == 1

    asyncio.run(run())


async def _next_message(outgoing) -> tuple[cluster_pb2.GatewayMessage, float]:
    start = asyncio.get_running_loop().time()
    msg = await asyncio.wait_for(anext(outgoing), 10.0)
    return msg, asyncio.get_running_loop().time() - start


def test_a_completion_rides_with_the_next_submission_else_goes_after_a_delay_and_at_once_while_requests_wait():
    async def run():
        client = ClusterClient("127.0.0.1:1", ClusterCredentials(secret="s"), gateway_id="g")
        client._session = 1
        outgoing = client._outgoing(1)
        assert (await anext(outgoing)).HasField("register")
        stream = await _admitted(client)
        msg, _ = await _next_message(outgoing)
        assert [s.request.request_id for s in msg.submit] == ["r"]
        client._deliver(cluster_pb2.TokenBatch(outputs=[_output("r/0", [7, 8], 2, "length")]))
        await anext(stream)
        follow = client.generate(generation_pb2.GenerateRequest(request_id="next",
                                                                token_ids=generation_pb2.TokenIds(ids=[4])))
        follow_first = asyncio.ensure_future(anext(follow))
        msg, _ = await _next_message(outgoing)  # the completion went with the submission
        assert [s.request.request_id for s in msg.submit] == ["next"]
        assert [(c.request_id, list(c.finish_reasons), list(c.num_tokens)) for c in msg.completed] == \
            [("r", ["length"], [2])]
        client._deliver(cluster_pb2.TokenBatch(outputs=[cluster_pb2.PlacementOutput(
            placement_id="next/0", request_id="next", num_tokens=[1], seqs=[generation_pb2.SequenceDelta(
                index=0, token_ids=[5], finish_reason="stop")])]))
        await follow_first
        msg, waited = await _next_message(outgoing)  # alone: after the delay
        assert [c.request_id for c in msg.completed] == ["next"] and not msg.submit
        assert waited >= COMPLETION_DELAY_S * 0.9
        assert COMPLETION_DELAY_S * 0.9 <= msg.completed[0].held_s <= waited + 0.01  # so the scheduler can subtract it
        client._handle(cluster_pb2.GatewayControl(requests_waiting=True))
        third = await _admitted_as(client, "third")
        msg, _ = await _next_message(outgoing)
        assert [s.request.request_id for s in msg.submit] == ["third"] and not msg.completed
        client._deliver(cluster_pb2.TokenBatch(outputs=[cluster_pb2.PlacementOutput(
            placement_id="third/0", request_id="third", num_tokens=[1], seqs=[generation_pb2.SequenceDelta(
                index=0, token_ids=[5], finish_reason="stop")])]))
        assert client._wakeup.is_set() and client._completion_timer is None  # requests wait: at once
        await anext(third)
        msg, _ = await _next_message(outgoing)
        assert [c.request_id for c in msg.completed] == ["third"]

    asyncio.run(run())


async def _admitted_as(client: ClusterClient, request_id: str):
    stream = client.generate(generation_pb2.GenerateRequest(request_id=request_id,
                                                            token_ids=generation_pb2.TokenIds(ids=[1])))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    client._on_status(cluster_pb2.RequestStatus(request_id=request_id))
    await first
    return stream
