"""The gateway's chat options: the chat template and the tool-call parser (vLLM's flag names).

``--chat-template`` replaces the tokenizer's own template, for a model whose template lacks what a
request needs (tools, a system role); ``--tool-call-parser`` lets ``tool_choice: "auto"`` read tool
calls out of free output (services/tool_calls.py). vLLM also wants ``--enable-auto-tool-choice``;
it is accepted, and means nothing without a parser (an error, as in vLLM).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from metroserve.services.tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ChatServing:
    chat_template_path: str | None = None
    tool_call_parser: str | None = None

    def to_cli_args(self) -> list[str]:
        """The gateway flags that give these options."""
        args = ["--chat-template", self.chat_template_path] if self.chat_template_path else []
        return args + (["--tool-call-parser", self.tool_call_parser] if self.tool_call_parser else [])

    def apply_template(self, tokenizer) -> None:
        """Give the tokenizer the --chat-template file's template (read once, at start)."""
        if self.chat_template_path:
            tokenizer.chat_template = Path(self.chat_template_path).read_text()


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file used instead of the model's own (e.g. one that renders "
                             "tools)")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="how tool_choice 'auto' finds tool calls in the output: hermes (<tool_call> JSON "
                             "</tool_call>, Hermes and Qwen models) or llama3_json (Llama 3.x JSON calls); "
                             "without it 'auto' is refused, 'required' and named functions still work")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's switch for tool_choice 'auto'; here --tool-call-parser alone enables it")


def chat_serving_from_args(args: argparse.Namespace) -> ChatServing:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({' or '.join(TOOL_CALL_PARSERS)})")
    if args.chat_template and not Path(args.chat_template).is_file():
        raise SystemExit(f"--chat-template: no such file {args.chat_template}")
    return ChatServing(chat_template_path=args.chat_template and str(Path(args.chat_template).resolve()),
                       tool_call_parser=args.tool_call_parser)
