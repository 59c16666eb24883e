"""LoRA adapters through the real stack: per-request adapters, the /v1/adapters registry, --adapter-path.

Adapters are random LoRA adapters built locally (model_builders/adapter.py, mlx-lm's
format). The reference for each is mlx-lm itself: `mlx_lm.load(model, adapter_path=...)`
+ greedy `generate`, which loads the base model again per adapter; the engine must give
the same tokens while switching adapters on one loaded model (`model_loads` unchanged).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import Engine, Frontend, client_for

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapters(tiny_model: Path) -> dict[str, Path]:
    """Two adapters next to the model (inside the shared engine's --model-dir), of different shapes."""
    from model_builders.adapter import build_adapter

    root = tiny_model.parent
    return {
        "lora-a": build_adapter(tiny_model, root / "lora-a", seed=1),  # every linear layer, rank 4
        "lora-b": build_adapter(tiny_model, root / "lora-b", seed=2, rank=8, num_layers=1,
                                keys=["self_attn.q_proj", "mlp.down_proj"]),
    }


@pytest.fixture(scope="module")
def references(tiny_model: Path, adapters: dict[str, Path]) -> dict[str | None, str]:
    """Greedy text per adapter from mlx-lm loading the adapter itself (None: the base model)."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_logits_processors

    shipped = json.loads((tiny_model / "generation_config.json").read_text())
    processors = make_logits_processors(repetition_penalty=shipped.get("repetition_penalty"))
    texts: dict[str | None, str] = {}
    for name in (None, *adapters):
        model, tokenizer = load(str(tiny_model), adapter_path=str(adapters[name]) if name else None)
        tokens = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        texts[name] = generate(model, tokenizer, tokens, max_tokens=MAX_TOKENS, logits_processors=processors)
    assert len(set(texts.values())) == 3, "each adapter should change the greedy output for this test to mean anything"
    return texts


def chat(frontend: Frontend, model_id: str, adapter: str | None, **extra: object) -> openai.types.chat.ChatCompletion:
    body = {"adapter_path": adapter} if adapter else {}
    return client_for(frontend).chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                        temperature=0, extra_body=body, **extra)


def stats(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def test_adapters_switch_per_request_without_reloading_the_model(
        frontend: Frontend, model_id: str, references: dict[str | None, str]) -> None:
    before = stats(frontend)
    # Alternating adapters, as paths relative to --model-dir: each request gets its own adapter's output.
    for name in ("lora-a", None, "lora-b", "lora-a", None, "lora-b"):
        assert chat(frontend, model_id, name).choices[0].message.content == references[name], name
    after = stats(frontend)
    assert after["model_loads"] == before["model_loads"], "switching adapters must never reload the base model"
    assert after["adapter_loads"] - before["adapter_loads"] == 2  # each adapter read from disk once
    assert after["adapter_switches"] - before["adapter_switches"] >= 5
    # /v1/completions passes adapter_path too.
    response = httpx.post(f"{frontend.base_url}/v1/completions", timeout=60, json={
        "model": model_id, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "adapter_path": "lora-a"})
    base = httpx.post(f"{frontend.base_url}/v1/completions", timeout=60, json={
        "model": model_id, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    assert response.status_code == base.status_code == 200
    assert response.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]


def test_prompt_cache_is_kept_per_adapter(frontend: Frontend, model_id: str) -> None:
    """A prefix computed with one adapter never serves another: its KV differs."""
    client = client_for(frontend)
    messages = [{"role": "user", "content": "A question no other test asks, about caches and adapters."}]

    def cached(adapter: str) -> tuple[int, int]:
        usage = client.chat.completions.create(model=model_id, messages=messages, max_tokens=2, temperature=0,
                                               extra_body={"adapter_path": adapter}).usage
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    cached("lora-a")
    hit, prompt_tokens = cached("lora-a")
    assert hit >= prompt_tokens - 1  # the whole prompt (the last token is recomputed for its logits)
    other, _ = cached("lora-b")
    assert other < hit  # lora-b has no KV for this prompt (at most its own copy of the template's start)


def test_concurrent_requests_with_different_adapters(frontend: Frontend, model_id: str,
                                                     references: dict[str | None, str]) -> None:
    names = [None, "lora-a", "lora-b"] * 3
    start = threading.Barrier(len(names))

    def run(name: str | None) -> str:
        start.wait()
        return chat(frontend, model_id, name).choices[0].message.content

    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(run, names))
    assert got == [references[name] for name in names]


def test_one_adapter_group_does_not_wait_for_another_to_drain(frontend: Frontend, model_id: str) -> None:
    """A short lora-b request finishes while a long lora-a stream is still generating."""
    stream = client_for(frontend).chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=3000, temperature=0, stream=True,
        extra_body={"adapter_path": "lora-a", "ignore_eos": True})
    try:
        chunks = iter(stream)
        next(chunks)  # lora-a is decoding
        started = time.monotonic()
        short = chat(frontend, model_id, "lora-b")
        waited = time.monotonic() - started
        assert short.choices[0].message.content and short.choices[0].finish_reason == "length"
        assert waited < 10, f"lora-b waited {waited:.1f} s behind lora-a"
        still_going = next(chunks)  # 3000 tokens take far longer than the short request did
        assert still_going.choices and still_going.choices[0].finish_reason is None
    finally:
        stream.close()


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_registry_routes(frontend: Frontend, model_id: str, tiny_model: Path, adapters: dict[str, Path],
                         references: dict[str | None, str]) -> None:
    url = f"{frontend.base_url}/v1/adapters"
    registered = httpx.post(url, json={"name": "story-a", "path": "lora-a"})
    assert registered.status_code == 200, registered.text
    assert registered.json() == {"id": "story-a", "object": "adapter", "path": str(adapters["lora-a"]),
                                 "default": False}
    try:
        listed = httpx.get(url).json()
        assert listed["object"] == "list" and "story-a" in [a["id"] for a in listed["data"]]
        # A registered name works like the path; an absolute path inside --model-dir too.
        assert chat(frontend, model_id, "story-a").choices[0].message.content == references["lora-a"]
        assert chat(frontend, model_id, str(adapters["lora-b"])).choices[0].message.content == references["lora-b"]
        assert error_of(httpx.post(url, json={"name": "story-a", "path": "lora-b"}), 409)["code"] == "adapter_exists"
    finally:
        deleted = httpx.delete(f"{url}/story-a")
    assert deleted.json() == {"id": "story-a", "object": "adapter", "deleted": True}
    assert error_of(httpx.delete(f"{url}/story-a"), 404)["code"] == "adapter_not_found"
    assert "story-a" not in [a["id"] for a in httpx.get(url).json()["data"]]
    with pytest.raises(openai.NotFoundError):
        chat(frontend, model_id, "story-a")


def test_bad_adapters_are_refused_clearly(frontend: Frontend, model_id: str, tiny_model: Path,
                                          adapters: dict[str, Path]) -> None:
    url = f"{frontend.base_url}/v1/adapters"
    completions = f"{frontend.base_url}/v1/chat/completions"

    def ask(adapter: object) -> httpx.Response:
        return httpx.post(completions, timeout=30, json={"model": model_id, "messages": MESSAGES, "max_tokens": 2,
                                                         "adapter_path": adapter})

    # Paths are confined to --model-dir, as model names are: never an arbitrary directory.
    for outside in ("/etc", "../../etc", str(adapters["lora-a"]) + "/../../.."):
        assert error_of(ask(outside), 400)["param"] == "adapter_path"
        assert error_of(httpx.post(url, json={"name": "x", "path": outside}), 400)["param"] == "path"
    assert error_of(ask("no-such-adapter"), 404)["code"] == "adapter_not_found"
    assert error_of(ask(7), 400)["code"] == "invalid_type"
    assert error_of(httpx.post(url, json={"name": "bad/name", "path": "lora-a"}), 400)["param"] == "name"
    assert error_of(httpx.post(url, json={"name": "x"}), 400)["param"] == "path"
    # An adapter made for another shape of model: refused at registration and per request.
    wrong = tiny_model.parent / "lora-wrong"
    wrong.mkdir(exist_ok=True)
    (wrong / "adapter_config.json").write_text(adapters["lora-a"].joinpath("adapter_config.json").read_text())
    import mlx.core as mx

    mx.save_safetensors(str(wrong / "adapters.safetensors"), {
        "model.layers.0.self_attn.q_proj.lora_a": mx.zeros((7, 4)),
        "model.layers.0.self_attn.q_proj.lora_b": mx.zeros((4, 64))})
    assert error_of(ask("lora-wrong"), 400)["code"] == "adapter_incompatible"
    registered = httpx.post(url, json={"name": "wrong", "path": "lora-wrong"})
    assert error_of(registered, 400)["code"] == "adapter_incompatible"
    # DoRA / full fine-tunes cannot be switched per request: said so, not half-applied.
    dora = tiny_model.parent / "lora-dora"
    dora.mkdir(exist_ok=True)
    (dora / "adapters.safetensors").write_bytes(adapters["lora-a"].joinpath("adapters.safetensors").read_bytes())
    (dora / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora", "num_layers": 2,
                                                          "lora_parameters": {"rank": 4, "scale": 10.0}}))
    assert error_of(ask("lora-dora"), 400)["code"] == "unsupported_adapter"
    # The engine is fine after all that.
    assert httpx.get(f"{frontend.base_url}/health").json()["status"] == "healthy"


@pytest.fixture(scope="module")
def default_adapter_stack(tiny_model: Path, adapters: dict[str, Path], ipc_dir: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Frontend]]:
    logs = tmp_path_factory.mktemp("adapter-logs")
    engine = Engine(f"ipc://{ipc_dir}/adapters.sock", logs / "engined.log", model=str(tiny_model),
                    args=["--model-dir", str(tiny_model.parent)], env={"PRELOAD_ADAPTER": str(adapters["lora-a"])})
    frontend = None
    try:
        engine.wait_ready()
        frontend = Frontend(engine.endpoint, logs / "frontend.log", workers=1)
        frontend.wait_healthy()
        yield engine, frontend
    finally:
        if frontend is not None:
            frontend.stop()
        engine.stop()


def test_adapter_path_at_start(default_adapter_stack: tuple[Engine, Frontend], model_id: str,
                               adapters: dict[str, Path], references: dict[str | None, str]) -> None:
    engine, frontend = default_adapter_stack
    # PRELOAD_ADAPTER (the env equivalent of --adapter-path): requests naming no adapter get it.
    assert chat(frontend, model_id, None).choices[0].message.content == references["lora-a"]
    assert chat(frontend, model_id, "lora-b").choices[0].message.content == references["lora-b"]
    assert httpx.get(f"{frontend.base_url}/health").json()["loaded_adapter"] == "lora-a"
    listed = httpx.get(f"{frontend.base_url}/v1/adapters").json()["data"]
    assert {"id": "lora-a", "object": "adapter", "path": str(adapters["lora-a"]), "default": True} in listed
    assert error_of(httpx.delete(f"{frontend.base_url}/v1/adapters/lora-a"), 400)["code"] == "adapter_in_use"
    assert stats(frontend)["model_loads"] == 1
    assert engine.log().count("loaded adapter lora-a") == 1


def test_adapter_path_needs_a_model_and_an_adapter_dir(tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    for args in (["--adapter-path", str(tiny_model.parent / "lora-a")],
                 ["--model", str(tiny_model), "--adapter-path", str(tiny_model)]):
        engine = Engine(f"ipc://{ipc_dir}/bad-adapter.sock", tmp_path / "engined.log", args=args)
        try:
            assert engine.popen.wait(30) == 2
        finally:
            engine.stop()
    log = (tmp_path / "engined.log").read_text()
    assert "--adapter-path needs --model" in log and "not an adapter directory" in log
