"""Twenty JSON schemas for the structured-output tests: nested objects, arrays, enums, bounded numbers,
required and optional fields. Strings and arrays are bounded so every output ends within the
token budget whatever the model prefers."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1,
                                                                   "maximum": 40000000}},
     "required": ["city"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": NAME}, "required": ["ok"]},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "genre": {"enum": ["drama", "comedy", "horror", "documentary"]}},
     "required": ["title", "year", "genre"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"author": {"type": "object", "properties": {
        "name": NAME, "email": {"type": "string", "maxLength": 24}}, "required": ["name"]},
        "pages": {"type": "integer", "minimum": 1, "maximum": 2000}}, "required": ["author", "pages"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer"]},
    {"type": "object", "properties": {"first": NAME, "last": NAME, "middle": NAME}, "required": ["first", "last"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "minItems": 1, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive", "banned"]},
                                      "since": {"type": "integer", "minimum": 2000, "maximum": 2026}},
     "required": ["status"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"]},
    {"type": "object", "properties": {"language": NAME, "typed": {"type": "boolean"},
                                      "paradigms": {"type": "array", "maxItems": 2, "items": {
                                          "enum": ["functional", "object-oriented", "procedural"]}}},
     "required": ["language", "typed"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "profile": {"type": "object", "properties": {"nick": NAME, "level": {"type": "integer", "minimum": 1,
                                                                             "maximum": 10}},
                    "required": ["nick"]}}, "required": ["id", "profile"]}}, "required": ["user"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["USD", "EUR", "JPY"]}, "discount": {"type": "boolean"}},
     "required": ["price", "currency"]},
]
assert len(SCHEMAS) == 20


def prompt_for(schema: dict) -> str:
    return f"Reply with one JSON value that matches this JSON schema: {schema}"
