"""Admission of one request: prompt, limits, sampling and decoding state, or a refusal.

Turns an ADD body into a prompt (chat template or raw text), settles max_tokens
against the context window, checks sampling values and sets up the request's output
decoding (stop strings, reasoning/tool parser) and constraints (grammar, thinking
budget). Errors carry the HTTP-ish status the front-end returns, so admission problems
surface before the first token.
"""

from __future__ import annotations

import logging
from typing import Any

from engine_daemon.errors import RequestError
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.output.parser import OutputParser
from engine_daemon.output.stop_strings import MAX_STOP_LENGTH, MAX_STOP_STRINGS, StopStringMatcher
from engine_daemon.output.token_text import request_detokenizer
from engine_daemon.request.context_overflow import fit_context
from engine_daemon.request.param_checks import check_params, check_stops, parse_logit_bias
from engine_daemon.request.preprocess import TOKEN_PROMPTS, check_token_prompt, model_key
from engine_daemon.request.prompt import build_prompt, template_tools
from engine_daemon.request.state import EngineRequest, PreparedPrompt
from engine_daemon.sampling.request_processors import build_processors, processor_spec
from engine_daemon.sampling.thinking import prompt_in_thinking

log = logging.getLogger(__name__)

def settle_max_tokens(loaded: LoadedModel, prompt_len: int, requested: int | None, default: int,
                      minimum: int = 1) -> int:
    """max_tokens for a request, or RequestError when the context window cannot hold it; `minimum` 0 for a
    request that scores its prompt (`prompt_logprobs`) and may generate nothing."""
    window = loaded.context_window
    if prompt_len == 0:
        raise RequestError(400, "empty_prompt", "The prompt is empty", param="messages")
    if requested is not None and requested < minimum:
        raise RequestError(400, "invalid_value", f"max_tokens must be at least {minimum}", param="max_tokens")
    if window is None:
        return requested or default
    if prompt_len >= window:
        raise RequestError(400, "context_length_exceeded",
                           f"This model's maximum context length is {window} tokens, "
                           f"but the prompt has {prompt_len} tokens", param="messages")
    if requested is None:
        return min(default, window - prompt_len)
    if prompt_len + requested > window:
        raise RequestError(400, "context_length_exceeded",
                           f"This model's maximum context length is {window} tokens. However, you "
                           f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
                           f"{requested} in the completion)", param="max_tokens")
    return requested


def clamp_to_window(request: EngineRequest, loaded: LoadedModel) -> None:
    """`--max-tokens-overflow clamp`: a max_tokens past the window becomes what the window has left.

    Why: agents ask for their vendor model's whole output budget whatever model answers (Claude
    Code sends `max_tokens: 128000` with every request), which no local window holds; OpenAI
    would refuse, but the client users run wins. A prompt that alone fills the window is still
    refused (or truncated / summarized per --context-overflow).
    """
    window, requested, prompt_len = loaded.context_window, request.params.get("max_tokens"), len(request.prompt_tokens)
    if not window or not isinstance(requested, int) or prompt_len >= window or prompt_len + requested <= window:
        return
    request.body["params"] = {**request.params, "max_tokens": window - prompt_len}
    log.info("rid=%s max_tokens %d clamped to %d: the %d-token window holds a %d-token prompt", request.rid,
             requested, window - prompt_len, window, prompt_len)


def resolve_sampling(loaded: LoadedModel, params: dict[str, Any], server_defaults: dict[str, Any]) -> dict[str, Any]:
    """Request field, else the model's generation_config.json, else the server's flags."""
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed")
    merged = {}
    for key in keys:
        for source in (params, loaded.generation_defaults, server_defaults):
            if source.get(key) is not None:
                merged[key] = source[key]
                break
    if 0 < merged.get("temperature", 0) < GREEDY_BELOW:
        merged["temperature"] = 0.0
    return merged


# A temperature this small is greedy (vLLM's _SAMPLING_EPS). Why: the sampler scales logits by 1/temperature,
# which below ~1e-38 overflows float32 to -inf everywhere, and the draw was uniform over the whole vocabulary,
# past every filter, logit bias and grammar mask (a structured request then failed with 500).
GREEDY_BELOW = 1e-5


def prepared_for(request: EngineRequest, loaded: LoadedModel) -> PreparedPrompt | None:
    """What was prepared off the mlx thread for this very load (taken off the request), else None."""
    prepared, request.prepared = request.prepared, None
    return prepared if prepared is not None and prepared.model_key == model_key(loaded) else None


def prepared_tokens(request: EngineRequest, loaded: LoadedModel, prepared: PreparedPrompt | None) -> list[int]:
    """The prompt's token ids: as prepared off the mlx thread, else rendered now."""
    if prepared is not None:
        if prepared.error is not None:
            raise prepared.error
        if prepared.tokens is not None:
            return prepared.tokens
    return build_prompt(loaded, request.body)


def prepare(request: EngineRequest, loaded: LoadedModel, default_max_tokens: int,
            server_defaults: dict[str, Any],
            stop_limits: tuple[int, int] = (MAX_STOP_STRINGS, MAX_STOP_LENGTH), clamp_max_tokens: bool = True) -> None:
    """Fills in prompt, limits, sampling and decoding state; raises RequestError to refuse."""
    request.model_id = loaded.ref.id
    prepared = prepared_for(request, loaded)
    check_params(request.params)
    check_stops(request.params.get("stop"), *stop_limits)
    unchecked = prepared is None or (prepared.tokens is None and prepared.error is None)  # else the pool checked it
    if isinstance(request.body.get("prompt"), TOKEN_PROMPTS) and unchecked:
        request.body["prompt"] = check_token_prompt(request.body["prompt"], loaded)  # its length first, then its ids
    request.prompt_tokens = prepared_tokens(request, loaded, prepared)
    # models-config max_tokens default; --context-overflow truncate/summarize (fit_context)
    default_max_tokens = loaded.profile.max_tokens or default_max_tokens
    if clamp_max_tokens:
        clamp_to_window(request, loaded)
    fit_context(request, loaded, default_max_tokens)
    try:
        request.max_tokens = settle_max_tokens(loaded, len(request.prompt_tokens),
                                               request.params.get("max_tokens"), default_max_tokens,
                                               0 if request.params.get("prompt_logprobs") is not None else 1)
    except RequestError as exc:
        if exc.param == "messages" and request.body.get("messages") is None:
            exc.param = "prompt"  # a raw-prompt request (/v1/completions): name the field it sent
        raise
    request.sampling = resolve_sampling(loaded, request.params, server_defaults)
    request.sampling["logit_bias"] = parse_logit_bias(request.params.get("logit_bias"), loaded.vocab_size)
    request.stop = StopStringMatcher(request.params.get("stop"))
    # A raw prompt's completion continues the client's text: its first leading space is kept.
    request.detokenizer = request_detokenizer(loaded.tokenizer, continues_prompt=request.body.get("messages") is None)
    # Reasoning and tool calls are split out of the text here, once, for every front-end.
    in_thinking = prompt_in_thinking(loaded.tokenizer, request.prompt_tokens)
    request.parser = OutputParser(loaded.tokenizer, in_thinking=in_thinking, tools=template_tools(request.body))
    # Thinking budget, structured output / forced tool calls (a grammar constraint: constraint_for, llguidance),
    # from a spec an engine group's followers rebuild them from (`build_processors`).
    request.processor_spec = processor_spec(request.params, request.body)
    if prepared is not None and prepared.processors is not None and prepared.in_thinking == in_thinking:
        request.processors += prepared.processors  # built off the mlx thread (`prepare_prompt`)
    else:
        request.processors += build_processors(loaded.tokenizer, request.processor_spec, in_thinking)
    # ignore_eos (a vLLM extension): generate exactly max_tokens, as benchmarks need.
    if not request.params.get("ignore_eos"):
        request.eos_token_ids = frozenset(loaded.tokenizer.eos_token_ids)
