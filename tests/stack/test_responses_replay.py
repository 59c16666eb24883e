"""A stored response streamed again (`GET /v1/responses/{id}?stream=true`) through the real stack:
openai SDK -> gunicorn -> engined's store and back."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import Frontend, client_for
from tests.unit.test_responses_translation import TEXT_DONE, TEXT_EVENTS, collapse


def test_a_stored_response_streams_again_through_the_sdk(frontend: Frontend, model_id: str) -> None:
    client = client_for(frontend)
    with client.responses.create(model=model_id, input="Count to ten.", max_output_tokens=6, temperature=0,
                                 stream=True, extra_body={"ignore_eos": True}) as stream:
        original = list(stream)
    final = original[-1].response
    with client.responses.retrieve(final.id, stream=True) as stream:
        replayed = list(stream)
    assert [event.type for event in replayed] == collapse([event.type for event in original]) == [
        "response.created", "response.in_progress", *TEXT_EVENTS, *TEXT_DONE, "response.incomplete"]
    assert [event.sequence_number for event in replayed] == list(range(len(replayed)))
    assert replayed[-1].response.model_dump() == final.model_dump()
    assert replayed[0].response.model_dump() == original[0].response.model_dump()
    (delta,) = [event for event in replayed if event.type == "response.output_text.delta"]
    assert delta.delta == final.output_text and delta.item_id == final.output[0].id
    # Resumed after the delta: its .done events and the end, numbered as in the full replay.
    with client.responses.retrieve(final.id, stream=True, starting_after=delta.sequence_number) as stream:
        rest = [event.model_dump() for event in stream]
    assert rest == [event.model_dump() for event in replayed[delta.sequence_number + 1:]]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(final.id, stream=True, starting_after=len(replayed))
    assert refused.value.body["param"] == "starting_after"
    raw = httpx.get(f"{frontend.base_url}/v1/responses/{final.id}", params={"stream": "true"}, timeout=30)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.startswith("event: response.created\n")
