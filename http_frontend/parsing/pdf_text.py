"""A PDF's text, extracted by pypdf in a child process that is killed at a deadline.

Why a process: text extraction costs what the PDF's content streams say, not what the PDF
weighs. 10.7 KB of PDF whose 50 pages share one 1 MiB stream of empty text operators took
108 s of a worker's CPU, a few more KB would take hours, and a thread cannot be stopped. A
child process can: `extract` runs `python -m http_frontend.parsing.pdf_text` with the PDF on
stdin and kills it after `MAX_PDF_SECONDS`, at most `MAX_CONCURRENT` at a time per worker.

The child prints one JSON object: {"pages", "texts"} (the first pages' texts, `MAX_PAGES`
and `MAX_CHARS` at most) or {"error"}.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from dataclasses import dataclass

MAX_PAGES = 300
MAX_CHARS = 400_000
MAX_PDF_SECONDS = 20.0
MAX_CONCURRENT = 2
_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT)


@dataclass
class PdfText:
    """What extraction gave: page texts in order (maybe fewer than `pages`), or why it failed."""

    pages: int = 0
    texts: list[str] | None = None
    error: str | None = None
    timed_out: bool = False
    busy: bool = False  # no reader free in time: the request may be retried


def extract(raw: bytes, seconds: float | None = None) -> PdfText:
    """Runs the child on `raw` for at most `seconds` (`MAX_PDF_SECONDS`); blocking (callers are off the loop)."""
    seconds = MAX_PDF_SECONDS if seconds is None else seconds
    if not _SLOTS.acquire(timeout=seconds):  # a queue behind hostile PDFs must not grow without bound
        return PdfText(busy=True, error=f"this worker is reading other PDFs; none finished within {seconds:g} s")
    try:
        try:
            done = subprocess.run([sys.executable, "-m", "http_frontend.parsing.pdf_text"], input=raw,
                                  capture_output=True, timeout=seconds, check=False)
        except subprocess.TimeoutExpired:  # subprocess.run kills the child before raising
            return PdfText(timed_out=True, error=f"its text could not be read within {seconds:g} s")
    finally:
        _SLOTS.release()
    try:
        result = json.loads(done.stdout)
    except ValueError:
        return PdfText(error=f"the reader stopped (exit status {done.returncode})")
    return PdfText(pages=result.get("pages", 0), texts=result.get("texts"), error=result.get("error"))


def _read(raw: bytes) -> dict:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(raw))
        pages, texts, size = len(reader.pages), [], 0
        for page in reader.pages[:MAX_PAGES]:
            text = page.extract_text() or ""
            texts.append(text)
            size += len(text)
            if size > MAX_CHARS:
                break
    except (PdfReadError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"pages": pages, "texts": texts}


if __name__ == "__main__":
    json.dump(_read(sys.stdin.buffer.read()), sys.stdout)
