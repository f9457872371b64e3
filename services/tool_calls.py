"""Tool calling, OpenAI-compatible: request tools -> a constraint and template input; output -> tool_calls.

``tool_choice`` decides how calls come about:
- ``"none"``: the tools are not shown to the model and its output is plain content.
- ``"required"``: the output is constrained (structured outputs) to a JSON array of
  ``{"name": ..., "parameters": {...}}``, one item per call, each item's parameters valid for its
  tool's schema (at most one item with ``parallel_tool_calls: false``), so even a small model
  returns a valid call. This is vLLM's shape.
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained
  to that function's parameters schema and becomes its one call's arguments.
- ``"auto"`` (the default when tools are given): the tools go to the chat template and the model's
  free output is parsed by the server's ``--tool-call-parser``: ``hermes`` (Hermes / Qwen:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text before them is
  content) or ``llama3_json`` (Llama 3.x: the whole output is ``{"name": ..., "parameters": {...}}``,
  several separated by ``;``, optionally after ``<|python_tag|>``). Without a parser, ``auto`` is a
  400, as in vLLM.

Streaming: content streams as it comes until the output could be the start of a tool call; the calls
themselves are sent whole, as one delta per call, when the output ends (OpenAI clients accumulate
argument deltas, so one delta carrying the whole arguments is a valid stream).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from metroserve.common.structured_outputs import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict:
        out: dict = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ToolRequest:
    """A chat request's tools, parsed: what the template sees, the constraint, how output is read."""

    tools: list[dict]  # OpenAI tool objects
    mode: str  # "auto", "required" or "named"
    parallel: bool = True
    named: str | None = None  # the function tool_choice names
    parser: str | None = None  # for "auto"

    @property
    def template_tools(self) -> list[dict]:
        return self.tools

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=json.dumps(_parameters(self._tool(self.named))))
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": _parameters(t)},
                      "required": ["name", "parameters"]} for t in self.tools]
            array: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=json.dumps(array))
        return None

    def _tool(self, name: str | None) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The finished output -> (content, calls)."""
        if self.mode == "named":
            return None, [ToolCall(str(self.named), text)]
        if self.mode == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
            except (json.JSONDecodeError, RecursionError, TypeError, KeyError):  # cut off by max_tokens: not a call
                return text, []
            return None, calls
        content, calls = (_parse_hermes if self.parser == "hermes" else _parse_llama3_json)(text)
        return content, calls if self.parallel else calls[:1]

    def may_start_call(self, text: str) -> int:
        """Where a tool call may begin in auto mode's output so far: the content before it can stream."""
        if self.mode != "auto":
            return 0
        if self.parser == "hermes":
            start = text.find(_HERMES_OPEN)
            if start >= 0:
                return start
            # A suffix that is a prefix of the tag is held back.
            for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
                if _HERMES_OPEN.startswith(text[-k:]):
                    return len(text) - k
            return len(text)
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or _PYTHON_TAG.startswith(stripped[:len(_PYTHON_TAG)]):
            return 0
        return len(text)


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def _call_from(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], flags=re.DOTALL):
        try:
            call = _call_from(json.loads(body), "arguments")
        except (json.JSONDecodeError, RecursionError):  # the model's text nests past what the parser takes
            call = None
        if call is None:  # not a well-formed call: the whole output is content
            return text, []
        calls.append(call)
    content = text[:start]
    return content if content.strip() else None, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except (json.JSONDecodeError, RecursionError):
            return text, []
        call = _call_from(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \n\t;":
            position += 1
    return None, calls


def parse_tool_request(body: dict, parser: str | None) -> ToolRequest | None:
    """None: no tools, or tool_choice "none" (plain content). Raises ToolRequestError naming the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolRequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools or not all(_is_function_tool(t) for t in tools):
        raise ToolRequestError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": "
                               "{\"name\", \"description\"?, \"parameters\"?}}", "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ToolRequestError("tool names must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolRequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if choice == "auto":
        strict = next((t["function"]["name"] for t in tools if t["function"].get("strict")), None)
        if strict is not None:  # auto leaves the output free: the arguments could not be guaranteed
            raise ToolRequestError(f"tool '{strict}' is strict, which needs tool_choice 'required' or that named "
                                   "function (they are enforced by the grammar; 'auto' is not)", "tools")
        if parser is None:
            raise ToolRequestError("tool_choice 'auto' needs the server started with --tool-call-parser "
                                   f"({' or '.join(TOOL_CALL_PARSERS)}); use 'required' or a named function",
                                   "tool_choice")
        return ToolRequest(tools, "auto", parallel, parser=parser)
    if choice == "required":
        return ToolRequest(tools, "required", parallel)
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and choice["function"].get("name") in names):
        return ToolRequest(tools, "named", parallel, named=choice["function"]["name"])
    raise ToolRequestError("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                           "\"function\": {\"name\": <one of the tools>}}", "tool_choice")


def _is_function_tool(tool: object) -> bool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        return False
    fn = tool["function"]
    return (isinstance(fn.get("name"), str) and bool(fn["name"])
            and isinstance(fn.get("parameters", {}), (dict, type(None))))
