"""Prompt logging at the gateway: off by default, since prompts are users' data.

With ``--enable-log-prompts`` the gateway writes one line per generation request (REST or gRPC), at
admission, on the logger ``metroserve.prompts``: the request id and, per prompt, its text as the
model sees it (decoded from its token ids, so a chat request's line shows the rendered template)
and its token count, each text cut to ``--max-log-len`` characters (vLLM's flag; default: whole).
Nothing else in the cluster logs prompt text; the scheduler's per-request line (on unless
``--disable-log-requests``) carries counts and timings only. vLLM logs prompts as part of
``--enable-log-requests``; here the two are separate switches, so request logging can stay on
without user data in the logs.

Cost: one decode and one log line per request, only when enabled; nothing per token.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger("metroserve.prompts")


@dataclass(frozen=True)
class PromptLog:
    enabled: bool = False
    max_len: int | None = None  # characters of each prompt's text; None: all

    def to_cli_args(self) -> list[str]:
        """The gateway flags that give this setting."""
        if not self.enabled:
            return []
        return ["--enable-log-prompts", *(["--max-log-len", str(self.max_len)] if self.max_len is not None else [])]

    def log(self, request_id: str, prompts: list[list[int]], tokenizer) -> None:
        if not self.enabled:
            return
        texts = [tokenizer.decode(p)[: self.max_len] for p in prompts]
        logger.info(json.dumps({"event": "request_received", "request_id": request_id,
                                "prompts": [{"text": t, "tokens": len(p)} for t, p in zip(texts, prompts)]}))


def add_prompt_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-log-prompts", action="store_true",
                        help="log each generation request's prompt text at the gateway (off: prompts are users' "
                             "data and appear in no log)")
    parser.add_argument("--max-log-len", type=int, default=None, metavar="CHARS",
                        help="with --enable-log-prompts, log at most this many characters of each prompt "
                             "(default: all)")


def prompt_log_from_args(args: argparse.Namespace) -> PromptLog:
    if args.max_log_len is not None and not args.enable_log_prompts:
        raise SystemExit("--max-log-len needs --enable-log-prompts")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise SystemExit(f"--max-log-len must be >= 0, got {args.max_log_len}")
    return PromptLog(enabled=args.enable_log_prompts, max_len=args.max_log_len)
