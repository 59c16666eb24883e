"""Anthropic `document` blocks -> the text a local model reads.

Claude Code's Read tool answers with a base64 PDF `document` block inside a tool result;
users attach text or PDF documents to a turn. A chat template takes text, so each
document becomes its text under a header naming its title: a plain-text source as
is, a content source's text blocks joined, a PDF's pages extracted with pypdf.

Bounds, because the bytes are a client's: the decoded PDF is at most `MAX_PDF_BYTES`
(the body limit applies first), at most `pdf_text.MAX_PAGES` pages are read and at most
`MAX_CHARS` characters kept (the rest is dropped with a note saying so), by a child process
killed after `MAX_PDF_SECONDS` (`pdf_text`). A PDF pypdf cannot read, or not in time, is a
400 naming the block. Extraction is CPU work: the Anthropic route runs
the whole request translation off the event loop when a PDF is present
(`has_pdf_documents`).
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

from http_frontend.errors import APIError, bad_request
from http_frontend.parsing.pdf_text import MAX_CHARS, extract

log = logging.getLogger(__name__)

MAX_PDF_BYTES = 32 << 20


def has_pdf_documents(body: dict[str, Any]) -> bool:
    """Whether any message (or tool result in one) carries a base64 PDF document: cheap, no decoding."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False

    def pdf(block: Any) -> bool:
        if not isinstance(block, dict):
            return False
        if block.get("type") == "document":
            source = block.get("source")
            return isinstance(source, dict) and source.get("type") == "base64"
        inner = block.get("content") if block.get("type") == "tool_result" else None
        return isinstance(inner, list) and any(pdf(part) for part in inner)

    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(pdf(b) for b in m["content"])
               for m in messages)


def _pdf_text(data: str, param: str) -> str:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}.source.data: not valid base64", param=f"{param}.source.data",
                          code="invalid_value") from None
    if len(raw) > MAX_PDF_BYTES:
        raise bad_request(f"{param}: the PDF is larger than {MAX_PDF_BYTES >> 20} MiB", param=param,
                          code="invalid_value")
    result = extract(raw)
    if result.busy:
        raise APIError(503, f"{param}: {result.error}; retry", code="pdf_reader_busy", param=param,
                       error_type="server_error", headers={"Retry-After": "5"})
    if result.error is not None or result.texts is None:
        raise bad_request(f"{param}: the PDF could not be read ({result.error})"[:300], param=param,
                          code="invalid_value")
    pages = result.pages
    texts = [f"--- page {number} ---\n{text}" for number, text in enumerate(result.texts, start=1)]
    joined = "\n".join(texts)
    if len(joined) > MAX_CHARS or len(texts) < pages:
        joined = joined[:MAX_CHARS] + f"\n[… truncated: {pages} pages, the first {len(texts)} read, " \
                                      f"at most {MAX_CHARS} characters kept]"
    return joined


def document_text(block: dict[str, Any], param: str) -> str:
    """A document block's text, under a `[Document: title]` header (with its `context`, when given)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content" and isinstance(source.get("content"), (str, list)):
        content = source["content"]
        text = content if isinstance(content, str) else "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    elif kind == "base64" and source.get("media_type") == "application/pdf" and isinstance(source.get("data"), str):
        text = _pdf_text(source["data"], param)
    elif kind == "base64" and isinstance(source.get("media_type"), str) and source["media_type"].startswith("text/"):
        try:
            text = base64.b64decode(source.get("data") or "", validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            raise bad_request(f"{param}.source.data: not valid base64", param=f"{param}.source.data",
                              code="invalid_value") from None
    elif kind in ("url", "file"):
        raise bad_request(f"{param}.source: '{kind}' documents are not fetched by this server; send the document "
                          "as a base64 PDF or as text", param=f"{param}.source", code="unsupported_content")
    else:
        raise bad_request(f"{param}.source: expected a text, content or base64 (application/pdf, text/*) source",
                          param=f"{param}.source", code="invalid_value")
    title = block.get("title") if isinstance(block.get("title"), str) else None
    context = block.get("context") if isinstance(block.get("context"), str) else None
    header = f"[Document: {title}]" if title else "[Document]"
    return "\n".join(part for part in (header, context, text) if part)
