"""The `resolve_model` CALL: which model a request naming `model` would run on, without loading anything.

Why: the front-end must answer for names it cannot read itself. `GET /v1/models/{id}` (OpenAI
clients and LiteLLM retrieve a model before using it) must not 404 a name a chat request would be
served under (`--model-fallback`, a glob alias, another spelling of a model's path), and a pool of
engines routes a request to the engine whose loaded model that name reaches. The name resolves
as generation resolves it (`BaseScheduler.resolve_model`, never downloading), on the admission pool.
"""

from __future__ import annotations

from typing import Any

from engine_daemon.calls.tokenize import Resolver
from engine_daemon.config import MAX_NAME_BYTES
from engine_daemon.errors import RequestError
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.store import context_window_of, model_kind


def resolve_model(loaded: LoadedModel | None, args: dict[str, Any], resolve: Resolver) -> dict[str, Any]:
    """{"id": the name it is served under, "loaded": whether the loaded model serves it, "kind", "context_window"}.

    Unknown names are the 404 (and names refused outright the 400) a generation request gets.
    """
    name = args.get("model")
    if not isinstance(name, str) or not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise RequestError(400, "invalid_model_name", "'model' must be a model name", param="model")
    ref = resolve(name)
    if loaded is not None and loaded.ref == ref:
        return {"id": ref.id, "loaded": True, "kind": loaded.kind, "context_window": loaded.context_window}
    return {"id": ref.id, "loaded": False, "kind": model_kind(ref.path), "context_window": context_window_of(ref.path)}
