"""How a response says that the engine made a long chat fit its context window.

The engine drops or summarises older turns under `--context-overflow truncate|summarize`
and says so in ACCEPTED (`context_overflow`: mode and number of dropped messages).
Clients see it in the `X-Context-Overflow` header (every route, streaming too) and,
in JSON answers, in `usage.context_overflow`.
"""

from __future__ import annotations

from typing import Any

import falcon.asgi

HEADER = "X-Context-Overflow"


def report_context_overflow(resp: falcon.asgi.Response, accepted: dict[str, Any]) -> None:
    """Sets the header, and `usage.context_overflow` when the answer is a JSON body (not SSE)."""
    overflow = accepted.get("context_overflow")
    if not isinstance(overflow, dict):
        return
    resp.set_header(HEADER, str(overflow.get("mode")))
    media = resp.media
    usage = media.get("usage") if isinstance(media, dict) else None
    if isinstance(usage, dict):
        usage["context_overflow"] = overflow
