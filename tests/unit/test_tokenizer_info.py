"""`GET /tokenizer_info` and `/tokenize`'s `add_special_tokens`: the route through falcon.testing around a
`FakeEngine`, and the engine's TOKENIZE handler on real tokenizers (the tiny model's, which adds no BOS, and
a derived one that does), as lm-evaluation-harness's remote tokenizer uses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_daemon.calls.tokenize import tokenize
from engine_daemon.errors import RequestError
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.store import ModelRef
from http_frontend.openai.tokenize import TOKENIZER_INFO_FIELDS
from model_builders.text import derive_model
from model_builders.tokenizer import ENDOFTEXT, IM_END
from protocol import CallMethod
from tests.unit.fake_engine import FakeEngine, client_for, error_body

INFO = {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>", "unk_token": None,
        "eos_token_id": 7, "bos_token_id": None, "pad_token_id": 5, "add_bos_token": False, "add_eos_token": False,
        "chat_template": "{{ messages }}", "model_max_length": 4096, "vocab_size": 8,
        "tokenizer_class": "Qwen2Tokenizer"}


def _info_engine() -> FakeEngine:
    engine = FakeEngine()
    # The engine also says which model answered (and could send more): the route passes on its fields only.
    engine.replies[CallMethod.TOKENIZE] = lambda args: {**INFO, "model": "/models/tiny", "name_or_path": "/models"}
    return engine


def test_tokenizer_info_answers_the_engines_fields_on_both_spellings() -> None:
    engine = _info_engine()
    client = client_for(engine)
    for path in ("/tokenizer_info", "/v1/tokenizer_info"):
        result = client.simulate_get(path)
        assert result.status_code == 200, result.text
        assert result.json == INFO and set(result.json) == set(TOKENIZER_INFO_FIELDS)
    named = client.simulate_get("/tokenizer_info", params={"model": "org/name"})
    assert named.status_code == 200
    assert engine.calls == [("tokenize", {"model": None, "tokenizer_info": True})] * 2 + [
        ("tokenize", {"model": "org/name", "tokenizer_info": True})]
    assert client.simulate_post("/tokenizer_info").status_code == 405


@pytest.mark.parametrize("status,code", [(404, "model_not_found"), (400, "model_not_loaded")])
def test_tokenizer_info_answers_the_engines_refusal_in_openais_shape(status: int, code: str) -> None:
    from http_frontend.engine.client import EngineError

    engine = FakeEngine()
    engine.replies[CallMethod.TOKENIZE] = EngineError(error_body(status, code, "refused", param="model"))
    result = client_for(engine).simulate_get("/v1/tokenizer_info", params={"model": "nope"})
    assert result.status_code == status
    assert result.json["error"]["code"] == code and result.json["error"]["param"] == "model"
    assert result.json["error"]["message"] == "refused"


def test_tokenizer_info_refuses_an_overlong_name_before_the_engine_and_is_503_when_it_is_down() -> None:
    engine = _info_engine()
    client = client_for(engine)
    long = client.simulate_get("/tokenizer_info", params={"model": "x" * 5000})
    assert long.status_code == 400 and long.json["error"]["code"] == "invalid_model_name"
    assert engine.calls == []
    engine.up = False
    down = client.simulate_get("/tokenizer_info")
    assert down.status_code == 503 and down.json["error"]["code"] == "engine_unavailable"


def test_tokenize_passes_add_special_tokens_only_when_given() -> None:
    engine = FakeEngine()
    client = client_for(engine)
    for body in ({"prompt": "a"}, {"prompt": "a", "add_special_tokens": False},
                 {"prompt": "a", "add_special_tokens": True}, {"prompt": "a", "add_special_tokens": None}):
        assert client.simulate_post("/tokenize", json=body).status_code == 200
    assert [args.get("add_special_tokens", "absent") for _, args in engine.calls] == ["absent", False, True, "absent"]
    for bad in (1, "false", [True]):
        result = client.simulate_post("/v1/tokenize", json={"prompt": "a", "add_special_tokens": bad})
        assert result.status_code == 400 and result.json["error"]["param"] == "add_special_tokens"
    assert len(engine.calls) == 4


# -- the engine's handler, on real tokenizers ---------------------------------------------------------------


def _loaded(path: Path, model_id: str) -> LoadedModel:
    from mlx_lm.tokenizer_utils import load

    return LoadedModel(ref=ModelRef(id=model_id, path=path), model=None, tokenizer=load(path), context_window=32768,
                       vocab_size=0)


@pytest.fixture(scope="module")
def plain(tiny_model: Path) -> LoadedModel:
    return _loaded(tiny_model, "tiny")


@pytest.fixture(scope="module")
def with_bos(tiny_model: Path) -> LoadedModel:
    return _loaded(derive_model(tiny_model, tiny_model.parent / "tiny-with-bos", bos_token=ENDOFTEXT), "tiny-bos")


def _ids(model: LoadedModel, **args: Any) -> list[int]:
    return tokenize(model, args)["tokens"]


def test_the_engines_tokenizer_info_names_the_special_tokens_and_no_path(plain: LoadedModel,
                                                                        with_bos: LoadedModel) -> None:
    info = tokenize(plain, {"tokenizer_info": True})
    assert set(info) == set(TOKENIZER_INFO_FIELDS) | {"model"} and info["model"] == "tiny"
    hf = plain.tokenizer._tokenizer
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (IM_END, None, ENDOFTEXT)
    assert (info["eos_token_id"], info["pad_token_id"]) == (hf.eos_token_id, hf.pad_token_id)
    assert _ids(plain, prompt=info["eos_token"], add_special_tokens=False) == [info["eos_token_id"]]
    assert info["add_bos_token"] is info["add_eos_token"] is False
    assert info["chat_template"] == hf.chat_template and "im_start" in info["chat_template"]
    assert (info["model_max_length"], info["vocab_size"]) == (32768, len(hf.get_vocab()))
    assert str(plain.ref.path) not in repr(info) and plain.ref.path.name not in repr(info)

    bos = tokenize(with_bos, {"tokenizer_info": True})
    assert bos["bos_token"] == ENDOFTEXT and bos["add_bos_token"] is True and bos["add_eos_token"] is False
    assert _ids(with_bos, prompt=ENDOFTEXT, add_special_tokens=False) == [bos["bos_token_id"]]


def test_add_special_tokens_adds_the_bos_only_when_asked(plain: LoadedModel, with_bos: LoadedModel) -> None:
    text = "Once upon a time"
    assert _ids(plain, prompt=text, add_special_tokens=True) == _ids(plain, prompt=text, add_special_tokens=False)
    bare = _ids(with_bos, prompt=text, add_special_tokens=False)
    bos_id = with_bos.tokenizer.bos_token_id
    assert bos_id is not None and bos_id not in bare
    assert _ids(with_bos, prompt=text, add_special_tokens=True) == [bos_id] + bare
    # Absent: the tokenizer's own rules, as a completion's prompt is built (here: the BOS).
    assert _ids(with_bos, prompt=text) == [bos_id] + bare
    # Messages are tokenized as the chat route renders them; `false` is that, `true` is refused.
    chat = [{"role": "user", "content": text}]
    assert _ids(with_bos, messages=chat, add_special_tokens=False) == _ids(with_bos, messages=chat)
    with pytest.raises(RequestError) as refused:
        tokenize(with_bos, {"messages": chat, "add_special_tokens": True})
    assert refused.value.status == 400 and refused.value.param == "add_special_tokens"
    with pytest.raises(RequestError) as wrong_type:
        tokenize(plain, {"prompt": text, "add_special_tokens": "yes"})
    assert wrong_type.value.status == 400 and wrong_type.value.param == "add_special_tokens"


def test_tokenizer_info_resolves_the_model_name_as_tokenize_does(plain: LoadedModel) -> None:
    def resolve(name: str) -> ModelRef:
        if name == "alias":
            return plain.ref
        if name == "other":
            return ModelRef(id="other", path=Path("/elsewhere"))
        raise RequestError(404, "model_not_found", f"The model '{name}' does not exist", param="model")

    assert tokenize(plain, {"model": "alias", "tokenizer_info": True}, resolve)["model"] == "tiny"
    for name, status, code in (("other", 400, "model_not_loaded"), ("unknown", 404, "model_not_found")):
        with pytest.raises(RequestError) as caught:
            tokenize(plain, {"model": name, "tokenizer_info": True}, resolve)
        assert (caught.value.status, caught.value.code, caught.value.param) == (status, code, "model")
    with pytest.raises(RequestError) as none_loaded:
        tokenize(None, {"tokenizer_info": True})
    assert none_loaded.value.code == "model_not_loaded"
