"""What a client sees of an engine error: no server paths (`describe`, `engine_failure`)."""

from __future__ import annotations

from engine_daemon.errors import describe, engine_failure, redact_paths
from engine_daemon.request.template_kwargs import checked_template_kwargs


def test_server_paths_in_exception_text_are_cut_to_their_last_component() -> None:
    exc = ValueError("Qwen2Tokenizer(name_or_path='/srv/models/secret-team/qwen', vocab_size=5) "
                     "failed in /usr/lib/python3/site-packages/jinja2/runtime.py")
    assert describe(exc) == "Qwen2Tokenizer(name_or_path='qwen', vocab_size=5) failed in runtime.py"
    body = engine_failure(exc).to_body("rid-1")
    assert "/srv" not in body["message"] and "/usr" not in body["message"] and body["status"] == 500


def test_urls_ratios_and_single_slashes_are_left_alone() -> None:
    text = "see http://host/a/b and 3/4 of /tmp"
    assert redact_paths(text) == text


def test_template_kwargs_accept_json_and_refuse_the_rest() -> None:
    assert checked_template_kwargs({"a": [1, {"b": None}], "enable_thinking": True}) == {
        "a": [1, {"b": None}], "enable_thinking": True}
    for bad in ({"tokenize": False}, {"x": 2**70}, {"x": float("nan")}, {"x": [[[[[[[[[[1]]]]]]]]]]},
                {"x": list(range(2000))}, {"x": b"bytes"}, ["not", "a", "map"]):
        try:
            checked_template_kwargs(bad)
        except Exception as exc:
            assert getattr(exc, "status", None) == 400 and exc.param == "chat_template_kwargs"
        else:
            raise AssertionError(f"{bad!r} was accepted")
