"""check_json_shape: the one rule for how deep a client's JSON nests and how long its arrays are."""

from __future__ import annotations

import pytest

from metroserve.common.json_limits import MAX_JSON_DEPTH, JsonLimitError, check_json_shape
from metroserve.common.structured_outputs import StructuredOutputsError, StructuredOutputsParams


def _nested(depth: int, leaf: object = 1) -> object:
    """`depth` containers, alternating object and array, built without recursion."""
    node = leaf
    for level in range(depth):
        node = {"k": node} if level % 2 else [node]
    return node


def test_the_bound_is_inclusive():
    check_json_shape(_nested(MAX_JSON_DEPTH), "the body")
    with pytest.raises(JsonLimitError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        check_json_shape(_nested(MAX_JSON_DEPTH + 1), "the body")


def test_the_message_names_the_document_and_the_path():
    with pytest.raises(JsonLimitError) as err:
        check_json_shape({"a": [1, {"b": [[[0]]]}]}, "the body", max_depth=4)
    assert str(err.value) == "the body nests deeper than 4 levels (at $.a[1].b[0])"  # the fifth container


def test_a_structure_far_past_the_recursion_limit_is_refused_not_crashed():
    with pytest.raises(JsonLimitError):
        check_json_shape(_nested(200_000), "the body")


def test_array_length():
    check_json_shape({"p": [0] * 10}, "the body", max_array_len=10)
    with pytest.raises(JsonLimitError, match=r"array of 11 items at \$\.p\[0\]"):
        check_json_shape({"p": [[0] * 11]}, "the body", max_array_len=10)


def test_scalars_and_flat_documents_pass():
    for value in (None, 1, "s", [], {}, [1, "a", None, 2.5], {"a": 1, "b": "c"}):
        check_json_shape(value, "the body")


@pytest.mark.parametrize("schema, fragment", [
    ('{"type": "object", "properties": {"a": ' * 40 + "{}" + "}}" * 40, "nests deeper than 64"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # past Python's recursion limit
    ('{"type": ', "not valid JSON"),
    ("[1, 2]", "must be an object"),
])
def test_structured_outputs_refuses_a_schema_out_of_bounds(schema, fragment):
    """Both edges (REST and gRPC) build StructuredOutputsParams, so both refuse it before any worker
    tries to compile it."""
    with pytest.raises(StructuredOutputsError, match=fragment):
        StructuredOutputsParams(json=schema)
    StructuredOutputsParams(json='{"type": "object", "properties": {"a": ' * 20 + "{}" + "}}" * 20)
