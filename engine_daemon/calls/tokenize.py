"""The `tokenize` / `detokenize` CALLs: the loaded model's tokenizer, run on the admission pool.

They never load or switch models: counting tokens must not evict the model that
serves generation, so a name that another model would serve is refused.

`tokenize` with `{"tokenizer_info": true}` answers what a client needs to tokenize as the
engine does (special tokens, chat template, whether a BOS is added): lm-evaluation-harness's
remote tokenizer reads it from `GET /tokenizer_info`. It rides on this CALL because it needs the
same model resolution and thread, and a CALL method of its own would change the wire contract.
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
    """Token ids of a raw prompt (the tokenizer's own special-token rules, or `add_special_tokens` as asked)
    or of chat messages.

    Messages go through the chat template with the generation prompt, exactly as a chat
    request is built, so the count is what /v1/chat/completions would see.
    """
    model = _loaded_model(loaded, args.get("model"), resolve)
    if args.get("tokenizer_info") is True:
        return {**tokenizer_info(model), "model": model.ref.id}
    messages, prompt = args.get("messages"), args.get("prompt")
    add_special_tokens = args.get("add_special_tokens")
    if add_special_tokens is not None and not isinstance(add_special_tokens, bool):
        raise RequestError(400, "invalid_type", "'add_special_tokens' must be a boolean", param="add_special_tokens")
    if messages is not None:
        if not isinstance(messages, list):
            raise RequestError(400, "invalid_type", "'messages' must be an array", param="messages")
        if add_special_tokens:  # the template writes its own special tokens; a chat request adds none on top
            raise RequestError(400, "invalid_value", "'add_special_tokens' applies to 'prompt' only: messages are "
                               "tokenized as the chat template renders them, as a chat request is",
                               param="add_special_tokens")
        body: dict[str, Any] = {"messages": messages, "chat_template_kwargs": args.get("chat_template_kwargs"),
                                "tools": args.get("tools")}  # tool definitions are part of the templated prompt
    elif isinstance(prompt, str):
        body = {"prompt": prompt}
    else:
        raise RequestError(400, "missing_required_parameter", "Give 'prompt' (a string) or 'messages'",
                           param="prompt")
    check_size(body, model)  # what cannot fit the window is refused by its bytes, as for generation
    if isinstance(prompt, str) and messages is None and add_special_tokens is not None:
        # Absent, the tokenizer's own rules apply, as for a completion's prompt (`build_prompt`)
        tokens = [int(t) for t in model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    else:
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


def _token_text(value: Any) -> str | None:
    """A special token as text: transformers gives a str, older versions an `AddedToken` (its `content`)."""
    if value is None:
        return None
    return value if isinstance(value, str) else str(getattr(value, "content", value))


def _chat_template(tokenizer: Any) -> str | None:
    """The Jinja template `apply_chat_template` renders (a --chat-template-file one included), or None.

    None too when mlx-lm renders with a Python renderer the checkpoint ships: a Jinja string a client
    rendered would then differ from what the engine sends. A tokenizer with named templates gives
    its `default` one, as transformers picks it.
    """
    if getattr(tokenizer, "_chat_template", None) is not None:
        return None
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def tokenizer_info(model: LoadedModel) -> dict[str, Any]:
    """The loaded tokenizer's special tokens, chat template and limits, in vLLM's `/tokenizer_info` names.

    vLLM answers its tokenizer's whole `init_kwargs`, which hold the files' paths (`name_or_path`,
    `vocab_file`); this is a fixed set of fields a client reads instead. Whether `add_special_tokens`
    adds a BOS or an EOS is measured on a probe string, since tokenizers say it in different places
    (a flag, a post-processor). Cheap: two encodes of one character, no model work.
    """
    tokenizer = model.tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    tokens = {name: _token_text(getattr(hf, name, None)) for name in ("eos_token", "bos_token", "pad_token",
                                                                       "unk_token")}
    ids = {f"{name}_id": value if isinstance(value := getattr(hf, f"{name}_id", None), int) else None
           for name in ("eos_token", "bos_token", "pad_token")}
    probe = list(tokenizer.encode("a", add_special_tokens=False))
    with_special = list(tokenizer.encode("a", add_special_tokens=True))
    bos_id, eos_id = ids["bos_token_id"], ids["eos_token_id"]
    return {
        **tokens, **ids,
        "add_bos_token": bos_id is not None and with_special[:1] == [bos_id] and probe[:1] != [bos_id],
        "add_eos_token": eos_id is not None and with_special[-1:] == [eos_id] and probe[-1:] != [eos_id],
        "chat_template": _chat_template(tokenizer),
        "model_max_length": model.context_window,
        "vocab_size": model.vocab_size or len(tokenizer.get_vocab()),
        "tokenizer_class": type(hf).__name__,
    }
