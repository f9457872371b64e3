"""The gateway's limits on what one HTTP client may send, and how slowly: one source for the flags,
the gateway and `serve`.

- ``--max-body-bytes``: a larger body gets a 413, refused before it is read.
- ``--max-sequences-per-request``: prompts x n past it get a 400 naming the field, before any
  prompt is read (a batch is admitted or refused as a whole).
- ``--timeout-keep-alive`` (uvicorn's name, which vLLM's server uses): a connection that has not
  sent a whole request line and headers this many seconds after it connected, or after its last
  response ended, is closed. It is both the idle keep-alive bound and the header-read timeout
  that drops a slowloris client, since aiohttp starts its keep-alive timer at connect.
- ``--body-read-timeout``: once the headers are in, the body must arrive within this many seconds,
  else 408 and the connection is closed.

Both timeouts cost one timer per connection; nothing is checked per byte.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from metroserve.common.sampling_params import DEFAULT_MAX_SEQUENCES_PER_REQUEST, MAX_N


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 8 << 20
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST  # prompts x n
    timeout_keep_alive_s: float = 5.0
    body_read_timeout_s: float = 30.0

    def to_cli_args(self) -> list[str]:
        """The gateway flags that give these limits."""
        return ["--max-body-bytes", str(self.max_body_bytes),
                "--max-sequences-per-request", str(self.max_sequences_per_request),
                "--timeout-keep-alive", str(self.timeout_keep_alive_s),
                "--body-read-timeout", str(self.body_read_timeout_s)]


def _at_least(minimum: float, kind: type = int):
    def parse(text: str):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def add_http_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-body-bytes", type=_at_least(1), default=HttpLimits.max_body_bytes,
                        help="larger request bodies get a 413, refused before they are read")
    parser.add_argument("--max-sequences-per-request", type=_at_least(MAX_N),
                        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                        help="the most sequences (prompts x n) one request may ask for; more get a 400 naming "
                             f"'prompt' or 'n' before any prompt is read (at least {MAX_N}, the most n allows)")
    parser.add_argument("--timeout-keep-alive", type=_at_least(0.1, float), default=HttpLimits.timeout_keep_alive_s,
                        metavar="SECONDS",
                        help="close a connection that has not sent a whole request's headers this long after it "
                             "connected or after its last response (idle keep-alive and slow-header clients)")
    parser.add_argument("--body-read-timeout", type=_at_least(0.1, float), default=HttpLimits.body_read_timeout_s,
                        metavar="SECONDS",
                        help="a request body not received this long after its headers gets a 408 and its "
                             "connection is closed")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(max_body_bytes=args.max_body_bytes, max_sequences_per_request=args.max_sequences_per_request,
                      timeout_keep_alive_s=args.timeout_keep_alive, body_read_timeout_s=args.body_read_timeout)
