"""`--prompt-cache-dir` for vision models: image prefixes survive a restart (real engined + gunicorn).

A tiny random-weight Qwen2-VL answers an image conversation, stops (SIGTERM) and starts again
on the same directory: the next turn takes its prefix, image included, from disk and its greedy
answer is exactly a cold engine's; so does the turn after a switch to another model and back.
A damaged file is skipped with a log line, never served; the directory stays under its byte cap;
two engines share one directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import Frontend, answers_from_two_engines, client_for, data_url, png, running_stack

SYSTEM = "You look at pictures for a museum. Rules: " + " ".join(
    f"rule {i}: note the {w} and say it plainly." for i, w in
    enumerate(["colour", "light", "shape", "edges", "texture", "contrast", "mood", "size"] * 5))


def conversation(image: bytes, team: int = 0) -> tuple[list[dict], list[dict]]:
    """An opening turn with an image, and the follow-up turn that extends it."""
    first = [{"role": "system", "content": f"Team {team}. {SYSTEM}"},
             {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                          {"type": "text", "text": "What do you see?"}]}]
    return first, extend(first, "Noise.", "And then?")


def extend(turn: list[dict], answer: str, question: str) -> list[dict]:
    return turn + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def ask(frontend: Frontend, model: str, messages: list[dict]) -> Any:
    return client_for(frontend).chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)


def stats(frontend: Frontend) -> dict:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny VLM, with a tiny text model beside it to switch to (`--model-dir` is their folder)."""
    from model_builders.text import build_model
    from model_builders.vlm import build_vlm

    root = tmp_path_factory.mktemp("vlm-disk")
    build_model(root / "tiny-qwen2", size="tiny", seed=0)
    return str(build_vlm(root / "tiny-qwen2-vl", seed=1))


@pytest.fixture(scope="module")
def cold(vlm: str, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    """An engine without a disk tier: the reference answers."""
    with running_stack(f"ipc://{ipc_dir}/vdisk-cold.sock", tmp_path_factory.mktemp("vdisk-cold"), model=vlm) as (_, fe):
        yield fe


def test_image_prefixes_survive_a_restart_and_damaged_files_are_skipped(vlm: str, cold: Frontend, ipc_dir: Path,
                                                                        tmp_path: Path) -> None:
    cache_dir = tmp_path / "kv"
    for run in "abc":
        (tmp_path / run).mkdir()
    first, second = conversation(png(31))
    args = ["--prompt-cache-dir", str(cache_dir)]
    with running_stack(f"ipc://{ipc_dir}/vdisk-a.sock", tmp_path / "a", model=vlm, engine_args=args) as (_, fe):
        opening = ask(fe, vlm, first)
        assert opening.usage.prompt_tokens >= 300
    assert list(cache_dir.glob("*.safetensors"))  # the clean stop wrote the hot prefixes

    switching = [*args, "--model-dir", str(Path(vlm).parent), "--model-switch-delay", "0"]
    third = extend(second, "More noise.", "Anything else?")
    with running_stack(f"ipc://{ipc_dir}/vdisk-b.sock", tmp_path / "b", model=vlm,
                       engine_args=switching) as (_, fe):
        restored = ask(fe, vlm, second)
        # The opening prompt's whole 16-token blocks came from disk: the image and the text around it.
        assert restored.usage.prompt_tokens_details.cached_tokens >= opening.usage.prompt_tokens - 16
        assert stats(fe)["vision_kv_disk_hits"] == 1
        ask(fe, "tiny-qwen2", first[:1])  # a switch away: the VLM's hot prefixes go to disk
        switched_back = ask(fe, vlm, third)
        assert switched_back.usage.prompt_tokens_details.cached_tokens >= restored.usage.prompt_tokens - 16
        found = stats(fe)
        assert found["model_loads"] == 3 and found["vision_kv_disk_hits"] == 2  # from disk, not from memory
        assert found["vision_kv_disk_tokens_loaded"] >= (restored.usage.prompt_tokens_details.cached_tokens
                                                         + switched_back.usage.prompt_tokens_details.cached_tokens)
        metrics = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
        assert 'mlx_engine_prefix_cache_hits_total{tier="vision_disk"} 2' in metrics

    for path in cache_dir.glob("*.safetensors"):  # damage every file in the middle
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with running_stack(f"ipc://{ipc_dir}/vdisk-c.sock", tmp_path / "c", model=vlm,
                       engine_args=args) as (engine, fe):
        recovered = ask(fe, vlm, second)
        assert recovered.usage.prompt_tokens_details.cached_tokens == 0
        assert stats(fe)["vision_kv_disk_corrupt"] >= 1
        assert "is damaged" in engine.log()

    reference = ask(cold, vlm, second)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert restored.choices[0].message.content == reference.choices[0].message.content
    assert recovered.choices[0].message.content == reference.choices[0].message.content
    assert switched_back.choices[0].message.content == ask(cold, vlm, third).choices[0].message.content


def test_two_engines_share_a_directory_under_its_byte_cap(vlm: str, cold: Frontend, ipc_dir: Path,
                                                          tmp_path: Path) -> None:
    """Two engines spill into one directory at once; a third finds both conversations intact; then,
    with a cap for about one conversation, the directory never grows past it."""
    cache_dir = tmp_path / "kv"
    args = ["--prompt-cache-dir", str(cache_dir)]
    conversations = [conversation(png(40 + team), team) for team in range(2)]
    for run in ("one", "two", "three", "capped"):
        (tmp_path / run).mkdir()
    opened = answers_from_two_engines(f"ipc://{ipc_dir}/vshare", [tmp_path / "one", tmp_path / "two"], vlm, args,
                                      [opening for opening, _ in conversations], ask)
    assert not list(cache_dir.glob(".*"))  # no temporary file left behind
    one_conversation = max(path.stat().st_size for path in cache_dir.glob("*.safetensors"))
    with running_stack(f"ipc://{ipc_dir}/vshare-r.sock", tmp_path / "three", model=vlm,
                       engine_args=args) as (engine, fe):
        restored = [ask(fe, vlm, follow_up) for _, follow_up in conversations]
        assert stats(fe)["vision_kv_disk_corrupt"] == 0 and "is damaged" not in engine.log()
    for got, (_, follow_up), first in zip(restored, conversations, opened):
        assert got.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
        assert got.choices[0].message.content == ask(cold, vlm, follow_up).choices[0].message.content

    # Memory for a few conversations (mlx-vlm admits a prompt by its whole padded cache): the
    # oldest is evicted by the fourth at the latest, and goes to disk at once.
    cap = int(one_conversation * 1.5)
    capped = ["--prompt-cache-dir", str(cache_dir), "--prompt-cache-disk-bytes", str(cap),
              "--prompt-cache-bytes", str(one_conversation * 3)]
    with running_stack(f"ipc://{ipc_dir}/vshare-c.sock", tmp_path / "capped", model=vlm,
                       engine_args=capped) as (_, fe):
        assert disk_bytes(cache_dir) <= cap  # the files of before, cut to the new cap as the tier opened
        for image in range(4):  # four new conversations, each worth a file
            ask(fe, vlm, conversation(png(50 + image), 2 + image)[0])
            assert disk_bytes(cache_dir) <= cap
        running = stats(fe)
        assert running["vision_kv_evictions"] >= 1 and running["vision_kv_disk_writes"] >= 1
    assert 0 < disk_bytes(cache_dir) <= cap
