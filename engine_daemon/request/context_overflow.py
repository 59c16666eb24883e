"""When a chat does not fit the context window: refuse it, drop its oldest turns, or summarise them.

`--context-overflow` (or a models-config entry's `context_overflow`) picks the mode:

- `error` (default): 400 `context_length_exceeded`, from `requests.settle_max_tokens`.
- `truncate`: drop the oldest non-system messages until prompt + max_tokens fits. Cuts
  prefer to leave a user message first (templates that insist on user/assistant
  alternation accept that), never orphan a tool result, and always keep the last message.
- `summarize`: keep the system messages and the last `KEEP_LAST` messages; the older
  turns are summarised by the loaded model (greedy, at most `SUMMARY_MAX_TOKENS`) into
  a note on the first system message, then the prompt is built once more. If it
  still does not fit, the request is refused.

Why the summary runs synchronously, here on the mlx thread, inside admission: it is a
short, bounded generation (at most `SUMMARY_INPUT_TOKENS` of transcript prefilled,
`SUMMARY_MAX_TOKENS` decoded) and it keeps the scheduler untouched. The trade-off:
requests already decoding pause for that long (about one long prefill plus 128
decode steps); a large window is never prefilled in full for a summary, because the
transcript is cut to its head and tail first.

A request may pick its own mode in the ADD's `context_overflow` ("truncate" or "error"):
the Responses API's `truncation: "auto"` / `"disabled"` is a client's choice, over the model's.

Whichever happened is recorded on the request (`context_overflow`: mode and number of
dropped messages); the ACCEPTED frame carries it, and the front-end reports it in the
`X-Context-Overflow` header and in `usage.context_overflow`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine_daemon.errors import RequestError
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.request.prompt import build_prompt
from engine_daemon.request.state import EngineRequest

log = logging.getLogger(__name__)

KEEP_LAST = 6  # messages `summarize` keeps verbatim (besides the system messages)
SUMMARY_MAX_TOKENS = 128
SUMMARY_INPUT_TOKENS = 1024  # transcript tokens a summary reads at most (its head and tail)
SUMMARY_INSTRUCTION = ("Summarize the conversation below in a few sentences. Keep facts, names, numbers, "
                       "decisions and open questions. Write only the summary.")


# Set on an ADD body whose oldest turns `preprocess.drop_oversized_turns` removed: `fit_context` reports them too.
DROPPED_BY_SIZE = "_dropped_by_size"
REQUEST_MODES = ("error", "truncate")  # what an ADD may ask for itself: a summary is the operator's call


def overflow_mode(body: dict[str, Any], loaded: LoadedModel) -> str:
    """The request's own mode (ADD `context_overflow`), else its model's; an unknown one is refused."""
    asked = body.get("context_overflow")
    if asked is None:
        return loaded.profile.context_overflow
    if asked not in REQUEST_MODES:
        raise RequestError(400, "invalid_value", f"context_overflow must be one of {', '.join(REQUEST_MODES)}, "
                           f"not {asked!r}", param="context_overflow")
    return str(asked)


def overflows(prompt_len: int, requested: int | None, window: int) -> bool:
    """What `settle_max_tokens` would refuse: no room left, or not enough for the requested tokens."""
    return prompt_len >= window if requested is None else prompt_len + requested > window


def fit_context(request: EngineRequest, loaded: LoadedModel, default_max_tokens: int) -> None:
    """Shrinks an overflowing chat request per its model's overflow mode (no-op when it fits or mode is error).

    Raw prompts and media requests are left alone: only chat messages can be dropped.
    """
    mode = overflow_mode(request.body, loaded)
    messages = request.body.get("messages")
    window = loaded.context_window
    if mode == "error" or not messages or window is None or loaded.kind != "text" or request.body.get("media"):
        return
    requested = request.params.get("max_tokens")
    before = len(request.prompt_tokens)
    by_size = request.body.get(DROPPED_BY_SIZE, 0)  # turns too large to ever fit, dropped before rendering
    if not overflows(before, requested, window):
        if by_size:
            request.context_overflow = {"mode": "truncated", "dropped_messages": by_size}
        return
    # Without max_tokens, leave the reply some room (a quarter of the window at most), not a single token.
    reserve = requested or min(default_max_tokens, max(1, window // 4))
    budget = window - reserve
    if budget < 1:
        return  # max_tokens alone fills the window: settle_max_tokens explains that
    if mode == "truncate":
        result = truncate(loaded, request.body, budget)
        label = "truncated"
    else:
        result = summarize(loaded, request.body, budget, request.rid)
        label = "summarized"
    if result is None:
        return  # nothing could be dropped: refused by settle_max_tokens as usual
    kept, tokens, dropped = result
    if len(tokens) > budget:  # only a summary can land here: it was the one retry
        raise RequestError(400, "context_length_exceeded",
                           f"This model's maximum context length is {window} tokens. Even after summarizing "
                           f"{dropped} older messages the prompt has {len(tokens)} tokens, and {reserve} more "
                           "are needed for the completion", param="messages")
    request.body = {**request.body, "messages": kept}
    request.prompt_tokens = tokens
    dropped += by_size
    request.context_overflow = {"mode": label, "dropped_messages": dropped}
    log.info("rid=%s context overflow (%s): %d message(s) dropped, prompt %d -> %d tokens (window %d, reserve %d)",
             request.rid, label, dropped, before, len(tokens), window, reserve)


def _prompt(loaded: LoadedModel, body: dict[str, Any], messages: list[dict[str, Any]]) -> list[int] | None:
    """The prompt with these messages; None when the template refuses them (e.g. a broken alternation)."""
    try:
        return build_prompt(loaded, {**body, "messages": messages})
    except RequestError:
        return None


def truncate(loaded: LoadedModel, body: dict[str, Any],
             budget: int) -> tuple[list[dict[str, Any]], list[int], int] | None:
    """The fewest oldest non-system messages to drop so the prompt has at most `budget` tokens.

    Returns (kept messages, their prompt, messages dropped), or None when even the
    system messages plus the last message do not fit.
    """
    messages = body["messages"]
    movable = [i for i, message in enumerate(messages) if message.get("role") != "system"]

    def kept(k: int) -> list[dict[str, Any]]:
        dropped = set(movable[:k])
        return [message for i, message in enumerate(messages) if i not in dropped]

    def role_after(k: int) -> str | None:
        return messages[movable[k]].get("role")

    cuts = range(1, len(movable))  # drop movable[:k]; the last message always stays
    for candidates in ([k for k in cuts if role_after(k) == "user"], [k for k in cuts if role_after(k) != "tool"]):
        found = _smallest_fitting(candidates, lambda k: _prompt(loaded, body, kept(k)), budget)
        if found is not None:
            k, tokens = found
            return kept(k), tokens, k
    return None


def _smallest_fitting(candidates: list[int], build: Callable[[int], list[int] | None],
                      budget: int) -> tuple[int, list[int]] | None:
    """Binary search for the smallest cut whose prompt fits (dropping more never makes a prompt longer)."""
    best: tuple[int, list[int]] | None = None
    low, high = 0, len(candidates) - 1
    while low <= high:
        middle = (low + high) // 2
        tokens = build(candidates[middle])
        if tokens is not None and len(tokens) <= budget:
            best = (candidates[middle], tokens)
            high = middle - 1
        else:
            low = middle + 1
    return best


def summarize(loaded: LoadedModel, body: dict[str, Any], budget: int,
              rid: str) -> tuple[list[dict[str, Any]], list[int], int] | None:
    """System messages (the first one carrying a summary of the older turns) + the last KEEP_LAST messages.

    The summary gets the room the kept messages leave under `budget`: it is generated
    with at most that many tokens, and cut to it once more if its text re-encodes
    longer. Returns (messages, prompt, messages summarised), or None when there is
    nothing older to summarise, no room for a note, or no summary could be made.
    """
    messages = body["messages"]
    older, recent = messages[:-KEEP_LAST], messages[-KEEP_LAST:]
    dropped = [message for message in older if message.get("role") != "system"]
    if not dropped:
        return None
    systems = [dict(message) for message in older if message.get("role") == "system"]

    def with_note(summary: str) -> list[dict[str, Any]]:
        note = f"Summary of the earlier conversation: {summary}"
        if not systems:
            return [{"role": "system", "content": note}, *recent]
        first = systems[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{note}".strip()}, *systems[1:], *recent]

    base = _prompt(loaded, body, with_note(""))
    room = budget - len(base) if base is not None else 0
    if room < 8:
        log.info("rid=%s no room to summarize: the last %d messages leave %d tokens", rid, KEEP_LAST, room)
        return None
    started = time.perf_counter()
    try:
        summary = generate_summary(loaded, dropped, max_tokens=min(SUMMARY_MAX_TOKENS, room))
    except Exception:  # a failed summary must not fail the step that admitted the request
        log.exception("rid=%s could not summarize older messages", rid)
        return None
    log.info("rid=%s summarized %d message(s) in %.2f s", rid, len(dropped), time.perf_counter() - started)
    kept = with_note(summary)
    tokens = _prompt(loaded, body, kept)
    if tokens is not None and len(tokens) > budget:  # the text re-encoded longer than it was generated: cut it
        ids = list(loaded.tokenizer.encode(summary, add_special_tokens=False))
        keep = max(0, len(ids) - (len(tokens) - budget) - 2)
        log.info("rid=%s summary re-encodes to %d tokens: cut to %d", rid, len(ids), keep)
        kept = with_note(loaded.tokenizer.decode(ids[:keep]).strip())
        tokens = _prompt(loaded, body, kept)
    return (kept, tokens, len(dropped)) if tokens is not None else None


def transcript(messages: list[dict[str, Any]]) -> str:
    """The turns to summarise as plain `role: text` lines (tool calls named with their arguments)."""
    lines = []
    for message in messages:
        text = message.get("content") or ""
        calls = [call.get("function", {}) for call in message.get("tool_calls") or [] if isinstance(call, dict)]
        if calls:
            named = "; ".join(f"{c.get('name')}({c.get('arguments')})" for c in calls)
            text = f"{text} [called {named}]".strip()
        lines.append(f"{message.get('role')}: {text}")
    return "\n".join(lines)


def _summary_prompt(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "system", "content": SUMMARY_INSTRUCTION}, {"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False))


def _head_and_tail(tokenizer: Any, text: str, limit: int) -> str:
    """`text` cut to about `limit` tokens: its beginning and its end, which say the most."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) <= limit:
        return text
    half = max(1, limit // 2 - 4)  # a little slack: decoded text may re-encode a few tokens longer
    return tokenizer.decode(ids[:half]) + "\n[...]\n" + tokenizer.decode(ids[-half:])


def generate_summary(loaded: LoadedModel, messages: list[dict[str, Any]], max_tokens: int = SUMMARY_MAX_TOKENS) -> str:
    """A greedy summary of `messages` in at most `max_tokens` tokens by the loaded model (on the mlx thread)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokenizer = loaded.tokenizer
    window = loaded.context_window or SUMMARY_INPUT_TOKENS * 2
    overhead = len(_summary_prompt(tokenizer, ""))
    room = min(SUMMARY_INPUT_TOKENS, window - max_tokens - overhead)
    if room < 16:
        raise ValueError(f"a {window}-token window leaves no room to summarize")
    prompt = _summary_prompt(tokenizer, _head_and_tail(tokenizer, transcript(messages), room))
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    for token, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens,
                                  sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)):
        token = int(token)
        if token in eos:
            break
        if token not in special:  # markup tokens in the note would break the template's structure
            detokenizer.add_token(token)
    detokenizer.finalize()
    text = detokenizer.text
    think_end = getattr(tokenizer, "think_end", None)
    if think_end and think_end in text:
        text = text.rsplit(think_end, 1)[1]
    return text.strip()
