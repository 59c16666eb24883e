"""POST /v1/audio/transcriptions, /v1/audio/translations and /v1/audio/speech.

Transcriptions and translations take the multipart upload the OpenAI SDKs send. The file is
decoded here (PyAV, in a thread pool: `parsing.audio_decode`) to 16 kHz mono float32 and sent
to the engine as raw bytes in one `audio.transcribe` CALL; the engine's Whisper job runs one
30-second window per slice between chat steps and, with ``stream=true``, sends each window's
segments as partial RESULTs, relayed here as ``transcript.text.delta`` events before the
closing ``transcript.text.done``.

Speech takes OpenAI's JSON body. The engine's TTS job sends the audio as partial RESULTs (raw
float32 at the model's rate) as it synthesizes each segment; this route encodes them
(`parsing.audio_encode`, off the event loop) into the requested format and streams the bytes
with chunked transfer, so the first bytes leave before the whole clip exists. A refusal that
comes before the first piece of audio (unknown model, memory budget) is an ordinary JSON
error; one after it can only cut the stream.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import falcon
import falcon.asgi
import numpy as np
from falcon.asgi import SSEvent

from http_frontend.engine.client import EngineError, EngineUnavailable
from http_frontend.engine.frames import UnsendableRequest
from http_frontend.errors import APIError, ResponseCut, bad_request
from http_frontend.openai.transcripts import RESPONSE_FORMATS, render
from http_frontend.parsing.audio_decode import decode_upload
from http_frontend.parsing.audio_encode import FORMATS, MAX_SPEED, MIN_SPEED, StreamingEncoder, media_type
from http_frontend.parsing.body import check_model_name, get_field, read_json_object
from http_frontend.parsing.multipart_form import UploadForm, read_upload_form
from http_frontend.relay.generation import until_disconnect
from http_frontend.settings import FrontendSettings
from protocol import CallMethod

log = logging.getLogger(__name__)

GRANULARITIES = ("segment", "word")
_ENCODER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="audio-encode")
_DONE = object()


def _float_field(form: UploadForm, name: str, minimum: float, maximum: float) -> float | None:
    raw = form.text(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise bad_request(f"Invalid '{name}': expected a number, got {raw[:32]!r}", param=name,
                          code="invalid_type") from None
    if not minimum <= value <= maximum:
        raise bad_request(f"Invalid '{name}': {value} is outside [{minimum}, {maximum}]", param=name)
    return value


def _bool_field(form: UploadForm, name: str) -> bool:
    raw = (form.text(name) or "").lower()
    if raw in ("", "false", "0"):
        return False
    if raw in ("true", "1"):
        return True
    raise bad_request(f"Invalid '{name}': expected true or false, got {raw[:32]!r}", param=name, code="invalid_type")


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineError):
        return APIError.from_engine(exc.body)
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, UnsendableRequest):
        return exc.api_error()
    if isinstance(exc, APIError):
        return exc
    log.error("audio call failed: %r", exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error")


class _PartialCall:
    """A long CALL whose partial RESULTs are read as an async stream, then its final result."""

    def __init__(self, client: Any, method: CallMethod, args: dict[str, Any], timeout: float):
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        call = getattr(client, "call_streaming", None)
        if call is None:
            coro = client.call(method, args, timeout=timeout)
        else:
            coro = call(method, args, timeout=timeout, on_partial=self.queue.put_nowait)
        self.task = asyncio.ensure_future(coro)
        self.task.add_done_callback(lambda _: self.queue.put_nowait(_DONE))

    async def next(self) -> Any:
        """The next partial value, or `_DONE` once the call has finished (its result or error in `task`)."""
        return await self.queue.get()

    def result(self) -> Any:
        exc = self.task.exception()
        if exc is not None:
            raise _engine_error(exc)
        return self.task.result()

    async def finish(self) -> Any:
        """The final result, the partials skipped."""
        while await self.next() is not _DONE:
            pass
        return self.result()

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()


async def _first(req: falcon.asgi.Request, call: _PartialCall) -> Any:
    """The first partial (or `_DONE`); a client that leaves meanwhile cancels the call."""
    try:
        return await until_disconnect(req, call.next())
    except APIError:
        call.cancel()
        raise


_SLOTS: dict[int, asyncio.Semaphore] = {}


def _audio_slots(size: int) -> asyncio.Semaphore:
    """The worker's semaphore of `--max-audio-jobs` uploads in flight, shared by transcriptions and translations."""
    if size not in _SLOTS:
        _SLOTS[size] = asyncio.Semaphore(size)
    return _SLOTS[size]


class Transcriptions:
    """`client.audio.transcriptions.create` (task transcribe) and `.translations.create` (task translate)."""

    def __init__(self, client: Any, settings: FrontendSettings | None = None, task: str = "transcribe",
                 request_timeout: float = 600.0):
        self.client = client
        self.settings = settings or FrontendSettings()
        self.task = task
        self.request_timeout = request_timeout

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        form = await read_upload_form(req, self.settings.max_audio_bytes)
        args, response_format, words, stream = self._args(form)
        if form.file is None:
            raise bad_request("Missing required parameter: 'file'", param="file", code="missing_required_parameter")
        # A slot from decoding until the engine's answer (the samples stay in the CALL until then): a few KB
        # of compressed silence decode to tens of MB, and 20 at once held ~2 GB in one worker.
        slots = _audio_slots(self.settings.max_audio_jobs)
        await until_disconnect(req, slots.acquire())
        try:
            pcm = await decode_upload(form.file, self.settings.max_audio_seconds)
            args["audio"] = memoryview(pcm.astype("<f4", copy=False)).cast("B")  # packed as msgpack bin, no copy
            args["stream"] = stream
            call = _PartialCall(self.client, CallMethod.TRANSCRIBE, args, self.request_timeout)
        except BaseException:
            slots.release()
            raise
        del pcm
        call.task.add_done_callback(lambda _: slots.release())
        if stream:
            first = await _first(req, call)
            if first is _DONE:  # finished (or refused) before any segment: a refusal is a plain HTTP error
                result = call.result()
                resp.content_type = falcon.MEDIA_JSON
                resp.sse = self._events(call, [], result)
                return
            resp.sse = self._events(call, [first], None)
            return
        try:
            result = await until_disconnect(req, call.finish())
        finally:
            call.cancel()  # a client that left: its job is dropped on the engine (ABORT)
        body, content_type = render(result, response_format, self.task, words)
        resp.content_type = content_type
        if isinstance(body, str):
            resp.text = body
        else:
            resp.media = body

    def _args(self, form: UploadForm) -> tuple[dict[str, Any], str, bool, bool]:
        model = form.text("model")
        if not model:
            raise bad_request("Missing required parameter: 'model'", param="model", code="missing_required_parameter")
        check_model_name(model)
        response_format = form.text("response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise bad_request(f"Invalid 'response_format': {response_format[:32]!r}; expected one of "
                              f"{', '.join(RESPONSE_FORMATS)}", param="response_format")
        granularities = form.lists.get("timestamp_granularities") or []
        if form.text("timestamp_granularities"):
            granularities.append(form.text("timestamp_granularities") or "")
        unknown = [g for g in granularities if g not in GRANULARITIES]
        if unknown:
            raise bad_request(f"Invalid 'timestamp_granularities': {unknown[0][:32]!r}; expected segment or word",
                              param="timestamp_granularities")
        if granularities and response_format != "verbose_json":
            raise bad_request("'timestamp_granularities' requires response_format 'verbose_json'",
                              param="timestamp_granularities")
        if form.lists.get("include"):
            raise bad_request("'include' (logprobs) is not supported by Whisper models", param="include",
                              code="unsupported_parameter")
        chunking = form.text("chunking_strategy")
        if chunking not in (None, "", "auto"):
            raise bad_request("Only chunking_strategy 'auto' is supported (Whisper reads 30-second windows)",
                              param="chunking_strategy", code="unsupported_parameter")
        stream = _bool_field(form, "stream")
        if stream and response_format not in ("json", "text"):
            raise bad_request("Streaming transcriptions answer text events: use response_format json or text",
                              param="stream", code="unsupported_parameter")
        language = form.text("language") or None
        if language is not None and (len(language) > 32 or not language.replace("-", "").replace("_", "").isalpha()):
            raise bad_request(f"Invalid 'language': {language[:32]!r}; expected an ISO-639-1 code such as 'en'",
                              param="language")
        temperature = _float_field(form, "temperature", 0.0, 1.0)
        words = "word" in granularities
        args = {"model": model, "task": self.task, "language": language.lower() if language else None,
                "prompt": form.text("prompt") or None,
                # absent: Whisper's temperature fallback (0, then 0.2 ... 1.0 for windows that look failed);
                # given (0 included): that temperature alone, one decode per window
                "temperature": temperature,
                "timestamps": response_format in ("srt", "vtt", "verbose_json"), "word_timestamps": words}
        return args, response_format, words, stream

    async def _events(self, call: _PartialCall, pending: list[Any],
                      result: dict[str, Any] | None) -> AsyncIterator[SSEvent | None]:
        """`transcript.text.delta` per segment, then `transcript.text.done`; an error event if the engine fails."""
        try:
            if result is None:
                while True:
                    item = pending.pop(0) if pending else await call.next()
                    if item is _DONE:
                        break
                    delta = (item or {}).get("delta") or ""
                    if delta:
                        yield SSEvent(json={"type": "transcript.text.delta", "delta": delta})
                try:
                    result = call.result()
                except APIError as exc:
                    yield SSEvent(json=exc.to_dict())
                    return
            yield SSEvent(json={"type": "transcript.text.done", "text": str(result.get("text", "")),
                                "usage": {"type": "duration",
                                          "seconds": int(-(-float(result.get("duration") or 0) // 1))}})
        finally:
            call.cancel()


class SpeechCut(ResponseCut):
    """Speech that failed after its first bytes: raw audio ends the connection without its last chunk
    (`ResponseCut`), SSE sends an error event instead of `speech.audio.done`."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


class Speech:
    """`client.audio.speech.create`: the engine's TTS audio, encoded here and streamed as it is made."""

    def __init__(self, client: Any, settings: FrontendSettings | None = None, request_timeout: float = 600.0):
        self.client = client
        self.settings = settings or FrontendSettings()
        self.request_timeout = request_timeout

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_json_object(req, self.settings.max_body_bytes)
        model = get_field(body, "model", (str,), required=True)
        check_model_name(model)
        text = get_field(body, "input", (str,), required=True)
        if not text.strip():
            raise bad_request("'input' is empty", param="input")
        if len(text) > self.settings.max_speech_chars:
            raise bad_request(f"'input' is longer than {self.settings.max_speech_chars} characters", param="input",
                              code="string_above_max_length")
        voice = get_field(body, "voice", (str, dict))
        if isinstance(voice, dict):
            voice = voice.get("id")
            if not isinstance(voice, str):
                raise bad_request("'voice' must be a voice name or {\"id\": name}", param="voice", code="invalid_type")
        fmt = get_field(body, "response_format", (str,), default="mp3")
        if fmt not in FORMATS:
            raise bad_request(f"Invalid 'response_format': {fmt[:32]!r}; expected one of {', '.join(FORMATS)}",
                              param="response_format")
        speed = float(get_field(body, "speed", (float,), default=1.0, minimum=MIN_SPEED, maximum=MAX_SPEED))
        stream_format = get_field(body, "stream_format", (str,), default="audio")
        if stream_format not in ("audio", "sse"):
            raise bad_request("Invalid 'stream_format': expected audio or sse", param="stream_format")
        instructions = get_field(body, "instructions", (str,))
        args = {"model": model, "input": text, "voice": voice, "instructions": instructions or None}
        call = _PartialCall(self.client, CallMethod.SPEECH, args, self.request_timeout)
        first = await _first(req, call)
        if first is _DONE:
            call.result()  # a refusal before any audio: an ordinary JSON error
            raise bad_request("The speech model produced no audio for this input", param="input")
        rate = int(first.get("sample_rate") or 24_000)
        encoder = StreamingEncoder(fmt, rate, speed)
        chunks = self._encoded(call, first, encoder)
        if stream_format == "sse":
            resp.sse = self._sse(chunks, encoder)
            return
        resp.content_type = media_type(fmt)
        resp.set_header("X-Audio-Sample-Rate", str(rate))
        resp.stream = chunks

    async def _encoded(self, call: _PartialCall, first: dict[str, Any], encoder: StreamingEncoder) \
            -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        run: Callable[..., Any] = lambda fn, *a: loop.run_in_executor(_ENCODER, fn, *a)  # noqa: E731
        item: Any = first
        try:
            while item is not _DONE:
                pcm = np.frombuffer((item or {}).get("audio") or b"", dtype="<f4")
                data = await run(encoder.feed, pcm)
                if data:
                    yield data
                item = await call.next()
            try:
                call.result()
            except APIError as exc:  # after the first bytes: an SSE error event, or a cut connection (`SpeechCut`)
                log.warning("speech failed mid-stream: %s", exc.message)
                raise SpeechCut(exc) from None
            data = await run(encoder.finish)
            if data:
                yield data
        finally:
            call.cancel()

    async def _sse(self, chunks: AsyncIterator[bytes], encoder: StreamingEncoder) -> AsyncIterator[SSEvent]:
        try:
            async for data in chunks:
                yield SSEvent(json={"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        except SpeechCut as cut:  # an error event and no `done`: the audio so far is not the whole input
            yield SSEvent(json={"type": "error", **cut.error.to_dict()})
            return
        yield SSEvent(json={"type": "speech.audio.done",
                            "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}})
