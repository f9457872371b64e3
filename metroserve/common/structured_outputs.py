"""StructuredOutputsParams: the constraint a request puts on its output's form (vLLM's names).

Exactly one of ``json`` (a JSON schema, as text), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of these strings) or ``grammar`` (an EBNF grammar in xgrammar's dialect). Torch-
and grammar-engine-free: the gateway checks a request's shape with it; the worker compiles it
(worker/structured_output.py) and refuses what the grammar engine rejects.

``any_whitespace`` (JSON only): whether the grammar lets the model put free whitespace between
JSON tokens. metroserve defaults to compact JSON, because small models otherwise spend their
token budget on newlines and never close the object; vLLM's ``disable_any_whitespace: false``
turns it on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from metroserve.common.json_limits import JsonLimitError, check_json_shape

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    pass


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    any_whitespace: bool = False
    strict: bool = True  # JSON schema: no properties beyond those listed (OpenAI's strict)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(f"give exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (tuple, list)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputsError("choice must be a non-empty list of non-empty strings")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"{name} must be a non-empty string")
        if self.json is not None:
            _check_schema_shape(self.json)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _check_schema_shape(schema: str) -> None:
    """A schema the grammar engine could compile in reasonable time: a JSON object (or boolean)
    within the nesting and array bounds (common/json_limits.py says why a deep one would stall a worker)."""
    try:
        document = json.loads(schema)
    except (ValueError, RecursionError) as e:
        raise StructuredOutputsError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(document, (dict, bool)):
        raise StructuredOutputsError("the JSON schema must be an object")
    try:
        check_json_shape(document, "the JSON schema")
    except JsonLimitError as e:
        raise StructuredOutputsError(str(e)) from None
