"""Speculative decoding for a request that runs alone: a small draft model proposes, the model verifies.

`--draft-model` names a model sharing the main model's tokenizer; each round the
draft proposes `--num-draft-tokens` tokens and the main model checks them in one
forward pass (mlx-lm's `speculative_generate_step`). Greedy output is exactly the
main model's: a draft token is kept only where the main model would have chosen it.

Policy (why "alone"): mlx-lm's speculative step serves one sequence, while the
batch serves many in one forward pass; with other requests running, batching is the
better use of the machine. So a request starts in the speculative lane only when it
would be the only one running (`GroupedGenerator`), and the moment another request
is admitted, the lane's request moves into the batch with its KV cache (no
re-prefill) and continues there; nobody waits for it beyond the current step (one
round of at most `num_draft_tokens + 1` tokens; a lone request's prompt prefill,
as in the batch, runs in the step it starts). It does not return to the lane.

Which requests qualify (`eligible`): none with a stateful logits processor (grammar
constraints, thinking budgets: they are called on draft positions that may be
rejected, and would remember tokens that never happen), and not a seeded sampled
request (its key chain would advance differently than in the batch, breaking
"same seed, same output alone or batched"). Stateless processors (logit_bias,
repetition/presence/frequency penalties, which most models' generation_config
sets) are fine: the lane hands them the whole sequence as context, as the batch
does. Greedy requests are the case speculative decoding is for. A `--max-kv-size` rotating cache is not trimmable,
so the lane is off with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences, speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from engine_daemon.cpu import parallel_ops as cpu_parallel
from engine_daemon.models.store import resolve

log = logging.getLogger(__name__)


class IncompatibleDraft(ValueError):
    """The draft model cannot propose tokens for the main model (different vocabulary)."""


def vocab_mismatch(main_vocab: dict[str, int], main_size: int, draft_vocab: dict[str, int],
                   draft_size: int) -> str | None:
    """Why a draft cannot serve a model, or None when its token ids mean the same strings."""
    if main_vocab != draft_vocab:
        differing = sum(1 for token, i in main_vocab.items() if draft_vocab.get(token) != i)
        return (f"the tokenizers differ ({len(main_vocab)} vs {len(draft_vocab)} tokens, {differing} of the "
                "model's tokens map to other ids or are missing in the draft)")
    if draft_size and main_size and draft_size < main_size:
        return f"the draft's embedding has {draft_size} rows but the model can emit ids up to {main_size - 1}"
    return None


def check_draft_paths(model_path: Path, draft_path: Path) -> None:
    """Start-up check from the tokenizer files and configs only (no weights): raises IncompatibleDraft."""
    import json

    from mlx_lm.utils import load_tokenizer

    def vocab_size(path: Path) -> int:
        config = json.loads((path / "config.json").read_text())
        return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)

    why = vocab_mismatch(load_tokenizer(model_path).vocab, vocab_size(model_path),
                         load_tokenizer(draft_path).vocab, vocab_size(draft_path))
    if why:
        raise IncompatibleDraft(f"--draft-model {draft_path} cannot draft for {model_path}: {why}")


def eligible(sampling: dict[str, Any], stateful_processors: list[Any]) -> bool:
    """Whether a request may run speculatively (see the module docstring for why).

    `stateful_processors`: the request's own processors (EngineRequest.processors); the
    sampling ones (make_request_processors) are pure functions of the context.
    """
    if stateful_processors:
        return False
    return not (sampling.get("seed") is not None and float(sampling.get("temperature", 0.0)) > 0)


@dataclass
class SpeculativeStats:
    requests: int = 0
    tokens: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    migrated: int = 0  # lone requests that moved into the batch when others arrived


@dataclass
class SpeculativeDecoder:
    """The draft model (loaded on first use, kept for the engine's life) and the acceptance counters."""

    draft_model: str
    num_draft_tokens: int = 3
    trust_remote_code: bool = False
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    draft: nn.Module | None = None
    draft_loads: int = 0
    # model ref id -> None (compatible) or why not
    verdicts: dict[str, str | None] = field(default_factory=dict)

    def _load_draft(self) -> None:
        from mlx_lm import load as mlx_lm_load

        ref = resolve(self.draft_model, allow_download=True)
        log.info("loading draft model %s from %s", self.draft_model, ref.path)
        self.draft, self._draft_tokenizer, config = mlx_lm_load(
            str(ref.path), return_config=True, trust_remote_code=self.trust_remote_code,
            tokenizer_config={"trust_remote_code": True} if self.trust_remote_code else None)
        self._draft_vocab_size = int(config.get("vocab_size") or 0)
        cpu_parallel.install()
        self.draft_loads += 1

    def draft_for(self, loaded: Any) -> nn.Module | None:
        """The draft to use with `loaded`, or None (not a text model, incompatible, or no trimmable cache)."""
        if loaded.kind != "text":
            return None
        if loaded.ref.id not in self.verdicts:
            try:
                if self.draft is None:
                    self._load_draft()
                why = vocab_mismatch(loaded.tokenizer.vocab, loaded.vocab_size, self._draft_tokenizer.vocab,
                                     self._draft_vocab_size)
                if why is None and not (can_trim_prompt_cache(make_prompt_cache(loaded.model))
                                        and can_trim_prompt_cache(make_prompt_cache(self.draft))):
                    why = "its KV cache cannot be rewound (not trimmable)"
            except Exception as exc:  # a broken draft disables speculation, never the engine
                log.exception("could not load draft model %s", self.draft_model)
                why = f"the draft could not be loaded: {exc}"
            self.verdicts[loaded.ref.id] = why
            if why:
                log.warning("speculative decoding off for %s: draft %s: %s", loaded.ref.id, self.draft_model, why)
            else:
                log.info("speculative decoding on for %s with draft %s (%d draft tokens)", loaded.ref.id,
                         self.draft_model, self.num_draft_tokens)
        return None if self.verdicts[loaded.ref.id] else self.draft

    def describe(self, model_id: str | None) -> dict[str, Any]:
        s = self.stats
        return {"draft_model": self.draft_model, "num_draft_tokens": self.num_draft_tokens,
                # None until the draft has been checked against the loaded model (at its load, or first use)
                "active": None if model_id not in self.verdicts else not self.verdicts[model_id],
                "disabled_reason": self.verdicts.get(model_id) if model_id else None,
                "draft_loads": self.draft_loads, "requests": s.requests, "tokens": s.tokens, "rounds": s.rounds,
                "proposed": s.proposed, "accepted": s.accepted,
                "acceptance_rate": s.accepted / s.proposed if s.proposed else None,
                "tokens_per_round": s.tokens / s.rounds if s.rounds else None, "migrated_to_batch": s.migrated}


def speculative_stats(decoder: SpeculativeDecoder | None, model_id: str | None) -> dict[str, Any]:
    """The `speculative` block of /stats (None when no --draft-model is set)."""
    return {"speculative": decoder.describe(model_id) if decoder is not None else None}


class SpeculativeLane:
    """One sequence decoding speculatively, with BatchGenerator's response types.

    Emits one token per `next()`: a round's tokens come out over several engine steps
    (the work is done on the round's first), so every step still looks at new
    requests and aborts between two tokens.
    """

    def __init__(self, decoder: SpeculativeDecoder, model: Any, draft: nn.Module, stream: Any, uid: int,
                 adapter: str | None, prompt: list[int], max_tokens: int, cache: list[Any] | None,
                 all_tokens: list[int], sampler: Any, processors: list[Any], stop: StopSequences,
                 prefill_step_size: int):
        self.decoder, self.model, self.draft, self.stream = decoder, model, draft, stream
        self.uid, self.adapter = uid, adapter
        self.prompt, self.max_tokens, self.cache_in, self.all_tokens = list(prompt), max_tokens, cache, list(all_tokens)
        self.sampler, self.processors, self.stop = sampler, processors, stop
        self.prefill_step_size = prefill_step_size
        self.history = self.all_tokens + self.prompt  # every token of the sequence so far
        self.generated = 0
        self._matcher = stop.matcher()
        self._tokens: Any = None  # the speculative_generate_step generator, made on the first step
        self._cache: list[Any] = []
        self._in_round = False

    def _start(self) -> None:
        self._cache = self.cache_in if self.cache_in is not None else make_prompt_cache(self.model)
        draft_cache = make_prompt_cache(self.draft)
        with mx.stream(self.stream):
            # A prefix-cache hit covers the model, not the draft: the draft reads the cached part now.
            done = self.all_tokens
            while done:
                chunk, done = done[:self.prefill_step_size], done[self.prefill_step_size:]
                self.draft(mx.array(chunk)[None], cache=draft_cache)
                mx.eval([c.state for c in draft_cache])
        self._tokens = speculative_generate_step(
            mx.array(self.prompt), self.model, self.draft, self.stream,
            num_draft_tokens=self.decoder.num_draft_tokens, max_tokens=self.max_tokens, sampler=self.sampler,
            logits_processors=self._processors_with_context(), prompt_cache=self._cache + draft_cache,
            prefill_step_size=self.prefill_step_size)
        self.decoder.stats.requests += 1

    def _processors_with_context(self) -> list[Any] | None:
        """The processors, seeing the whole sequence as the batch shows it to them.

        speculative_generate_step's context starts at the last prompt token it feeds;
        penalties look further back (the prompt, a cached prefix), so the rest is put in front.
        """
        if not self.processors:
            return None
        before = mx.array(self.history[:-1], dtype=mx.uint32)

        def with_context(processor: Any) -> Any:
            return lambda tokens, logits: processor(mx.concatenate([before, tokens]), logits)

        return [with_context(processor) for processor in self.processors]

    def next(self) -> tuple[list[Any], list[Any]]:
        progress = []
        if self._tokens is None:
            self._start()
            done = len(self.history)
            progress.append(PromptProcessingBatch.Response(self.uid, (done, done), True, True))
        stats = self.decoder.stats
        if not self._in_round:  # this pull drafts and verifies a new round
            stats.rounds += 1
            stats.proposed += min(self.decoder.num_draft_tokens, self.max_tokens - self.generated)
        token, logprobs, from_draft = next(self._tokens)
        token = int(token)
        self._in_round = bool(from_draft)
        stats.accepted += int(bool(from_draft))
        stats.tokens += 1
        self.generated += 1
        self.history.append(token)
        finish = "length" if self.generated >= self.max_tokens else None
        if self._matcher.advance(token):
            finish = "stop"
        cache, tokens = self._finish() if finish else (None, None)
        return progress, [GenerationBatch.Response(self.uid, token, logprobs, finish, cache, tokens)]

    def _finish(self) -> tuple[list[Any], list[int]]:
        """Stops the generator (which rewinds rejected drafts) and returns (KV cache, the tokens it holds)."""
        if self._tokens is not None:
            self._tokens.close()
        offset = min(self._cache[0].offset, len(self.history)) if self._cache else 0
        return self._cache, self.history[:offset]

    def remove(self) -> tuple[list[Any], list[int]]:
        if self._tokens is None:
            return self.cache_in or [], self.all_tokens
        return self._finish()

    def detach(self) -> dict[str, Any]:
        """What the batch needs to continue this sequence where it is (`GroupedGenerator` insert args)."""
        args = {"sampler": self.sampler, "processors": self.processors, "stop": self.stop}
        if self._tokens is None:
            return {**args, "prompt": self.prompt, "max_tokens": self.max_tokens, "cache": self.cache_in,
                    "all_tokens": self.all_tokens}
        cache, _ = self._finish()
        offset = cache[0].offset
        if offset >= len(self.history):  # the batch must feed at least the last token to get the next logits
            trim_prompt_cache(cache, offset - len(self.history) + 1)
            offset = len(self.history) - 1
        self.decoder.stats.migrated += 1
        return {**args, "prompt": self.history[offset:], "max_tokens": self.max_tokens - self.generated,
                "cache": cache, "all_tokens": self.history[:offset]}

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
