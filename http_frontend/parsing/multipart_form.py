"""multipart/form-data uploads, as the OpenAI SDKs send /v1/audio/transcriptions and /translations.

Falcon's own multipart parser reads the parts (it streams; nothing is buffered before we ask).
Every part is read with a cap: the file part up to `max_file_bytes` (413 past it, like
OpenAI's 25 MB), every other field up to `MAX_FIELD_BYTES`; the number of parts is capped too,
so a body of endless tiny fields costs nothing. Repeated fields (``timestamp_granularities[]``,
``include[]``) are kept as lists; the SDKs send booleans and numbers as their text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import falcon
import falcon.asgi

from http_frontend.errors import APIError, bad_request

MAX_FIELD_BYTES = 64 * 1024
MAX_PARTS = 64
# Bytes of multipart framing allowed on top of the file and the fields.
_OVERHEAD = 1024 * 1024


@dataclass
class UploadForm:
    """The parsed form: the one file part and the text fields (a list for repeated fields)."""

    file: bytes | None = None
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    lists: dict[str, list[str]] = field(default_factory=dict)

    def text(self, name: str) -> str | None:
        value = self.fields.get(name)
        return value if value is None else value.strip()


async def read_upload_form(req: falcon.asgi.Request, max_file_bytes: int) -> UploadForm:
    """The request's multipart form, bounded; 400 for another content type or a malformed body, 413 when too big."""
    content_type = (req.content_type or "").lower()
    if not content_type.startswith("multipart/form-data"):
        raise bad_request("This endpoint takes multipart/form-data with a 'file' part "
                          f"(got {req.content_type or 'no content type'})", code="invalid_content_type")
    limit = max_file_bytes + MAX_PARTS * MAX_FIELD_BYTES + _OVERHEAD
    if req.content_length is not None and req.content_length > limit:
        raise _too_large(max_file_bytes)
    form = UploadForm()
    parts = 0
    try:
        multipart = await req.get_media()
        async for part in multipart:
            parts += 1
            if parts > MAX_PARTS:
                raise bad_request(f"The form has more than {MAX_PARTS} parts", code="invalid_form")
            name = part.name or ""
            if name == "file":
                if form.file is not None:
                    raise bad_request("Send one 'file' part", param="file", code="invalid_form")
                data = await part.stream.read(max_file_bytes + 1)
                if len(data) > max_file_bytes:
                    raise _too_large(max_file_bytes)
                form.file, form.filename = data, part.secure_filename if part.filename else None
                continue
            raw = await part.stream.read(MAX_FIELD_BYTES + 1)
            if len(raw) > MAX_FIELD_BYTES:
                raise bad_request(f"The form field '{name[:64]}' exceeds {MAX_FIELD_BYTES} bytes", param=name[:64],
                                  code="invalid_form")
            try:
                value = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise bad_request(f"The form field '{name[:64]}' is not UTF-8 text", param=name[:64],
                                  code="invalid_form") from None
            if name.endswith("[]"):
                form.lists.setdefault(name[:-2], []).append(value)
            else:
                form.fields[name] = value
    except falcon.MediaMalformedError as exc:
        raise bad_request(f"The multipart body is malformed: {exc.description or exc.title}",
                          code="invalid_form") from None
    except falcon.HTTPError as exc:
        raise bad_request(f"The multipart body could not be read: {exc.description or exc.title}",
                          code="invalid_form") from None
    return form


def _too_large(max_file_bytes: int) -> APIError:
    return APIError(413, f"The uploaded file exceeds {max_file_bytes} bytes", param="file",
                    code="request_too_large")
