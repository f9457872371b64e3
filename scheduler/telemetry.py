"""Per-request telemetry at the scheduler: its trace spans and its one structured log line.

The scheduler sees a request whole (every placement, migration and sequence, though none of its
tokens), so this is where the request's span lives and where the log line is written when it
ends: one JSON object on the `metroserve.requests` logger with ids, timings, token counts, workers
and finish reasons. Time to first token is the gateway's to measure (its metrics and span).
"""

from __future__ import annotations

import json
import logging
import time

from opentelemetry import trace

from metroserve.scheduler.request_state import Placement, RequestState
from metroserve.services.tracing import extract_context, inject_context, ns, tracer

request_logger = logging.getLogger("metroserve.requests")


class RequestTelemetry:
    def __init__(self, log_requests: bool):
        self.log_requests = log_requests
        self.tracer = tracer("metroserve.scheduler")

    def admitted(self, state: RequestState, trace_context: dict[str, str], model: str) -> None:
        if self.tracer is None:
            return
        state.span = self.tracer.start_span(
            "scheduler.request", context=extract_context(trace_context), kind=trace.SpanKind.SERVER,
            start_time=ns(state.arrival_wall_time),
            attributes={"metroserve.request_id": state.request_id, "gen_ai.request.model": model,
                        "gen_ai.usage.input_tokens": len(state.prompt_token_ids), "metroserve.n": state.params.n})

    def placed(self, placement: Placement, worker_id: str) -> dict[str, str]:
        """Records the placement's queueing; returns the trace context for the worker's Assignment."""
        state = placement.request
        if state.placed_time is None:
            state.placed_time = time.monotonic()
        state.workers.append(worker_id)
        if state.span is None or self.tracer is None:  # a request has a span only while tracing is on
            return {}
        parent = trace.set_span_in_context(state.span)
        self.tracer.start_span("scheduler.queue", context=parent, start_time=ns(placement.queued_wall_time),
                               attributes={"metroserve.worker": worker_id}).end()
        return inject_context(state.span)

    def ended(self, state: RequestState) -> None:
        end = state.end_time if state.end_time is not None else time.monotonic()
        usage = state.usage()
        workers = list(dict.fromkeys(state.workers))
        reasons = [r or "abort" for r in state.finish_reasons]
        if state.span is not None:
            state.span.set_attributes({
                "gen_ai.usage.output_tokens": usage.completion_tokens, "metroserve.cached_tokens": usage.cached_tokens,
                "metroserve.worker": ",".join(workers), "gen_ai.response.finish_reasons": reasons,
                "metroserve.migrations": state.num_migrations})
            state.span.end(end_time=ns(state.arrival_wall_time + end - state.arrival_time))
        if not self.log_requests:
            return

        def since_arrival(t: float | None) -> float | None:
            return round(t - state.arrival_time, 6) if t is not None else None

        line = {"event": "request_finished", "request_id": state.request_id,
                "trace_id": format(state.span.get_span_context().trace_id, "032x") if state.span else None,
                "workers": workers, "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens, "cached_tokens": usage.cached_tokens,
                "finish_reasons": reasons, "queue_s": since_arrival(state.placed_time),
                "e2e_s": since_arrival(end),
                "migrations": state.num_migrations, "priority": state.priority}
        request_logger.info(json.dumps(line))
