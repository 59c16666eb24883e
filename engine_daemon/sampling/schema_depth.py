"""How deep a JSON schema nests, following its local `$ref`s, checked before llguidance compiles it.

Why: llguidance compiles a schema by recursing through it, `$ref` targets included; a flat chain of
~1,100 `$defs` (each an array of the next, 80 KB of JSON nested 5 levels) overflowed its stack
and the whole engine died with SIGSEGV. Real schemas nest a few dozen levels at most.
"""

from __future__ import annotations

from typing import Any

MAX_SCHEMA_DEPTH = 100


class _TooDeep(Exception):
    pass


def schema_depth_within(schema: Any, limit: int = MAX_SCHEMA_DEPTH) -> bool:
    """Whether `schema` nests at most `limit` levels, a `$ref` counting as a level into its target.

    Each target's height is computed once (a schema referring to one definition many times stays
    linear) and a `$ref` back into one being computed (a recursive schema) counts as a leaf: the
    grammar refers to it by name there instead of expanding it.
    """
    heights: dict[str, int] = {}
    open_refs: set[str] = set()

    def height(node: Any, level: int) -> int:
        if level > limit:
            raise _TooDeep
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        best = max((1 + height(child, level + 1) for child in children), default=0)
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str) and ref.startswith("#") and ref not in open_refs:
            if ref not in heights:
                open_refs.add(ref)
                heights[ref] = height(_resolve(schema, ref), level + 1)
                open_refs.discard(ref)
            if level + 1 + heights[ref] > limit:
                raise _TooDeep
            best = max(best, 1 + heights[ref])
        return best

    try:
        height(schema, 0)
    except _TooDeep:
        return False
    return True


def _resolve(root: Any, ref: str) -> Any:
    """The target of a local JSON pointer (`#/$defs/a`), or None when it points nowhere."""
    node = root
    for part in ref[1:].split("/")[1:] if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
