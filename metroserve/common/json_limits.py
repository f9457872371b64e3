"""The shape a JSON document may take at an edge: how deep it nests and how long one array is.

One rule for every place a client's JSON enters: the REST body (services/rest.py) and a JSON
schema given for structured outputs (common/structured_outputs.py, at the REST and gRPC edges
alike). Why both bounds:

- Depth. Python's json parser recurses, so a body nested past the interpreter's recursion limit
  raises RecursionError; anything that walks the result recursively (the OpenAPI check, the
  schema compiler) recurses again. Worse, the grammar engine's compile time grows steeply with a
  schema's depth (measured with xgrammar: 64 levels 0.03 s, 200 levels 0.73 s, 2,000 levels did
  not finish in 120 s), so one deep schema would stall a worker for every user on it. 64 levels
  is deeper than any schema or request body we have seen in use.
- Array length. The body limit (--max-body-bytes) bounds the bytes; this bounds the items, so a
  list of a million tiny numbers cannot reach code that walks it item by item in Python.

Torch-free and stateless; check_json_shape is O(number of containers) in Python and
O(items) at C speed for arrays of scalars.
"""

from __future__ import annotations

MAX_JSON_DEPTH = 64
MAX_JSON_ARRAY_LEN = 1 << 20


class JsonLimitError(ValueError):
    pass


def check_json_shape(value: object, what: str, max_depth: int = MAX_JSON_DEPTH,
                     max_array_len: int = MAX_JSON_ARRAY_LEN) -> None:
    """Raise JsonLimitError naming the first path that nests deeper than `max_depth` containers or
    holds an array longer than `max_array_len`. `what` names the document in the message
    ("the body", "the JSON schema"). Iterative, so it cannot itself hit the recursion limit."""
    stack: list[tuple[object, int, str]] = [(value, 1, "$")]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            raise JsonLimitError(f"{what} nests deeper than {max_depth} levels (at {path})")
        if isinstance(node, dict):
            stack.extend((v, depth + 1, f"{path}.{k}") for k, v in node.items() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            if len(node) > max_array_len:
                raise JsonLimitError(f"{what} holds an array of {len(node)} items at {path}; "
                                     f"at most {max_array_len} are allowed")
            kinds = set(map(type, node))  # a C-level pass: a list of scalars needs no walk
            if dict in kinds or list in kinds:
                stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node) if isinstance(v, (dict, list)))
