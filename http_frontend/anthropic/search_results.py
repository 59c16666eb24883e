"""Anthropic `search_result` blocks -> the text a local model reads.

A client's own search (a RAG tool, a retrieval step) hands Claude its results as `search_result`
blocks, in a user turn or inside a `tool_result`: `{"type": "search_result", "source", "title",
"content": [text blocks], "citations"?}`. A chat template takes text, so each becomes its text in
place, under a header naming its title and source, as `document` blocks do (`document_text`).
`citations` is checked and accepted, but no citations come back: a local model writes none.
"""

from __future__ import annotations

from typing import Any

from http_frontend.errors import bad_request


def search_result_text(block: dict[str, Any], param: str) -> str:
    """A search_result block as `[Search result: title]`, `Source: source`, then its text blocks' text."""
    for field in ("source", "title"):
        if not isinstance(block.get(field), str):
            raise bad_request(f"{param}.{field}: expected a string", param=f"{param}.{field}", code="invalid_type")
    content = block.get("content")
    if not isinstance(content, list):
        raise bad_request(f"{param}.content: expected an array of text blocks", param=f"{param}.content",
                          code="invalid_type")
    texts = []
    for index, part in enumerate(content):
        where = f"{param}.content.{index}"
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: expected a text block with a string 'text'", param=where,
                              code="invalid_type")
        texts.append(part["text"])
    citations = block.get("citations")
    enabled = citations.get("enabled", False) if isinstance(citations, dict) else None
    if citations is not None and not isinstance(enabled, bool):
        raise bad_request(f"{param}.citations: expected an object with a boolean 'enabled'",
                          param=f"{param}.citations", code="invalid_type")
    return "\n".join([f"[Search result: {block['title']}]", f"Source: {block['source']}", *texts])
