"""POST /v1/completions: a raw prompt (no chat template) <-> protocol ADD / DELTAS.

The completion route shares validation, submission and relaying with the chat route
(`parse_sampling`, `serve_generation`); only the prompt and the response shapes
differ. `logprobs` (an integer here: how many alternatives per token) comes back in the
legacy shape (`LegacyLogprobs`), `echo` puts the prompt's text before the completion.
Both together ask for the prompt tokens' own log probabilities, what evaluation harnesses
score (lm-evaluation-harness's loglikelihood tasks): the engine computes them before it
generates (`PromptScoring`), and `max_tokens` 0 then asks for nothing else.
Fields this server cannot honour (`suffix`, `best_of` > 1, several prompts) are refused
with a 400 naming the param, never silently dropped: a client relying on them would
otherwise get a plausible but wrong answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi
from falcon.asgi import SSEvent

from http_frontend.engine.calls import call_engine
from http_frontend.engine.client import RequestStream, Update
from http_frontend.errors import bad_request
from http_frontend.openai.tokenize import PROMPT_TOKEN_IDS, is_token_ids
from http_frontend.parsing.body import get_field, off_loop, read_json_object
from http_frontend.parsing.generation_fields import parse_response_format
from http_frontend.parsing.sampling import check_max_tokens, check_unsupported, parse_sampling
from http_frontend.relay.generation import GenerationRoute, relay, serve_generation, usage_object
from http_frontend.relay.legacy_logprobs import LegacyLogprobs
from http_frontend.service.metrics import TokenTimer
from protocol import CallMethod

# OpenAI's legacy completions default: a request without max_tokens gets 16 tokens, not the chat default.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# `logprobs`: alternatives per token. OpenAI's own cap is 5; chat's `top_logprobs` goes to 20 here, and so does this.
MAX_COMPLETION_LOGPROBS = 20
DETOKENIZE_TIMEOUT = 30.0  # `echo` of a token prompt: the engine's tokenizer turns it back into text
# A token prompt longer than this is checked in the body parser's thread: 7 M ids walked on the event loop held
# every stream of the worker for a second (the engine refuses it by its length, without a walk, anyway).
OFF_LOOP_TOKEN_IDS = 100_000


# Most prompts one request may batch, and most choices in all (prompts times `n`): each is an engine request.
MAX_PROMPTS = 64
MAX_BATCH_CHOICES = 128


def token_count(body: dict[str, Any]) -> int:
    """How many token ids the prompts hold, without reading them (a walk over millions of ids is what
    `OFF_LOOP_TOKEN_IDS` keeps off the event loop)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list):
        return 0
    if prompt and isinstance(prompt[0], list):  # a batch of token prompts
        return sum(len(p) for p in prompt[:MAX_PROMPTS + 1] if isinstance(p, list))
    return len(prompt)


def parse_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The prompts: a string or a list of token ids, or a batch of those (OpenAI's array of prompts: choice
    `p * n + i` is prompt p's i-th); lm-evaluation-harness sends its batches as arrays of token arrays."""
    prompt = get_field(body, "prompt", (str, list), required=True)
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if batch else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"At most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    if batch and not all(isinstance(p, (str, list)) for p in prompts):
        raise bad_request("Invalid 'prompt': an array of prompts holds strings or arrays of token ids",
                          param="prompt", code="invalid_type")
    for index, one in enumerate(prompts):
        where = f"prompt[{index}]" if batch else "prompt"
        if isinstance(one, list) and not is_token_ids(one, PROMPT_TOKEN_IDS):  # one pass in C when it is fine
            if not is_token_ids(one):
                raise bad_request(f"Invalid '{where}': expected a string or an array of token ids", param="prompt",
                                  code="invalid_type")
            raise bad_request(f"Invalid '{where}': token ids cannot be negative", param="prompt")
        if not one:
            raise bad_request(f"'{where}' must not be empty", param="prompt")
    return prompts


def check_completion_unsupported(body: dict[str, Any]) -> None:
    """The chat route's refusals plus the completion-only fields this server does not implement."""
    # `logprobs` is an integer here (a boolean in chat): read by `parse_completion_logprobs`, not check_unsupported.
    check_unsupported({k: v for k, v in body.items() if k != "logprobs"})
    if get_field(body, "suffix", (str,)):
        raise bad_request("'suffix' (insertion) is not supported", param="suffix", code="unsupported_parameter")
    if get_field(body, "best_of", (int,), default=1) != 1:
        raise bad_request("Only best_of=1 is supported", param="best_of", code="unsupported_parameter")


def parse_completion_logprobs(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the engine's logprobs params, `echo`): `logprobs` is how many alternatives each token lists (0: only the
    token's own), `echo` whether the prompt's text comes first. Both together ask for the prompt tokens' own
    log probabilities too (`prompt_logprobs`, with as many alternatives)."""
    count = get_field(body, "logprobs", (int,), minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    echo = get_field(body, "echo", (bool,), default=False)
    if count is None:
        return {}, echo
    return {"logprobs": True, "top_logprobs": count, **({"prompt_logprobs": count} if echo else {})}, echo


def parse_completion_sampling(body: dict[str, Any], settings: Any, scoring: bool) -> dict[str, Any]:
    """The sampling params; `max_tokens` 0 is taken from a request that scores its prompt (`echo` with `logprobs`):
    the prompt's logprobs and nothing generated, as evaluation scripts ask of OpenAI's legacy models."""
    zero = scoring and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    params = parse_sampling({k: v for k, v in body.items() if k != "max_tokens"} if zero else body,
                            settings.max_stop_strings, settings.max_stop_length)
    if zero:
        params["max_tokens"] = 0
    return params


class Completions(GenerationRoute):
    """The completions route: validates, submits a raw prompt to the engine, answers JSON or SSE."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        prompts = (await off_loop(parse_prompts, body) if token_count(body) > OFF_LOOP_TOKEN_IDS
                   else parse_prompts(body))
        check_completion_unsupported(body)
        logprobs, echo = parse_completion_logprobs(body)
        params = {**parse_completion_sampling(body, self.settings, "prompt_logprobs" in logprobs), **logprobs}
        if params.get("max_tokens") is None:
            params["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS
        check_max_tokens(body, params, self.settings.max_tokens_limit)
        model = get_field(body, "model", (str,))
        stream_requested = get_field(body, "stream", (bool,), default=False)
        stream_options = get_field(body, "stream_options", (dict,), default={})
        include_usage = bool(stream_options.get("include_usage"))
        n = get_field(body, "n", (int,), default=1)
        if n * len(prompts) > MAX_BATCH_CHOICES:
            raise bad_request(f"{len(prompts)} prompts with n={n} ask for {n * len(prompts)} choices; at most "
                              f"{MAX_BATCH_CHOICES} are allowed", param="n")
        echoed = [await echoed_prompt(self.client, model, prompt) for prompt in prompts] if echo else None
        extra = {**({"response_format": fmt} if (fmt := parse_response_format(body)) else {}),
                 **({"adapter": adapter} if (adapter := get_field(body, "adapter_path", (str,))) else {})}
        requests = [{"model": model, "prompt": prompt, "params": params, **extra} for prompt in prompts]

        def echo_of(stream: RequestStream) -> str | None:
            return echoed[stream.prompt_index] if echoed is not None else None

        await serve_generation(
            req, resp, self.client, self.request_timeout, self.metrics, requests if len(requests) > 1 else requests[0],
            "cmpl", model, stream_requested,
            events=lambda stream, meta, timer: self._events(stream, meta, include_usage, timer, logprobs,
                                                            echo_of(stream)),
            complete=lambda stream, meta, timer: self._complete(stream, meta, timer, logprobs, echo_of(stream)),
            n=n, include_usage=include_usage)

    async def _complete(self, stream: RequestStream, meta: dict[str, Any], timer: TokenTimer,
                        logprobs: dict[str, Any], echoed: str | None) -> dict[str, Any]:
        text, entries, finish_reason, usage = [echoed or ""], [], None, None
        async for update in relay(stream, self.request_timeout):
            if update is None:
                continue
            timer.on_update(update)
            text.append(update.text)
            entries.extend(update.prompt_logprobs)  # the prompt's, before any generated token's
            entries.extend(update.logprobs)
            finish_reason, usage = update.finish_reason or finish_reason, update.usage or usage
        legacy = LegacyLogprobs().render(entries) if logprobs else None
        return {**meta, "object": "text_completion", "system_fingerprint": None,
                "choices": [{"index": 0, "text": "".join(text), "logprobs": legacy, "finish_reason": finish_reason}],
                "usage": usage_object(usage)}

    def _events(self, stream: RequestStream, meta: dict[str, Any], include_usage: bool, timer: TokenTimer,
                logprobs: dict[str, Any], echoed: str | None) -> AsyncIterator[SSEvent | None]:
        legacy = LegacyLogprobs() if logprobs else None

        def chunk(text: str, finish_reason: str | None = None, entries: list[dict[str, Any]] | None = None) -> SSEvent:
            rendered = legacy.render(entries) if legacy is not None and entries else None
            payload = {**meta, "object": "text_completion", "system_fingerprint": None,
                       "choices": [{"index": 0, "text": text, "logprobs": rendered, "finish_reason": finish_reason}]}
            if include_usage:
                payload["usage"] = None
            return SSEvent(json=payload)

        echo_pending = echoed is not None and "prompt_logprobs" in logprobs

        def render(update: Update) -> list[SSEvent]:
            nonlocal echo_pending
            events = []
            if update.prompt_logprobs:  # the echo comes with the first of the prompt's entries, the rest with ""
                events.append(chunk(echoed if echo_pending else "", entries=update.prompt_logprobs))
                echo_pending = False
            if update.text or update.finish_reason or update.logprobs:
                # The finish reason rides on the chunk with the last text, as OpenAI sends it.
                events.append(chunk(update.text, update.finish_reason, update.logprobs))
            if update.finish_reason and include_usage:
                events.append(SSEvent(json={**meta, "object": "text_completion", "system_fingerprint": None,
                                            "choices": [], "usage": usage_object(update.usage)}))
            return events

        # `echo`: the prompt's text first, as OpenAI streams it (with its logprobs, when those were asked for).
        return self.sse(stream, timer, render, first=chunk(echoed) if echoed and not echo_pending else None)


async def echoed_prompt(client: Any, model: str | None, prompt: str | list[int]) -> str:
    """The prompt's text for `echo`: as sent, or token ids as the tokenizer of an engine serving `model` reads them
    (asked before the request is submitted: a failure then leaves nothing running)."""
    if isinstance(prompt, str):
        return prompt
    result = await call_engine(client, CallMethod.DETOKENIZE, DETOKENIZE_TIMEOUT, {"model": model, "tokens": prompt})
    return result["prompt"]
