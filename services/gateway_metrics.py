"""The gateway's Prometheus metrics: requests by route and status, cancellations, durations.

Engine-side numbers (tokens, TTFT, queue time ...) are the workers' to report; the gateway counts
what only it sees: HTTP and gRPC requests as clients made them, and clients that went away.
A client that disconnects is counted under status "499" (nginx's "client closed request").
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from metroserve.worker.metrics import PREFIX

CLIENT_CLOSED = "499"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "gateway_requests", "Requests by route and response status.",
                                ["route", "status"], registry=self.registry)
        self.cancellations = Counter(PREFIX + "gateway_cancellations",
                                     "Requests whose client went away before the response ended.", ["route"],
                                     registry=self.registry)
        self.duration = Histogram(PREFIX + "gateway_request_duration_seconds",
                                  "Time from request to the end of its response.", ["route"], registry=self.registry,
                                  buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

    def record(self, route: str, status: str, seconds: float) -> None:
        self.requests.labels(route, status).inc()
        self.duration.labels(route).observe(seconds)
        if status == CLIENT_CLOSED:
            self.cancellations.labels(route).inc()
