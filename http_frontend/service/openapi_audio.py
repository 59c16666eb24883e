"""The /v1/audio/* part of the OpenAPI document (`service.openapi` merges it in).

Kept apart so each document module stays short; the shapes follow OpenAI's audio API.
"""

from __future__ import annotations

from typing import Any

_STRING = {"type": "string"}
_NUMBER = {"type": "number"}
_INTEGER = {"type": "integer"}
_ERRORS = (400, 401, 404, 413, 503, 504)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors() -> dict[str, Any]:
    return {str(code): {"description": "Error", "content": {"application/json": {"schema": _ref("Error")}}}
            for code in _ERRORS}


_UPLOAD_FIELDS = {
    "file": {"type": "string", "format": "binary",
             "description": "flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav or webm; at most --max-audio-bytes"},
    "model": _STRING,
    "prompt": _STRING,
    "response_format": {"type": "string", "enum": ["json", "text", "srt", "verbose_json", "vtt"]},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
}
TRANSCRIPTION_REQUEST = {"type": "object", "required": ["file", "model"], "properties": {
    **_UPLOAD_FIELDS, "language": _STRING,
    "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["segment", "word"]}},
    "stream": {"type": "boolean"}}}
TRANSLATION_REQUEST = {"type": "object", "required": ["file", "model"], "properties": _UPLOAD_FIELDS}
_SEGMENT = {"type": "object", "properties": {
    "id": _INTEGER, "seek": _INTEGER, "start": _NUMBER, "end": _NUMBER, "text": _STRING,
    "tokens": {"type": "array", "items": _INTEGER}, "temperature": _NUMBER, "avg_logprob": _NUMBER,
    "compression_ratio": _NUMBER, "no_speech_prob": _NUMBER}}
TRANSCRIPTION = {"type": "object", "required": ["text"], "properties": {
    "text": _STRING, "task": _STRING, "language": _STRING, "duration": _NUMBER,
    "segments": {"type": "array", "items": _SEGMENT},
    "words": {"type": "array", "items": {"type": "object", "properties": {
        "word": _STRING, "start": _NUMBER, "end": _NUMBER}}},
    "usage": {"type": "object", "properties": {"type": _STRING, "seconds": _INTEGER}}}}
SPEECH_REQUEST = {"type": "object", "required": ["model", "input", "voice"], "properties": {
    "model": _STRING, "input": {"type": "string", "minLength": 1}, "voice": _STRING, "instructions": _STRING,
    "response_format": {"type": "string", "enum": ["mp3", "opus", "aac", "flac", "wav", "pcm"]},
    "speed": {"type": "number", "minimum": 0.25, "maximum": 4.0},
    "stream_format": {"type": "string", "enum": ["audio", "sse"]}}}
_TEXT_FORMATS = {media: {"schema": _STRING} for media in ("text/plain", "text/vtt")}
_AUDIO_TYPES = ("audio/mpeg", "audio/ogg", "audio/aac", "audio/flac", "audio/wav", "audio/pcm")

AUDIO_SCHEMAS: dict[str, Any] = {
    "TranscriptionRequest": TRANSCRIPTION_REQUEST, "TranslationRequest": TRANSLATION_REQUEST,
    "Transcription": TRANSCRIPTION, "SpeechRequest": SPEECH_REQUEST,
}


def _upload(summary: str, request: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "The transcript in the requested response_format (SSE "
                                             "transcript.text.* events with stream=true)",
                              "content": {"application/json": {"schema": _ref("Transcription")}, **_TEXT_FORMATS,
                                          "text/event-stream": {"schema": _STRING}}},
                      **_errors()}}}


AUDIO_PATHS: dict[str, Any] = {
    "/v1/audio/transcriptions": _upload("Transcribe an audio file (Whisper, in the engine's transcription slot)",
                                        "TranscriptionRequest"),
    "/v1/audio/translations": _upload("Translate an audio file into English text (Whisper's translate task)",
                                      "TranslationRequest"),
    "/v1/audio/speech": {"post": {
        "summary": "Synthesize speech (the engine's speech slot); the body streams as it is made",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("SpeechRequest")}}},
        "responses": {"200": {"description": "Audio bytes in the requested response_format (chunked)",
                              "content": {**{media: {"schema": {"type": "string", "format": "binary"}}
                                             for media in _AUDIO_TYPES},
                                          "text/event-stream": {"schema": _STRING}}},
                      **_errors()}}},
}
