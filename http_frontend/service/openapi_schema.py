"""Small builders for the OpenAPI document's JSON schemas (`openapi`), kept apart so it stays readable."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(properties: dict[str, Schema], required: tuple[str, ...] = (), **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def arr(items: Schema, **extra: Any) -> Schema:
    return {"type": "array", "items": items, **extra}


def nullable(schema: Schema) -> Schema:
    return {**schema, "nullable": True}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
ANY_OBJECT = {"type": "object", "additionalProperties": True}
