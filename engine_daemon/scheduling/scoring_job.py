"""A scored prompt's own pass through the model (`PromptScoring`): its KV, its rows, the entries they give.

A prompt's positions go through in slices: a pass of their own (`step`), or riding in the streams'
decode pass (`side_slice`, `SideSlice`), whose rows are read once that step's graph is evaluated
(`read_riding`). Either way as a prompt's prefill is computed (`prefilling`), so the KV left in
`cache` is the one a batch prefill of the same tokens would hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine_daemon.cpu.prefill_scope import prefilling
from engine_daemon.generation.side_slice import SideSlice
from engine_daemon.output.tokens import describe_token
from engine_daemon.request.state import EngineRequest
from engine_daemon.scheduling.scored_prefixes import ScoredPrefix

PARAM = "prompt_logprobs"  # the ADD param: how many alternatives each prompt token lists (0: its own only)


@dataclass(eq=False)  # jobs are told apart by identity (`PromptScoring._head`)
class ScoringJob:
    """One request's prompt on its way through the model: `fed` positions are in `cache` (or in a step's graph,
    `riding`), the first `done` of them with their rows."""

    request: EngineRequest
    model: Any  # the model bound to the request's adapter (`AdapterManager.bind`)
    tokenizer: Any
    max_kv_size: int | None = None  # the generator's own cache layout (`--max-kv-size`): the KV joins its batch
    key: Hashable | None = None  # the prefix cache's key for this model and adapter (None: nothing reused or kept)
    started: bool = False  # chosen to run (`PromptScoring._head`): it runs until its prompt is through
    cache: list[Any] | None = None
    done: int = 0
    fed: int = 0
    riding: deque[SideSlice] = field(default_factory=deque)  # slices in decode steps, rows not read yet
    reused: int = 0  # leading positions whose KV and rows came from an earlier prompt (`ScoredPrefixes`)
    emitted: int = 0  # entries sent so far, the first token's included
    # Row i: what the model gave `tokens[i + 1]` (its logprob, the `top` most likely tokens and theirs).
    chosen: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_tokens

    @property
    def top(self) -> int:
        return int(self.request.params.get(PARAM) or 0)

    @property
    def finished(self) -> bool:
        return self.done >= len(self.tokens) - 1  # the last token is fed in the batch: its logits are a new token's

    def resume(self, cache: list[Any], cached: int, prefix: ScoredPrefix) -> None:
        """Starts after `cached` positions whose KV is `cache` and whose rows `prefix` holds."""
        top = self.top
        self.cache, self.done, self.fed, self.reused = cache, cached, cached, cached
        self.chosen = prefix.chosen[:cached].tolist()
        self.top_ids = prefix.top_ids[:cached, :top].tolist()
        self.top_values = prefix.top_values[:cached, :top].tolist()

    @property
    def unsent_rows(self) -> int:
        """Entries computed (or reused) and not sent yet, the first token's included."""
        return self.done + 1 - self.emitted if self.done or self.finished else 0

    def step(self, budget: int) -> None:
        """Feeds the next `budget` positions in a pass of its own (nothing riding)."""
        self._start()
        end = min(len(self.tokens) - 1, self.fed + budget)
        if end > self.fed:
            with prefilling():
                logits = self.model(mx.array(self.tokens[self.fed:end])[None], cache=self.cache)
            self._add_rows(logits[0], [c.state for c in self.cache])

    def side_slice(self, budget: int, adapter: str | None) -> SideSlice | None:
        """The next `budget` positions to ride in a decode step (`SideSlice`); `rode` once they did."""
        self._start()
        end = min(len(self.tokens) - 1, self.fed + budget)
        return SideSlice(adapter, self.tokens[self.fed:end], self.cache) if end > self.fed else None

    def rode(self, side: SideSlice) -> None:
        self.fed += len(side.inputs)
        self.riding.append(side)

    def read_riding(self, through_step: int) -> None:
        """Reads the rows of slices that rode in steps up to `through_step`."""
        while self.riding and self.riding[0].step <= through_step:
            self._add_rows(self.riding.popleft().logits, [])

    def _start(self) -> None:
        if self.cache is None:
            self.cache = make_prompt_cache(self.model, max_kv_size=self.max_kv_size)

    def _add_rows(self, logits: mx.array, evaluated_with: list[Any]) -> None:
        """The rows of the positions after `done` from their logits (one per position)."""
        top = self.top
        targets = self.tokens[self.done + 1:self.done + 1 + logits.shape[0]]
        chosen, ids, values = logprob_rows(logits[:len(targets)], targets, top, evaluated_with)
        self.chosen += chosen
        self.top_ids += ids if top else [[] for _ in chosen]
        self.top_values += values if top else [[] for _ in chosen]
        self.done += len(targets)
        self.fed = max(self.fed, self.done)

    def scored(self) -> ScoredPrefix:
        """What this prompt's rows give a later prompt sharing its start (`ScoredPrefixes`)."""
        return ScoredPrefix.of(self.key, self.tokens, self.chosen, self.top_ids, self.top_values, self.top)

    def unsent(self, most: int | None = None) -> list[dict[str, Any]]:
        """The entries not sent yet, at most `most` (each is a token's text and bytes, and its alternatives')."""
        count = self.unsent_rows if most is None else min(most, self.unsent_rows)
        top = self.top
        entries: list[dict[str, Any]] = []
        for _ in range(count):
            row = self.emitted - 1  # the row of the entry's token (the first token has none: nothing predicts it)
            if row < 0:
                entries.append(self._entry(self.tokens[0], None, None, None))
            else:
                entries.append(self._entry(self.tokens[row + 1], self.chosen[row], self.top_ids[row] if top else None,
                                           self.top_values[row] if top else None))
            self.emitted += 1
        return entries

    def _entry(self, token: int, logprob: float | None, ids: list[int] | None,
               values: list[float] | None) -> dict[str, Any]:
        """The chat logprobs entry shape (`logprob_entries`): None logprob and alternatives for the first token."""
        entry = self._describe(token, logprob)
        if ids is None or values is None:
            entry["top_logprobs"] = None if logprob is None else []
        else:
            pairs = sorted(zip(ids, values), key=lambda pair: -pair[1])
            entry["top_logprobs"] = [self._describe(i, v) for i, v in pairs]
        return entry

    def _describe(self, token: int, logprob: float | None) -> dict[str, Any]:
        return describe_token(self.tokenizer, token, logprob)


def logprob_rows(logits: mx.array, targets: list[int], top: int,
                 evaluated_with: list[Any]) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """For each position's logits (P, vocab), the log probability of `targets`' token there and the `top` most
    likely tokens with theirs (evaluated together with `evaluated_with`: the pass's KV)."""
    rows = logits.astype(mx.float32)
    if mx.default_device() == mx.cpu:
        mx.eval(rows, evaluated_with)
        return _numpy_logprobs(np.array(rows), targets, top)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
    arrays = [chosen]
    if top:
        ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        arrays += [ids, mx.take_along_axis(logprobs, ids, axis=-1)]
    mx.eval(*arrays, evaluated_with)
    lists = [array.tolist() for array in arrays]
    return lists[0], (lists[1] if top else []), (lists[2] if top else [])


def _numpy_logprobs(logits: np.ndarray, targets: list[int],
                    top: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """`logprob_rows`' log-softmax on the CPU in NumPy: MLX's x86 build takes `exp` one element at a time
    (~12-16 ns; NumPy's vectorised one ~1 ns), and a slice has an `exp` per vocabulary entry per position:
    128 positions of a 32k vocabulary took 60 ms in MLX, 13 ms here (`prefill_attention` has the same reason)."""
    peak = logits.max(axis=1, keepdims=True)
    shifted = logits - peak
    np.exp(shifted, out=shifted)
    normaliser = np.log(shifted.sum(axis=1, keepdims=True)) + peak  # log of the sum of exp(logits)
    rows = np.arange(len(targets))
    chosen = (logits[rows, np.asarray(targets)] - normaliser[:, 0]).tolist()
    if not top:
        return chosen, [], []
    # The most likely: an argmax for one (lm-evaluation-harness asks for one), else the top of a partition taken
    # from the high end (partitioning the negated table at 0 took 5x as long: 340 against 70 ms for 524 rows).
    ids = np.argmax(logits, axis=1)[:, None] if top == 1 else np.argpartition(logits, -top, axis=1)[:, -top:]
    return chosen, ids.tolist(), (np.take_along_axis(logits, ids, axis=1) - normaliser).tolist()
