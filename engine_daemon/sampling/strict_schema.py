"""OpenAI's `strict: true` applied to a JSON schema before llguidance compiles it.

Strict structured outputs promise output with exactly the keys the schema names: OpenAI refuses a
strict schema unless every object says `additionalProperties: false` and lists every property in
`required`. Clients that send a looser schema with `strict: true` (no `additionalProperties`, no
`required`) used to get what JSON Schema allows there: keys the schema never named, named keys
left out. `strict_schema` gives them what strict promises instead: an object schema without
`additionalProperties` is closed, and one without `required` requires every property it lists.
What a schema says itself (`additionalProperties: true`, a `required` subset) is kept.
"""

from __future__ import annotations

from typing import Any

from engine_daemon.sampling.schema_depth import MAX_SCHEMA_DEPTH

# Keywords whose value is a schema (or, for `items`, a list of them in draft 4's tuple form).
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
        "contains", "propertyNames", "not", "if", "then", "else")
# Keywords whose value is a list of schemas.
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
# Keywords whose value maps names to schemas (`$defs`: the targets of `$ref`s).
_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
# Keywords by which an object's keys come from other schemas.
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref")


def _is_object(node: dict[str, Any]) -> bool:
    """Whether `node` describes an object's keys itself (so strict closes it).

    An object typed node that lists no properties but composes subschemas (`anyOf`, `$ref`, ...) is
    left open: its keys are those subschemas', which are closed in their turn; closing it too would
    allow only `{}`.
    """
    kind = node.get("type")
    if kind is None:
        return isinstance(node.get("properties"), dict)
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return False
    return "properties" in node or not any(key in node for key in _COMPOSED)


def strict_schema(schema: Any, limit: int = MAX_SCHEMA_DEPTH) -> Any:
    """A copy of `schema` with strict's semantics: objects closed, their properties required.

    Only schema positions are walked (never `enum`, `const`, `default` or `examples` values, which
    are data), iteratively and at most `limit` schemas deep: a deeper schema is refused before
    compiling anyway (`schema_depth_within`). Every dict changed is a copy; the client's schema,
    shared with the prompt's tool list, is never modified.
    """
    if not isinstance(schema, dict):
        return schema
    root = dict(schema)
    pending: list[tuple[dict[str, Any], int]] = [(root, 0)]
    while pending:
        node, depth = pending.pop()
        if _is_object(node):
            node.setdefault("additionalProperties", False)
            properties = node.get("properties")
            if "required" not in node and isinstance(properties, dict):
                node["required"] = list(properties)
        if depth < limit:
            pending += ((child, depth + 1) for child in _copy_subschemas(node))
    return root


def _copy_subschemas(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Replaces each subschema of `node` (an own copy already) by a copy of it, and returns those copies."""
    copies: list[dict[str, Any]] = []

    def copy(child: Any) -> Any:
        if not isinstance(child, dict):
            return child
        copies.append(dict(child))
        return copies[-1]

    for key in _ONE:
        value = node.get(key)
        if isinstance(value, dict):
            node[key] = copy(value)
        elif key == "items" and isinstance(value, list):
            node[key] = [copy(child) for child in value]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            node[key] = [copy(child) for child in node[key]]
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: copy(child) for name, child in node[key].items()}
    return copies
