"""CORS for the gateway's REST API: vLLM's flags, the semantics of Starlette's CORSMiddleware (vLLM's).

Off unless `--allowed-origins` names some: without it no response carries a CORS header, so no web
page's script can read the API from a browser. (vLLM defaults to "*"; a gateway that holds an API
key should not answer every page on the web unless asked to.) With it, a browser's preflight
(OPTIONS with Origin and Access-Control-Request-Method) from an allowed origin is answered before
the API key is checked, as browsers send preflights without credentials, and every actual response
to that origin says Access-Control-Allow-Origin. A request from any other origin gets no CORS
header and is otherwise served as usual: the browser then withholds the reply from the page.

Torch- and aiohttp-free: `metroserve serve` builds the gateway's flags from it (to_cli_args).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # "*", spelled out as Starlette does
# Headers a browser may always send (the Fetch standard's CORS-safelisted request headers).
SAFELISTED_HEADERS = ("accept", "accept-language", "content-language", "content-type")
# Response headers this API sets for clients to read; a page's script sees them only if exposed.
EXPOSED_HEADERS = "X-Request-Id, Retry-After"
PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ()  # "*": any origin; empty: CORS off
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def allows(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def response_headers(self, origin: str) -> dict[str, str]:
        """For an actual response to an allowed origin. "*" only when no credentials are allowed:
        browsers refuse a wildcard on a credentialed response, so then the origin is echoed."""
        if "*" in self.allowed_origins and not self.allow_credentials:
            headers = {"Access-Control-Allow-Origin": "*"}
        else:  # the answer depends on the request's Origin: caches must key on it
            headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        return headers

    def preflight_headers(self, origin: str, method: str, requested_headers: str) -> dict[str, str] | None:
        """The answer to an allowed origin's preflight; None when the method or a header it asks
        for is not allowed (the browser then blocks the actual request)."""
        methods = ALL_METHODS if "*" in self.allowed_methods else tuple(m.upper() for m in self.allowed_methods)
        requested = [h.strip().lower() for h in requested_headers.split(",") if h.strip()]
        allowed = {h.lower() for h in self.allowed_headers} | set(SAFELISTED_HEADERS)
        if method.upper() not in methods or ("*" not in allowed and not set(requested) <= allowed):
            return None
        headers = self.response_headers(origin)
        del headers["Access-Control-Expose-Headers"]  # meaningful on actual responses only
        # "*" would not cover Authorization, nor anything on a credentialed request: echo what was asked.
        allow_headers = requested if "*" in allowed else sorted(allowed)
        headers.update({"Access-Control-Allow-Methods": ", ".join(methods),
                        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
        if allow_headers:
            headers["Access-Control-Allow-Headers"] = ", ".join(allow_headers)
        return headers

    def to_cli_args(self) -> list[str]:
        """The gateway flags that give this policy (none when CORS is off)."""
        if not self.enabled:
            return []
        args = ["--allowed-origins", json.dumps(list(self.allowed_origins)),
                "--allowed-methods", json.dumps(list(self.allowed_methods)),
                "--allowed-headers", json.dumps(list(self.allowed_headers))]
        return args + ["--allow-credentials"] if self.allow_credentials else args


def parse_list(value: str) -> tuple[str, ...]:
    """A flag's list: JSON (vLLM's form, '["https://a.example"]') or comma-separated (a,b)."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError("the JSON list must hold strings")
    else:
        items = value.split(",")
    return tuple(item.strip() for item in items if item.strip())


def add_cors_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags. Each list is JSON (vLLM's form) or comma-separated; string defaults go
    through parse_list too, so the help shows them as they would be typed."""
    parser.add_argument("--allowed-origins", type=parse_list, default=None, metavar="LIST",
                        help="origins whose web pages may call the REST API from a browser (CORS), e.g. "
                             "'[\"https://app.example\"]' or https://a.example,https://b.example; '*': any "
                             "origin; none: no CORS headers at all")
    parser.add_argument("--allowed-methods", type=parse_list, default="*", metavar="LIST",
                        help="with --allowed-origins: the methods a preflight may allow ('*': all)")
    parser.add_argument("--allowed-headers", type=parse_list, default="*", metavar="LIST",
                        help="with --allowed-origins: the request headers a preflight may allow ('*': whatever "
                             "the browser asks for, Authorization included)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="with --allowed-origins: let browsers send cookies and HTTP auth "
                             "(Access-Control-Allow-Credentials); the origin is then echoed instead of '*'")


def policy_from_args(args: argparse.Namespace) -> CorsPolicy:
    return CorsPolicy(allowed_origins=args.allowed_origins or (), allowed_methods=args.allowed_methods,
                      allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
