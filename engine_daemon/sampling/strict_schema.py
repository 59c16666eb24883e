"""OpenAI's `strict: true` applied to a JSON schema before llguidance compiles it.

Strict structured outputs promise output with exactly the keys the schema names: OpenAI refuses a
strict schema unless every object says `additionalProperties: false` and lists every property in
`required`. Clients that send a looser schema with `strict: true` (no `additionalProperties`, no
`required`) used to get what JSON Schema allows there: keys the schema never named, named keys
left out. `strict_schema` gives them what strict promises instead: an object schema without
`additionalProperties` is closed, and one without `required` requires every property it lists.
What a schema says itself (`additionalProperties: true`, a `required` subset) is kept.

Anthropic's `strict: true` on a tool (`protocol.messages.STRICT_CLOSED`) closes objects the same way
but leaves `required` as written (`require_all=False`): its schemas name their optional properties by
leaving them out of `required`, and a strict call may still omit them.
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


def _is_object(node: dict[str, Any]) -> bool:
    """Whether strict closes `node`: an object schema that lists its properties itself.

    Left open: an object without `properties` (a free-form `{"type": "object"}` field of a tool's
    schema, or one whose keys come from `anyOf` / `$ref` subschemas, which are closed in their turn):
    closing it would allow only `{}`. And an object combined with `allOf`: its keys are spread over
    itself and its branches, so closing any of them would refuse the others' keys.
    """
    kind = node.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return False
    return isinstance(node.get("properties"), dict) and "allOf" not in node


def strict_schema(schema: Any, limit: int = MAX_SCHEMA_DEPTH, *, require_all: bool = True) -> Any:
    """A copy of `schema` with strict's semantics: objects closed, their properties required (with
    `require_all`; else a `required` the schema does not write stays absent: every property optional).

    Only schema positions are walked (never `enum`, `const`, `default` or `examples` values, which
    are data), iteratively and at most `limit` schemas deep: a deeper schema is refused before
    compiling anyway (`schema_depth_within`). Every dict changed is a copy; the client's schema,
    shared with the prompt's tool list, is never modified.
    """
    if not isinstance(schema, dict):
        return schema
    root = dict(schema)
    pending: list[tuple[dict[str, Any], int, bool]] = [(root, 0, True)]  # (node, depth, may be closed)
    while pending:
        node, depth, closable = pending.pop()
        if closable and _is_object(node):
            node.setdefault("additionalProperties", False)
            if require_all:
                node.setdefault("required", list(node["properties"]))
        if depth < limit:
            pending += ((child, depth + 1, not in_all_of) for child, in_all_of in _copy_subschemas(node))
    return root


def _copy_subschemas(node: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """Replaces each subschema of `node` (an own copy already) by a copy of it, and returns those copies,
    each with whether it is a branch of `allOf` (never closed: `_is_object`)."""
    copies: list[tuple[dict[str, Any], bool]] = []
    in_all_of = False

    def copy(child: Any) -> Any:
        if not isinstance(child, dict):
            return child
        copies.append((dict(child), in_all_of))
        return copies[-1][0]

    for key in _ONE:
        value = node.get(key)
        if isinstance(value, dict):
            node[key] = copy(value)
        elif key == "items" and isinstance(value, list):
            node[key] = [copy(child) for child in value]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            in_all_of = key == "allOf"
            node[key] = [copy(child) for child in node[key]]
            in_all_of = False
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: copy(child) for name, child in node[key].items()}
    return copies
