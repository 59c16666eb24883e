"""Which engine takes a request: affinity key, rendezvous hashing, bounded load. Pure functions.

Every front-end worker on every host must pick the same engine for the same
conversation without talking to the others, so that a follow-up turn finds its
prompt prefix in that engine's cache. Rendezvous (highest-random-weight) hashing
gives that from the engine ids alone: each engine's weight for a key is a stable
hash of (engine id, key), the highest weight wins, and when an engine leaves only
its own keys move. A stable hash (blake2b), never Python's salted `hash()`.

Bounded load ("consistent hashing with bounded loads", Mirrokni et al.): an engine
whose load would pass `ceil((1 + epsilon) * (total + 1) / n)` is skipped and the
next engine in the key's rendezvous order takes the request, so one hot key cannot
pile a burst onto one engine. The `+ 1` and the ceiling are the usual slack that
lets small counts (one request on an idle pool) stay with the preferred engine;
`min_bound` adds an absolute floor: a few more requests in one engine's decode
batch cost far less than re-prefilling a conversation on another engine, so an
engine is passed over only once it holds more than that many.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Session headers, in precedence order: ours, the common one, Codex's, Claude Code's.
AFFINITY_HEADERS = ("x-session-affinity", "x-session-id", "session-id", "x-claude-code-session-id")
DEFAULT_EPSILON = 0.25
DEFAULT_MIN_BOUND = 8
PROMPT_PREFIX_CHARS = 2048  # a completions prompt: its start names the conversation


@dataclass(frozen=True)
class Candidate:
    """One engine as the router sees it at the moment of a pick."""

    engine_id: str
    load: int  # queued + running on the engine (fresh estimate)
    routable: bool = True  # alive, not stalled, not draining
    serves_model: bool = True  # has the requested model loaded, or can load it


def stable_hash(*parts: str) -> int:
    """A 64-bit hash equal in every process and on every host (unlike `hash()`)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _text(content: Any) -> str:
    """A message's content as text: strings as they are, parts' text joined (images leave no trace)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def affinity_key(headers: Mapping[str, str], *, previous_response_id: str | None = None,
                 prompt_cache_key: str | None = None, user: str | None = None,
                 engine_request: Mapping[str, Any] | None = None) -> str:
    """The key that names a request's conversation, by precedence (header names lower-case).

    An explicit session header, then the Responses `previous_response_id`, the client's
    `prompt_cache_key`, the end `user`, else a digest of the model, the system prompt and
    the first user turn, which stay the same on every turn of one conversation.
    """
    for name in AFFINITY_HEADERS:
        value = headers.get(name)
        if value:
            return f"h:{value}"
    if previous_response_id:
        return f"r:{previous_response_id}"
    if prompt_cache_key:
        return f"k:{prompt_cache_key}"
    if user:
        return f"u:{user}"
    request = engine_request or {}
    model = str(request.get("model") or "")
    messages = request.get("messages")
    if isinstance(messages, list):
        system = next((_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), "")
        first = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
        return f"c:{stable_hash(model, system, first):016x}"
    prompt = request.get("prompt")
    if isinstance(prompt, list):
        prompt = ",".join(map(str, prompt[:PROMPT_PREFIX_CHARS // 4]))
    return f"p:{stable_hash(model, str(prompt or '')[:PROMPT_PREFIX_CHARS]):016x}"


def rendezvous_order(key: str, engine_ids: Sequence[str]) -> list[str]:
    """The engines by descending weight for `key` (ties, never seen in practice, by id)."""
    return sorted(engine_ids, key=lambda engine_id: (-stable_hash(engine_id, key), engine_id))


def load_bound(total: int, engines: int, epsilon: float, min_bound: int = 1) -> int:
    """The most requests one of `engines` may hold once one more arrives: ceil((1+ε)(total+1)/n), at least
    `min_bound`."""
    return max(1, min_bound, math.ceil((1.0 + epsilon) * (total + 1) / max(engines, 1)))


def pick(key: str, candidates: Sequence[Candidate], epsilon: float = DEFAULT_EPSILON,
         preferred: str | None = None, min_bound: int = 1) -> str | None:
    """The engine for a request with `key`; None when no engine can take it.

    Only routable engines count; of those, the ones serving the model when there are
    any, else the idle ones. `preferred` (the engine holding a previous response) goes first when it is
    eligible; then the key's rendezvous order, skipping engines over the load bound.
    When every eligible engine is over the bound (cannot happen with epsilon > 0, kept
    for safety) the least loaded one in rendezvous order takes it.
    """
    routable = [c for c in candidates if c.routable]
    # No engine serves the model: an idle one loads it (a busy one first ran its streams out, then switched
    # models and back for them: 18-37 s for that request); only when none is idle does a busy one queue it.
    eligible = [c for c in routable if c.serves_model] or [c for c in routable if not c.load] or routable
    if not eligible:
        return None
    by_id = {c.engine_id: c for c in eligible}
    bound = load_bound(sum(c.load for c in eligible), len(eligible), epsilon, min_bound)
    order = rendezvous_order(key, list(by_id))
    if preferred in by_id:
        order.remove(preferred)
        order.insert(0, preferred)
    for engine_id in order:
        if by_id[engine_id].load + 1 <= bound:
            return engine_id
    return min(order, key=lambda engine_id: by_id[engine_id].load)
