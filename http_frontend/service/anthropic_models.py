"""GET /v1/models for Anthropic clients: the same catalogue in the Models API's shape.

Why: /v1/models is one path for both APIs, and an OpenAI model object does not parse as
Anthropic's `ModelInfo` (`type` is "model" there, with `display_name`, an RFC 3339
`created_at` and a `lifecycle`), nor its list as a page (`has_more`, `first_id`,
`last_id`). Anthropic's SDKs and agents send `anthropic-version` on every request, which
is how the resource tells them apart (`speaks_anthropic`).
"""

from __future__ import annotations

import datetime
from typing import Any

import falcon.asgi

from http_frontend.errors import APIError, bad_request

DEFAULT_LIMIT, MAX_LIMIT = 20, 1000  # Anthropic's Models API: `limit` defaults to 20, at most 1000


def model_info(m: dict[str, Any]) -> dict[str, Any]:
    """A catalogue entry as Anthropic's `ModelInfo`, with this server's extra fields beside it."""
    created = datetime.datetime.fromtimestamp(int(m.get("created") or 0), tz=datetime.timezone.utc)
    return {"type": "model", "id": m["id"], "display_name": m["id"],
            "created_at": created.isoformat().replace("+00:00", "Z"), "lifecycle": "active",
            "max_input_tokens": m.get("context_window"), "kind": m.get("kind") or "text",
            "loaded": m.get("loaded", False)}


def model_page(models: list[dict[str, Any]], req: falcon.asgi.Request) -> dict[str, Any]:
    """One page of the catalogue (`limit`, `after_id`, `before_id`) as Anthropic's list."""
    raw_limit = req.get_param("limit")
    try:
        limit = DEFAULT_LIMIT if raw_limit is None else int(raw_limit)
    except ValueError:
        raise bad_request("limit: expected an integer", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit: must be between 1 and {MAX_LIMIT}", param="limit")
    ids = [m["id"] for m in models]
    after, before = req.get_param("after_id"), req.get_param("before_id")
    if after is not None and before is not None:
        raise bad_request("Give after_id or before_id, not both", param="after_id")
    start, stop = 0, len(models)
    for cursor, name in ((after, "after_id"), (before, "before_id")):
        if cursor is not None and cursor not in ids:
            raise APIError(404, f"{name}: no model '{cursor}'", code="model_not_found", param=name)
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        stop = ids.index(before)
        start = max(0, stop - limit)
    page = models[start:min(stop, start + limit)]
    has_more = start > 0 if before is not None else start + len(page) < stop
    return {"data": [model_info(m) for m in page], "has_more": has_more,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}
