"""`--prompt-cache-dir`: prefixes survive an engine restart and a model switch (real engined + gunicorn).

A ~4,000-token conversation is answered, the engine stops (SIGTERM) and starts again on the
same directory: the next turn takes ≥ 95% of its prompt from disk, and its greedy answer is
exactly a cold engine's. A damaged file, or one whose KV does not fit the model, is skipped with a
log line, never served.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

from engine_daemon.prefix_cache.disk import DiskTier
from model_builders.text import build_model
from tests.helpers import Frontend, answers_from_two_engines, client_for, running_stack

SYSTEM = "You maintain a large service. Runbook: " + " ".join(
    f"step {i}: check the {w} and write down what you saw." for i, w in
    enumerate(["disk", "queue", "latency", "errors", "memory", "network", "cache", "replicas"] * 12))


def turns(model: str) -> tuple[list[dict], list[dict]]:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What comes first?"}]
    return first, first + [{"role": "assistant", "content": "The disk."}, {"role": "user", "content": "Then?"}]


def ask(frontend, model: str, messages: list[dict]):
    return client_for(frontend).chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)


def stats(frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def test_prefixes_survive_a_restart_and_damaged_files_are_skipped(tiny_model: Path, ipc_dir: Path,
                                                                  tmp_path: Path) -> None:
    cache_dir, model = tmp_path / "kv", str(tiny_model)
    for run in "abcd":
        (tmp_path / run).mkdir()
    first, second = turns(model)
    args = ["--prompt-cache-dir", str(cache_dir)]
    with running_stack(f"ipc://{ipc_dir}/disk-a.sock", tmp_path / "a", model=model, engine_args=args) as (_, fe):
        opening = ask(fe, model, first)
        assert opening.usage.prompt_tokens >= 1000
    assert list(cache_dir.glob("*.safetensors"))  # the clean stop wrote the hot prefixes

    with running_stack(f"ipc://{ipc_dir}/disk-b.sock", tmp_path / "b", model=model, engine_args=args) as (_, fe):
        restored = ask(fe, model, second)
        assert restored.usage.prompt_tokens_details.cached_tokens >= 0.95 * opening.usage.prompt_tokens
        found = stats(fe)
        assert found["prompt_cache_disk_loads"] == 1
        assert found["prompt_cache_disk_reads_ahead"] == 1  # read on the reader's thread while the prompt waited

    for path in cache_dir.glob("*.safetensors"):  # damage every file in the middle
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with running_stack(f"ipc://{ipc_dir}/disk-c.sock", tmp_path / "c", model=model, engine_args=args) as (engine, fe):
        recovered = ask(fe, model, second)
        assert recovered.usage.prompt_tokens_details.cached_tokens == 0
        assert stats(fe)["prompt_cache_disk_corrupt"] >= 1
        assert "is damaged" in engine.log()

    with running_stack(f"ipc://{ipc_dir}/disk-d.sock", tmp_path / "d", model=model) as (_, fe):
        cold = ask(fe, model, second)  # no disk tier: the reference
    assert restored.choices[0].message.content == cold.choices[0].message.content
    assert recovered.choices[0].message.content == cold.choices[0].message.content


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("other") / "tiny-seed1", size="tiny", seed=1)


def test_a_switch_back_finds_the_prefixes_on_disk(tiny_model: Path, other_model: Path, ipc_dir: Path,
                                                  tmp_path: Path) -> None:
    model_a, model_b = str(tiny_model), str(other_model)
    first, second = turns(model_a)
    with running_stack(f"ipc://{ipc_dir}/disk-s.sock", tmp_path, model=model_a,
                       engine_args=["--prompt-cache-dir", str(tmp_path / "kv"), "--model-switch-delay", "0",
                                    "--model-dir", str(other_model.parent)]) as (_, fe):
        opening = ask(fe, model_a, first)
        ask(fe, model_b, first)  # A's prefixes go to disk as B loads
        back = ask(fe, model_a, second)
        assert back.usage.prompt_tokens_details.cached_tokens >= 0.95 * opening.usage.prompt_tokens
        assert stats(fe)["prompt_cache_disk_loads"] >= 1
        assert stats(fe)["model_loads"] == 3  # A, B, A again: the KV came from disk, not from memory
        metrics = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
        assert 'mlx_engine_prefix_cache_hits_total{tier="disk"' in metrics
        assert "mlx_engine_prompt_cache_disk_bytes" in metrics


def test_two_engines_on_one_directory_keep_each_others_prefixes(tiny_model: Path, ipc_dir: Path,
                                                                tmp_path: Path) -> None:
    """Two real engines spill into one directory at once; a third finds both conversations intact."""
    cache_dir, model = tmp_path / "kv", str(tiny_model)
    args = ["--prompt-cache-dir", str(cache_dir)]
    conversations = []
    for index in range(2):
        opening = [{"role": "system", "content": f"Team {index}. " + SYSTEM},
                   {"role": "user", "content": "What comes first?"}]
        conversations.append((opening, opening + [{"role": "assistant", "content": "The disk."},
                                                  {"role": "user", "content": "Then?"}]))
    for run in ("one", "two", "three", "cold"):
        (tmp_path / run).mkdir()
    opened = answers_from_two_engines(f"ipc://{ipc_dir}/share", [tmp_path / "one", tmp_path / "two"], model, args,
                                      [opening for opening, _ in conversations], ask)
    assert not list(cache_dir.glob(".*"))  # no temporary file left behind
    with running_stack(f"ipc://{ipc_dir}/share-r.sock", tmp_path / "three", model=model,
                       engine_args=args) as (engine, fe):
        restored = [ask(fe, model, follow_up) for _, follow_up in conversations]
        assert stats(fe)["prompt_cache_disk_corrupt"] == 0 and "is damaged" not in engine.log()
    with running_stack(f"ipc://{ipc_dir}/share-c.sock", tmp_path / "cold", model=model) as (_, fe):
        cold = [ask(fe, model, follow_up) for _, follow_up in conversations]
    for got, reference, first in zip(restored, cold, opened):
        assert got.usage.prompt_tokens_details.cached_tokens >= 0.95 * first.usage.prompt_tokens
        assert got.choices[0].message.content == reference.choices[0].message.content


def test_weights_rewritten_in_place_never_get_the_old_prefixes(other_model: Path, ipc_dir: Path,
                                                                tmp_path: Path) -> None:
    """Red team: new weights copied over a model's files (their mtime put back, as `touch -d` does) while the
    engine ran another model; switched back, the engine served the old weights' KV from disk (863 of 883 tokens
    "cached", nonsense of the old model). The key now covers size, mtime, inode and ctime of the weights and
    config.json, taken as each load starts: the next turn is computed afresh and equals a cold engine's."""
    model_dir = tmp_path / "models"
    model_a = build_model(model_dir / "tiny-a", size="tiny", seed=0)
    replacement = build_model(tmp_path / "new" / "tiny-a", size="tiny", seed=2)
    first, second = turns(str(model_a))
    for run in ("live", "cold"):
        (tmp_path / run).mkdir()
    with running_stack(f"ipc://{ipc_dir}/disk-w.sock", tmp_path / "live", model=str(model_a),
                       engine_args=["--prompt-cache-dir", str(tmp_path / "kv"), "--model-switch-delay", "0",
                                    "--model-dir", str(other_model.parent)]) as (_, fe):
        ask(fe, str(model_a), first)
        ask(fe, str(other_model), first)  # A's prefixes go to disk as B loads
        weights = model_a / "model.safetensors"
        before = weights.stat()
        weights.write_bytes((replacement / "model.safetensors").read_bytes())
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime
        back = ask(fe, str(model_a), second)
        assert back.usage.prompt_tokens_details.cached_tokens == 0
        assert stats(fe)["model_loads"] == 3
    with running_stack(f"ipc://{ipc_dir}/disk-wc.sock", tmp_path / "cold", model=str(model_a)) as (_, fe):
        cold = ask(fe, str(model_a), second)
    assert back.choices[0].message.content == cold.choices[0].message.content


def ask_beside_a_victim(fe: Frontend, model: str, messages: list[dict]) -> tuple[httpx.Response, list[str]]:
    """Sends `messages` (12 tokens, greedy) while a 200-token victim stream decodes; the answer and the victim's
    SSE lines."""
    victim = {"model": model, "messages": [{"role": "user", "content": "A long story, please."}],
              "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{fe.base_url}/v1/chat/completions", json=victim, timeout=300) as stream:
        lines = stream.iter_lines()
        seen = [line for line, _ in zip(lines, range(3))]  # the victim is decoding
        answer = httpx.post(f"{fe.base_url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages, "max_tokens": 12, "temperature": 0})
        seen += list(lines)
    return answer, seen


def test_a_restart_with_another_kv_layout_never_loads_the_old_layouts_prefixes(tiny_model: Path, ipc_dir: Path,
                                                                               tmp_path: Path) -> None:
    """Prefixes written by a run with plain KV caches, read by one with `--max-kv-size` (rotating caches): the
    plain cache joined the rotating batch and failed the whole step, the stream beside it too (500
    "'BatchKVCache' object has no attribute 'rotated'")."""
    cache_dir, model = tmp_path / "kv", str(tiny_model)
    first, second = turns(model)
    args = ["--prompt-cache-dir", str(cache_dir)]
    for run in "ab":
        (tmp_path / run).mkdir()
    with running_stack(f"ipc://{ipc_dir}/layout-a.sock", tmp_path / "a", model=model, engine_args=args) as (_, fe):
        ask(fe, model, first)
    assert list(cache_dir.glob("*.safetensors"))
    rotating = [*args, "--max-kv-size", "512"]
    with running_stack(f"ipc://{ipc_dir}/layout-b.sock", tmp_path / "b", model=model, engine_args=rotating) as (_, fe):
        answer, seen = ask_beside_a_victim(fe, model, second)
        assert answer.status_code == 200, answer.text
        assert stats(fe)["prompt_cache_disk_loads"] == 0
    chunks = [json.loads(line[6:]) for line in seen if line.startswith("data: {")]
    assert not [chunk for chunk in chunks if "error" in chunk] and chunks[-1]["usage"]["completion_tokens"] == 200


def test_a_file_of_another_models_kv_under_a_valid_name_is_skipped_beside_a_running_stream(
        tiny_model: Path, ipc_dir: Path, tmp_path: Path) -> None:
    """Red team: the KV of another model (4 layers, 2 KV heads of dim 16, not 2 layers, 1 head of dim 32) written
    by the real writer under this model's key while the engine was stopped: after the restart it joined the
    batch and the step failed, the request (500 "[concatenate] All the input array dimensions must match") and
    the stream decoding beside it too. The layout check (`kv_layout`) now skips, counts and deletes it."""
    cache_dir, model = tmp_path / "kv", str(tiny_model)
    first, second = turns(model)
    args = ["--prompt-cache-dir", str(cache_dir)]
    for run in ("a", "b", "cold"):
        (tmp_path / run).mkdir()
    with running_stack(f"ipc://{ipc_dir}/fit-a.sock", tmp_path / "a", model=model, engine_args=args) as (_, fe):
        ask(fe, model, first)
    (own,) = cache_dir.glob("*.safetensors")
    _, meta = load_prompt_cache(str(own), return_metadata=True)
    tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype="<i4")
    other = load(str(build_model(tmp_path / "foreign" / "tiny-group", size="tiny-group", seed=0)))[0]
    foreign = make_prompt_cache(other)
    other(mx.array(tokens)[None], cache=foreign)
    own.unlink()
    assert DiskTier(cache_dir, 1 << 30).store(meta["key"], tokens, foreign, trimmable=True)
    (planted,) = cache_dir.glob("*.safetensors")
    with running_stack(f"ipc://{ipc_dir}/fit-b.sock", tmp_path / "b", model=model, engine_args=args) as (engine, fe):
        answer, seen = ask_beside_a_victim(fe, model, second)
        assert answer.status_code == 200, answer.text
        found = stats(fe)
        assert found["prompt_cache_disk_corrupt"] == 1 and found["prompt_cache_disk_loads"] == 0
        assert not planted.exists() and "does not fit the model" in engine.log()
    chunks = [json.loads(line[6:]) for line in seen if line.startswith("data: {")]
    assert not [chunk for chunk in chunks if "error" in chunk] and chunks[-1]["usage"]["completion_tokens"] == 200
    with running_stack(f"ipc://{ipc_dir}/fit-c.sock", tmp_path / "cold", model=model) as (_, fe):
        cold = ask(fe, model, second)
    assert answer.json()["choices"][0]["message"]["content"] == cold.choices[0].message.content


def test_an_evicted_prefix_is_written_by_the_writer_thread_and_served_back(tiny_model: Path, ipc_dir: Path,
                                                                          tmp_path: Path) -> None:
    """With one memory entry, another long prompt evicts the conversation's KV: the engine's writer thread
    (`SpillWriter`) writes it, off the mlx thread, and the conversation's next turn still reuses ≥ 95% of its
    prompt with exactly a cold engine's greedy answer."""
    import time

    cache_dir, model = tmp_path / "kv", str(tiny_model)
    first, second = turns(model)
    other = [{"role": "system", "content": SYSTEM.replace("step", "stage")}, {"role": "user", "content": "Go."}]
    args = ["--prompt-cache-dir", str(cache_dir), "--prompt-cache-size", "1"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with running_stack(f"ipc://{ipc_dir}/spill-a.sock", tmp_path / "a", model=model, engine_args=args) as (_, fe):
        opening = ask(fe, model, first)
        ask(fe, model, other)  # its KV takes the one memory entry: the conversation's goes to the writer
        deadline = time.monotonic() + 120
        while stats(fe)["prompt_cache_disk_writes"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        found = stats(fe)
        assert found["prompt_cache_disk_spills_queued"] >= 1 and found["prompt_cache_disk_writes"] >= 1
        assert list(cache_dir.glob("*.safetensors"))  # written while the engine runs, not only at its stop
        restored = ask(fe, model, second)
        assert restored.usage.prompt_tokens_details.cached_tokens >= 0.95 * opening.usage.prompt_tokens
    with running_stack(f"ipc://{ipc_dir}/spill-b.sock", tmp_path / "b", model=model) as (_, fe):
        cold = ask(fe, model, second)
    assert restored.choices[0].message.content == cold.choices[0].message.content
