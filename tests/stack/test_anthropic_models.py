"""GET /v1/models for Anthropic's SDK: `ModelInfo` pages, and its errors in Anthropic's envelope."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import httpx
import pytest
from anthropic.types import ModelInfo

from http_frontend.errors import APIError
from http_frontend.service.anthropic_models import model_page
from tests.helpers import Frontend


def test_the_anthropic_sdk_lists_and_retrieves_models(frontend: Frontend, model_id: str) -> None:
    client = anthropic.Anthropic(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=60)
    page = client.models.list()
    raw = httpx.get(f"{frontend.base_url}/v1/models", headers={"anthropic-version": "2023-06-01"}, timeout=30).json()
    for entry in raw["data"]:
        ModelInfo.model_validate(entry, strict=False)  # every field the SDK's type requires, of its type
        assert entry["type"] == "model" and entry["display_name"] == entry["id"]
    assert raw["first_id"] == raw["data"][0]["id"] and raw["last_id"] == raw["data"][-1]["id"]
    assert raw["has_more"] is False
    assert model_id in [model.id for model in page.data]
    one = client.models.retrieve(model_id)
    assert one.id == model_id and one.type == "model" and one.created_at.tzinfo is not None
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    # An OpenAI client of the same path still gets OpenAI's model objects.
    openai_list = httpx.get(f"{frontend.base_url}/v1/models", timeout=30).json()
    assert openai_list["object"] == "list" and all(m["object"] == "model" for m in openai_list["data"])


def request(**params: str) -> SimpleNamespace:
    return SimpleNamespace(get_param=params.get)


CATALOGUE = [{"id": f"m{i}", "created": 1_700_000_000 + i} for i in range(5)]


@pytest.mark.parametrize(("params", "ids", "has_more"), [
    ({}, ["m0", "m1", "m2", "m3", "m4"], False),
    ({"limit": "2"}, ["m0", "m1"], True),
    ({"limit": "2", "after_id": "m1"}, ["m2", "m3"], True),
    ({"limit": "2", "after_id": "m3"}, ["m4"], False),
    ({"limit": "2", "before_id": "m4"}, ["m2", "m3"], True),
    ({"limit": "2", "before_id": "m1"}, ["m0"], False),
])
def test_pages_follow_the_cursors(params: dict[str, str], ids: list[str], has_more: bool) -> None:
    page = model_page(CATALOGUE, request(**params))
    assert [m["id"] for m in page["data"]] == ids and page["has_more"] is has_more
    assert page["first_id"] == ids[0] and page["last_id"] == ids[-1]
    assert page["data"][0]["created_at"].endswith("Z")


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "x"}, {"limit": "1001"}, {"after_id": "nope"},
                                    {"after_id": "m1", "before_id": "m3"}])
def test_bad_cursors_are_client_errors(params: dict[str, str]) -> None:
    with pytest.raises(APIError) as caught:
        model_page(CATALOGUE, request(**params))
    assert caught.value.status in (400, 404)
