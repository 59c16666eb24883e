"""The OpenAPI description names every route the app serves."""

from __future__ import annotations

import re

import pytest

from http_frontend.service.openapi import openapi_document


def _routes(app: object) -> set[str]:
    """Every URI template registered on the falcon router (the wrapped app unwrapped)."""
    while not hasattr(app, "_router"):
        app = app.app
    found: set[str] = set()

    def walk(nodes: list) -> None:
        for node in nodes:
            if node.resource is not None:  # converters ({model_id:path}) are not part of OpenAPI's template
                found.add(re.sub(r"\{(\w+):\w+\}", r"{\1}", node.uri_template))
            walk(node.children)

    walk(app._router._roots)
    return found


def test_every_route_is_described(monkeypatch: pytest.MonkeyPatch) -> None:
    from http_frontend.app import create_app

    described = set(openapi_document()["paths"])
    routes = _routes(create_app("ipc:///tmp/unused-openapi.sock"))
    # The playground's page and files are not API (text/html, text/javascript): see tests/browser.
    routes -= {"/", "/playground", "/playground/{name}"}
    # Each /v1 route also answers without the prefix; the document lists the /v1 spelling.
    missing = {r for r in routes if r not in described and f"/v1{r}" not in described}
    assert not missing, f"routes missing from /openapi.json: {sorted(missing)}"
    assert not {p for p in described if p not in routes}, "the document lists routes that do not exist"
