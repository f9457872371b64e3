"""The worker service's side of the control protocol (worker/service.py), driven without processes:
scheduler messages are handed to it directly and its outboxes read, around a mock engine."""

from __future__ import annotations

import asyncio
import time

from metroserve.common.sampling_params import SamplingParams
from metroserve.rpc import cluster_pb2
from metroserve.rpc.auth import ClusterCredentials
from metroserve.rpc.convert import params_to_proto
from metroserve.worker.mock_engine import MockEngine, MockEngineOptions
from metroserve.worker.service import REPORT_INTERVAL_S, WorkerOptions, WorkerService

TIMEOUT_S = 10.0


def make_service() -> WorkerService:
    options = MockEngineOptions(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                max_model_len=256, vocab_size=1000, step_fixed_s=0.0, prefill_token_s=0.0,
                                decode_seq_s=0.0)
    worker = WorkerOptions(scheduler="127.0.0.1:1", worker_id="w", credentials=ClusterCredentials(secret="s"))
    return WorkerService(lambda sink: MockEngine(options, sink), "m", worker)


async def until(condition) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_taken_placement_is_announced_to_its_gateway_and_its_finish_waits_for_the_report():
    async def run():
        service = make_service()
        service._handle(cluster_pb2.SchedulerMessage(report_interval_s=4.0, assign=[cluster_pb2.Assignment(
            placement_id="p", request_id="r", gateway_id="g", prompt_token_ids=[1, 2, 3, 4, 5],
            params=params_to_proto(SamplingParams(temperature=0, max_tokens=3)))]))
        assert service._report_interval_s == 4.0 != REPORT_INTERVAL_S
        outbox = service.outboxes["g"]
        assert [(o.placement_id, o.request_id, len(o.seqs)) for o in outbox.outputs] == [("p", "r", 0)]
        await until(lambda: bool(service._finished))
        outputs = list(outbox.outputs)
        assert outputs[0].seqs == [] and sum(len(s.token_ids) for o in outputs[1:] for s in o.seqs) == 3
        assert outbox.queued_version >= 1  # the empty output went with a step's batch
        (finish,) = service._finished
        assert (finish.placement_id, list(finish.num_tokens)) == ("p", [3])
        assert not service._urgent.is_set()  # a finish waits for the periodic report
        await service.engine.shutdown()

    asyncio.run(run())
