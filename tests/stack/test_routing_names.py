"""Several engines: a model named another way than its engine loaded it still reaches that engine (real processes).

Engine `a` loaded `ROOT/tiny` and `b` loaded `ROOT/other`, both typed as paths at start, both with
`--model-dir ROOT`. A client naming `tiny` (its name under the root), `ROOT/tiny/`, `ROOT/./tiny` or a
symlink to it names `a`'s model: compared literally, no engine had it, and the router sent half such
requests to `b`, which switched models for them. Each engine says what a name runs on
(`resolve_model`); the router follows what the engine whose model it is says.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import Engine, Frontend, call_engine, one_frontend_for, ping_engine

KEYS = [f"conversation-{i}" for i in range(8)]  # rendezvous spreads these over both engines
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def named_pair(tiny_model: Path, ipc_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Engine], Frontend]]:
    from model_builders.text import build_model

    base = tmp_path_factory.mktemp("routing-names")
    root = base / "root"
    shutil.copytree(tiny_model, root / "tiny")
    build_model(root / "other", size="tiny", seed=5)
    (root / "tiny-link").symlink_to(root / "tiny")
    endpoints = {"a": f"ipc://{ipc_dir}/names-a.sock", "b": f"ipc://{ipc_dir}/names-b.sock"}
    engines = {engine_id: Engine(endpoints[engine_id], base / f"{engine_id}.log", model=str(root / name),
                                 args=["--model-dir", str(root)])
               for engine_id, name in (("a", "tiny"), ("b", "other"))}
    with one_frontend_for(engines, base / "frontend.log") as front:
        yield root, engines, front


def loads(engine: Engine) -> int:
    return call_engine(engine.endpoint, "status")["model_loads"]


def test_equivalent_spellings_reach_the_engine_that_loaded_the_model(
        named_pair: tuple[Path, dict[str, Engine], Frontend]) -> None:
    root, engines, front = named_pair
    before = {engine_id: loads(engine) for engine_id, engine in engines.items()}
    spellings = {"a": [str(root / "tiny"), "tiny", f"{root}/tiny/", f"{root}/./tiny", f"{root}/tiny-link",
                       "tiny-link"],
                 "b": [str(root / "other"), "other", f"{root}/other/"]}
    for owner, names in spellings.items():
        for name in names:
            for key in KEYS:
                answer = httpx.post(f"{front.base_url}/v1/chat/completions", timeout=60,
                                    headers={"X-Session-Affinity": key},
                                    json={"model": name, "max_tokens": 1, "messages": HI})
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-engine-id"] == owner, (name, key, answer.headers["x-engine-id"])
                assert answer.json()["model"] == str(root / ("tiny" if owner == "a" else "other"))
    # Neither engine switched models for a spelling of the other's.
    assert {engine_id: loads(engine) for engine_id, engine in engines.items()} == before
    assert {ping_engine(engine.endpoint)["model"] for engine in engines.values()} == {str(root / "tiny"),
                                                                                     str(root / "other")}


def test_calls_naming_a_spelling_reach_its_engine(named_pair: tuple[Path, dict[str, Engine], Frontend]) -> None:
    """tokenize / count_tokens name a model: engine `a` (the first) answered `b`'s under another spelling with a
    400 model_not_loaded."""
    root, _, front = named_pair
    for name in (f"{root}/other/", "other", f"{root}/./tiny"):
        counted = httpx.post(f"{front.base_url}/v1/tokenize", timeout=60, json={"model": name, "prompt": "hi"})
        assert counted.status_code == 200, (name, counted.text)


def test_retrieving_a_spelling_finds_the_engine_that_serves_it(
        named_pair: tuple[Path, dict[str, Engine], Frontend]) -> None:
    """GET /v1/models/{id} asks every engine: `./other` is `b`'s loaded model (`a` would load it)."""
    _, _, front = named_pair
    found = httpx.get(f"{front.base_url}/v1/models/%2E%2Fother", timeout=30)
    assert found.status_code == 200, found.text
    assert (found.json()["id"], found.json()["loaded"]) == ("./other", True)
    assert httpx.get(f"{front.base_url}/v1/models/no-such-model", timeout=30).status_code == 404


def test_each_engine_lists_its_loaded_directory_as_loaded_under_its_root_name(
        named_pair: tuple[Path, dict[str, Engine], Frontend]) -> None:
    """An engine started on a path lists that directory under --model-dir by its short name: a request naming it
    runs without a load, so the catalogue says `loaded` (it said false: compared with the path as typed)."""
    root, engines, _ = named_pair
    for engine_id, name, other in (("a", "tiny", "other"), ("b", "other", "tiny")):
        listed = {m["id"]: m for m in call_engine(engines[engine_id].endpoint, "list_models")}
        assert listed[name]["loaded"] is True and listed[str(root / name)]["loaded"] is True, (engine_id, listed)
        assert listed[other]["loaded"] is False and "context_window" in listed[name]
    assert listed["tiny-link"]["loaded"] is False  # engine b: a link to a's directory is not b's model
