"""`n` > 1 (or several prompts on /v1/completions): several choices, as engine requests answered as one.

The engine batches the n requests together (they share the prompt, so the prefix
cache serves all but the first prefill). A seeded request gives choice i the seed
`seed + i`, so the choices differ from each other and stay reproducible. With several
prompts, choice `p * n + i` is prompt p's i-th (OpenAI's order) and usage counts each
prompt once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from falcon.asgi import SSEvent

log = logging.getLogger(__name__)

_END = object()
# Events a choice may have waiting for the merged body: enough to interleave, too few to hold a slow client's output.
MERGE_QUEUE_PER_CHOICE = 4


def choice_requests(engine_request: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The n ADD bodies: the same request, seeds offset per choice."""
    seed = engine_request["params"].get("seed")
    if seed is None:
        return [engine_request] * n
    return [{**engine_request, "params": {**engine_request["params"], "seed": seed + i}} for i in range(n)]


def merge_usage(usages: list[dict[str, Any] | None], n: int | None = None) -> dict[str, Any] | None:
    """Choices in prompt order, `n` a prompt (None: all of one prompt): each prompt's tokens counted once, completion
    tokens summed."""
    present = [u for u in usages if u]
    if not present:
        return None
    merged = dict(present[0])
    if n is not None:  # the first present usage of each prompt's choices
        firsts = [next((u for u in usages[p:p + n] if u), None) for p in range(0, len(usages), n)]
        merged["prompt_tokens"] = sum(u["prompt_tokens"] for u in firsts if u)
        details = [(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in firsts if u]
        if "prompt_tokens_details" in merged:
            merged["prompt_tokens_details"] = {**merged["prompt_tokens_details"], "cached_tokens": sum(details)}
    merged["completion_tokens"] = sum(u["completion_tokens"] for u in present)
    merged["total_tokens"] = merged["prompt_tokens"] + merged["completion_tokens"]
    if "completion_tokens_details" in merged:
        merged["completion_tokens_details"] = {"reasoning_tokens": sum(
            (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0) for u in present)}
    return merged


def merge_results(results: list[dict[str, Any]], n: int | None = None) -> dict[str, Any]:
    """Single-choice JSON answers as one answer with choices 0..k-1 (`n` per prompt: `merge_usage`)."""
    merged = dict(results[0])
    merged["choices"] = [{**result["choices"][0], "index": i} for i, result in enumerate(results)]
    merged["usage"] = merge_usage([result.get("usage") for result in results], n)
    return merged


async def merge_event_streams(streams: list[AsyncIterator[SSEvent | None]], include_usage: bool,
                              n: int | None = None) -> AsyncIterator[SSEvent | None]:
    """Interleaves n single-choice SSE bodies into one: choice indexes rewritten, one usage chunk, one [DONE].

    The hand-over queue is bounded (`MERGE_QUEUE_PER_CHOICE` events a choice): a client that
    stops reading stops the pumps, so each choice's output waits in its own `RequestStream`,
    where the slow-client cap (`--max-pending-bytes`) sees it and cuts the client off.
    Closing this generator (client gone) cancels every choice's body, whose own
    `finally` aborts its engine request.
    """
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=MERGE_QUEUE_PER_CHOICE * len(streams))

    async def pump(index: int, stream: AsyncIterator[SSEvent | None]) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
        except Exception:  # one choice's failure ends that choice; the others go on
            log.exception("choice %d of a merged stream failed", index)
        await queue.put((index, _END))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    usages: list[dict[str, Any] | None] = [None] * len(streams)
    usage_template: dict[str, Any] | None = None
    live = len(streams)
    try:
        while live:
            index, event = await queue.get()
            if event is _END:
                live -= 1
                continue
            payload = getattr(event, "json", None) if event is not None else None
            if event is None:
                yield None  # keep-alive
            elif payload is None:
                continue  # one choice's [DONE]: the merged stream sends its own at the end
            elif "choices" in payload and not payload["choices"]:
                usages[index] = payload.get("usage")  # one choice's usage chunk
                usage_template = payload
            else:
                for choice in payload.get("choices", ()):
                    choice["index"] = index
                yield event
        if include_usage and usage_template is not None:
            yield SSEvent(json={**usage_template, "usage": merge_usage(usages, n)})
        yield SSEvent(data=b"[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        # The pumps must have left their bodies before those are closed (`aclose` on a running generator raises).
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
