"""The `tokenize` / `detokenize` CALLs: the loaded model's tokenizer, run on the mlx thread.

They never load or switch models: counting tokens must not evict the model that
serves generation, so a name that another model would serve is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine_daemon.errors import RequestError
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.store import ModelRef
from engine_daemon.request.preprocess import check_size
from engine_daemon.request.prompt import build_prompt

log = logging.getLogger(__name__)

Resolver = Callable[[str], ModelRef]  # a request's model name -> the model serving it, never downloading


def _loaded_model(loaded: LoadedModel | None, name: Any, resolve: Resolver | None) -> LoadedModel:
    """The loaded model, when the name the request gave (if any) is served by it.

    The name resolves as generation resolves it (`BaseScheduler.resolve_model`: aliases, names under
    --model-dir, --model-fallback), so an agent's `claude-…` counts with the model that answers it.
    """
    if loaded is None:
        raise RequestError(400, "model_not_loaded",
                           "No model is loaded: tokenization uses the loaded model's tokenizer; "
                           "send a completion request (or start engined with --model) first", param="model")
    if not name or name == "default" or name in (loaded.ref.id, str(loaded.ref.path)):
        return loaded
    if resolve is not None and resolve(name) == loaded.ref:  # a 404 for unknown names comes from here
        return loaded
    raise RequestError(400, "model_not_loaded",
                       f"Model '{name}' is not loaded (the engine has '{loaded.ref.id}'); omit 'model' or "
                       "name the loaded one", param="model")


def tokenize(loaded: LoadedModel | None, args: dict[str, Any], resolve: Resolver | None = None) -> dict[str, Any]:
    """Token ids of a raw prompt (the tokenizer's own special-token rules) or of chat messages.

    Messages go through the chat template with the generation prompt, exactly as a chat
    request is built, so the count is what /v1/chat/completions would see.
    """
    model = _loaded_model(loaded, args.get("model"), resolve)
    messages, prompt = args.get("messages"), args.get("prompt")
    if messages is not None:
        if not isinstance(messages, list):
            raise RequestError(400, "invalid_type", "'messages' must be an array", param="messages")
        body: dict[str, Any] = {"messages": messages, "chat_template_kwargs": args.get("chat_template_kwargs"),
                                "tools": args.get("tools")}  # tool definitions are part of the templated prompt
    elif isinstance(prompt, str):
        body = {"prompt": prompt}
    else:
        raise RequestError(400, "missing_required_parameter", "Give 'prompt' (a string) or 'messages'",
                           param="prompt")
    check_size(body, model)  # what cannot fit the window is refused by its bytes, as for generation
    tokens = [int(t) for t in build_prompt(model, body)]
    return {"tokens": tokens, "count": len(tokens), "max_model_len": model.context_window,
            "model": model.ref.id}


def detokenize(loaded: LoadedModel | None, args: dict[str, Any], resolve: Resolver | None = None
               ) -> dict[str, Any]:
    """Text of token ids; ids outside the vocabulary are refused rather than decoded to ''."""
    model = _loaded_model(loaded, args.get("model"), resolve)
    tokens = args.get("tokens")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise RequestError(400, "invalid_type", "'tokens' must be an array of integers", param="tokens")
    vocab_size = model.vocab_size or len(model.tokenizer.get_vocab())
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(400, "invalid_value", f"Token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param="tokens")
    return {"prompt": model.tokenizer.decode(tokens), "model": model.ref.id}
