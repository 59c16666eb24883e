"""The playground's routes in-process (falcon.testing): files, types, headers, keys, --no-playground."""

from __future__ import annotations

import re

import pytest

from http_frontend.playground.resource import CSP, load_assets
from http_frontend.settings import PLAYGROUND_ENV, FrontendSettings, add_flags, flags_to_env
from tests.unit.fake_engine import FakeEngine, client_for

KEY = "sk-playground-test"
PAGE_BUDGET = 150_000  # bytes, uncompressed, every file the page loads


def test_page_and_files_with_types_and_strict_headers() -> None:
    client = client_for(FakeEngine())
    for path in ("/", "/playground"):
        page = client.simulate_get(path)
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert '<script type="module" src="playground/app.js">' in page.text
        assert page.headers["content-security-policy"] == CSP
        assert "default-src 'self'" in CSP and "frame-ancestors 'none'" in CSP and "unsafe" not in CSP
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["referrer-policy"] == "no-referrer"
        assert page.headers["x-frame-options"] == "DENY"
    types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
    for name in load_assets():
        answer = client.simulate_get(f"/playground/{name}")
        assert answer.status_code == 200, name
        suffix = name[name.rindex("."):]
        if suffix in types:
            assert answer.headers["content-type"] == types[suffix]
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_no_inline_code_and_no_other_origin_in_the_files() -> None:
    """The CSP forbids inline scripts/styles and other hosts: the files must not need them."""
    assets = load_assets()
    page = assets["index.html"].body.decode()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page), "inline <script>"
    assert "<style" not in page and " style=" not in page and " on" + "click=" not in page
    for name, asset in assets.items():
        text = asset.body.decode()
        other_host = re.search(r"(?:https?:)?//[\w.-]+\.(?:com|net|org|io|dev)/", text.replace("http://www.w3.org", ""))
        assert not other_host, (name, other_host)
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "document.write" not in text, name
    assert sum(len(a.body) for a in assets.values()) < PAGE_BUDGET


def test_unknown_file_is_404_and_no_traversal() -> None:
    client = client_for(FakeEngine())
    assert client.simulate_get("/playground/nope.js").status_code == 404
    assert client.simulate_get("/playground/..%2Fresource.py").status_code == 404
    assert client.simulate_get("/playground/__init__.py").status_code == 404


def test_etag_revalidation() -> None:
    client = client_for(FakeEngine())
    first = client.simulate_get("/playground/app.js")
    assert first.headers["cache-control"] == "no-cache"
    again = client.simulate_get("/playground/app.js", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and not again.content
    head = client.simulate_head("/")
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(load_assets()["index.html"].body)


def test_page_needs_no_key_but_the_api_still_does() -> None:
    client = client_for(FakeEngine(), FrontendSettings(api_keys=(KEY,)))
    assert client.simulate_get("/").status_code == 200
    assert client.simulate_get("/playground").status_code == 200
    assert client.simulate_get("/playground/app.js").status_code == 200
    assert client.simulate_get("/v1/models").status_code == 401
    assert client.simulate_get("/stats").status_code == 401
    assert client.simulate_get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # Only reading the page is public: other methods on its paths need the key as before.
    assert client.simulate_post("/", json={}).status_code == 401
    assert client.simulate_post("/playground").status_code == 401
    # A public path spelled to reach another resource is decided on the resource: still 401.
    assert client.simulate_get("/playground/../stats").status_code in (401, 404)
    assert client.simulate_get("//stats").status_code == 401


def test_no_playground_turns_the_routes_off() -> None:
    settings = FrontendSettings.from_env({PLAYGROUND_ENV: "0"})
    assert settings.playground is False
    client = client_for(FakeEngine(), settings)
    assert client.simulate_get("/").status_code == 404
    assert client.simulate_get("/playground/app.js").status_code == 404
    assert client.simulate_get("/health").status_code == 200
    keyed = client_for(FakeEngine(), FrontendSettings(api_keys=(KEY,), playground=False))
    assert keyed.simulate_get("/").status_code == 404  # nothing there, key or not
    assert keyed.simulate_get("/stats").status_code == 401
    assert FrontendSettings.from_env({}).playground is True
    with pytest.raises(ValueError, match=PLAYGROUND_ENV):
        FrontendSettings.from_env({PLAYGROUND_ENV: "maybe"})


def test_no_playground_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    def parse(*argv: str) -> dict[str, str]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--host", default="127.0.0.1")
        add_flags(parser)
        return flags_to_env(parser.parse_args(list(argv)))

    monkeypatch.delenv(PLAYGROUND_ENV, raising=False)
    assert parse()[PLAYGROUND_ENV] == "1"
    assert parse("--no-playground")[PLAYGROUND_ENV] == "0"
    monkeypatch.setenv(PLAYGROUND_ENV, "0")
    assert parse()[PLAYGROUND_ENV] == "0"
    from http_frontend.cli import build_parser

    assert "--no-playground" in build_parser().format_help()


def test_every_file_of_the_page_is_package_data() -> None:
    """An installed (non-editable) front-end has the page: pyproject ships static/ as package data."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["http_frontend.playground"]
    static = root / "http_frontend" / "playground" / "static"
    for path in static.iterdir():
        assert any(fnmatch.fnmatch(f"static/{path.name}", pattern) for pattern in shipped), path.name
