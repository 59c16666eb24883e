"""lm-evaluation-harness's remote tokenizer against the real stack: httpx -> gunicorn -> engined.

`local-completions` (lm_eval.models.openai_completions) picks the server's tokenizer when
`check_remote_tokenizer_support` passes: GET {server}/tokenizer_info holds `eos_token`, and POST
{server}/tokenize of `{"prompt": "test", "add_special_tokens": false}` gives a token list. Its
`RemoteTokenizer` then encodes with `add_special_tokens: false`, decodes with /detokenize, and takes
the EOS (and BOS) ids as the first token of their text. The same sequence is replayed here, on the
tiny model (its tokenizer adds no BOS, as Qwen's do not) and on a derived one that adds a BOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_builders.text import derive_model
from model_builders.tokenizer import ENDOFTEXT
from tests.helpers import Frontend, error_of, running_stack

TEXT = "Once upon a time, a fox met <|im_end|> twice."


class RemoteTokenizer:
    """lm-eval's `RemoteTokenizer` and `check_remote_tokenizer_support`, request for request (httpx for requests)."""

    def __init__(self, base_url: str):
        self.server = base_url.replace("/v1/completions", "").replace("/v1/chat/completions", "").rstrip("/")
        self.http = httpx.Client(headers={"Content-Type": "application/json"}, timeout=30)

    def supported(self) -> bool:
        info = self.http.get(f"{self.server}/tokenizer_info")
        if info.status_code != 200 or not isinstance(info.json(), dict) or "eos_token" not in info.json():
            return False
        tokens = self.http.post(f"{self.server}/tokenize", json={"prompt": "test", "add_special_tokens": False})
        return tokens.status_code == 200 and isinstance(tokens.json().get("tokens"), list)

    @property
    def info(self) -> dict[str, Any]:
        response = self.http.get(f"{self.server}/tokenizer_info")
        response.raise_for_status()
        return response.json()

    def encode(self, text: str, **extra: Any) -> list[int]:
        response = self.http.post(f"{self.server}/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                                    **extra})
        response.raise_for_status()
        return response.json()["tokens"]

    def decode(self, tokens: list[int]) -> str:
        response = self.http.post(f"{self.server}/detokenize", json={"tokens": tokens})
        response.raise_for_status()
        return response.json()["prompt"]

    @property
    def eos_token_id(self) -> int | None:
        return None if (eos := self.info.get("eos_token")) is None else self.encode(eos)[0]

    @property
    def bos_token_id(self) -> int | None:
        return None if (bos := self.info.get("bos_token")) is None else self.encode(bos)[0]


def _model_config(model: Path) -> dict[str, Any]:
    return json.loads((model / "config.json").read_text())


def _generate_until(frontend: Frontend, model: str, remote: RemoteTokenizer, context: str) -> httpx.Response:
    """The completion `local-completions` sends for a generate_until request: the context's token ids
    (a batch of one), greedy, stopped at the EOS text."""
    payload = {"prompt": [remote.encode(context)], "model": model, "max_tokens": 4, "temperature": 0,
               "stop": [remote.info["eos_token"]], "seed": 1234}
    return httpx.post(f"{frontend.base_url}/v1/completions", json=payload, timeout=60)


def test_lm_eval_detects_and_uses_the_remote_tokenizer(frontend: Frontend, tiny_model: Path, model_id: str) -> None:
    remote = RemoteTokenizer(f"{frontend.base_url}/v1/completions")
    assert remote.supported()
    info = remote.info
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] is None
    assert remote.eos_token_id == info["eos_token_id"] == _model_config(tiny_model)["eos_token_id"]
    assert remote.bos_token_id is None  # lm-eval's prefix token is then the EOS
    assert info["chat_template"] and "<|im_start|>" in info["chat_template"]
    assert str(tiny_model) not in json.dumps(info)  # no file path, whatever the model's id is

    ids = remote.encode(TEXT)
    assert remote.decode(ids) == TEXT
    assert info["eos_token_id"] in ids  # special tokens in the text are read as such
    # This tokenizer adds no BOS: `add_special_tokens` true, false or absent give the same ids.
    assert remote.encode(TEXT, add_special_tokens=True) == ids
    plain = httpx.post(f"{frontend.base_url}/v1/tokenize", json={"prompt": TEXT}, timeout=30).json()["tokens"]
    assert plain == ids
    assert info["add_bos_token"] is False

    generated = _generate_until(frontend, model_id, remote, "Once upon a time")
    assert generated.status_code == 200, generated.text
    assert generated.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_tokenizer_info_names_a_model_as_tokenize_does(frontend: Frontend, tiny_model: Path, model_id: str) -> None:
    with httpx.Client(base_url=frontend.base_url, timeout=30) as http:
        named = http.get("/v1/tokenizer_info", params={"model": model_id})
        assert named.status_code == 200 and named.json() == http.get("/tokenizer_info").json()
        unknown = http.get("/tokenizer_info", params={"model": "some-other/model"})
        assert unknown.status_code == 404 and error_of(unknown)["param"] == "model"
        # A model the engine could serve but has not loaded: tokenizer routes never load one.
        other = derive_model(tiny_model, tiny_model.parent / "tiny-bos-unloaded", bos_token=ENDOFTEXT)
        not_loaded = http.get("/tokenizer_info", params={"model": str(other)})
        assert not_loaded.status_code == 400 and error_of(not_loaded)["code"] == "model_not_loaded"
        assert http.post("/tokenize", json={"prompt": "x", "add_special_tokens": "no"}).status_code == 400


@pytest.fixture(scope="module")
def bos_stack(tiny_model: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Frontend,
                                                                                                           Path]]:
    """An engine serving a model whose tokenizer adds a BOS when asked to add special tokens, and its front-end."""
    model = derive_model(tiny_model, tiny_model.parent / "tiny-with-bos", bos_token=ENDOFTEXT)
    with running_stack(f"ipc://{ipc_dir}/bos.sock", tmp_path_factory.mktemp("logs"), model=str(model)) as (_, frontend):
        yield frontend, model


def test_add_special_tokens_differs_exactly_by_the_bos(bos_stack: tuple[Frontend, Path]) -> None:
    frontend, model = bos_stack
    remote = RemoteTokenizer(f"{frontend.base_url}/v1/completions")
    assert remote.supported()
    info = remote.info
    assert info["bos_token"] == ENDOFTEXT and info["add_bos_token"] is True
    bos_id = remote.bos_token_id
    assert bos_id == info["bos_token_id"] == _model_config(model)["bos_token_id"]
    assert remote.eos_token_id == info["eos_token_id"] == _model_config(model)["eos_token_id"]

    ids = remote.encode(TEXT)
    assert bos_id not in ids and remote.decode(ids) == TEXT
    assert remote.encode(TEXT, add_special_tokens=True) == [bos_id] + ids
    # Absent, a prompt gets the tokenizer's own rules, as /v1/completions builds it: the BOS.
    with httpx.Client(base_url=frontend.base_url, timeout=60) as http:
        absent = http.post("/tokenize", json={"prompt": TEXT}).json()
        assert absent["tokens"] == [bos_id] + ids
        usage = http.post("/v1/completions", json={"model": str(model), "prompt": TEXT, "max_tokens": 1}).json()
        assert usage["usage"]["prompt_tokens"] == absent["count"]
        # Messages: the template's own tokens, as the chat route renders them; `true` is refused.
        chat = [{"role": "user", "content": TEXT}]
        templated = http.post("/tokenize", json={"messages": chat, "add_special_tokens": False})
        assert templated.status_code == 200 and templated.json()["tokens"][0] != bos_id
        refused = http.post("/v1/tokenize", json={"messages": chat, "add_special_tokens": True})
        assert refused.status_code == 400 and error_of(refused)["param"] == "add_special_tokens"
    generated = _generate_until(frontend, str(model), remote, "Once upon a time")
    assert generated.status_code == 200, generated.text
