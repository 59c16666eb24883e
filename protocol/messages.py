"""Message types, their body schemas and the request-id rules.

Every body is a msgpack map. The schema of each type lists its top-level fields
with the Python types allowed and whether the field is required; `codec.decode`
checks them so a malformed frame never reaches the engine's model thread.
"""

from __future__ import annotations

import enum
import uuid
from typing import Any

# Bump on any incompatible change. A HELLO with another version is refused.
PROTOCOL_VERSION = 1

# Frames larger than this are refused before msgpack decodes them.
MAX_FRAME_BYTES = 32 * 1024 * 1024

# Request and call ids, front-end ids and host names longer than this are refused: the engine writes them
# into its log lines (a 1 MB request id made every line of that request 1 MB).
MAX_ID_CHARS = 256
ID_FIELDS = {"rid", "cid", "frontend_id", "host"}


class MsgType(enum.IntEnum):
    """The first byte of every frame: dispatch happens on it before decoding."""

    # front-end -> engine
    HELLO = 1
    PING = 2
    ADD = 3
    ABORT = 4
    CALL = 5
    BYE = 6
    # engine -> front-end
    WELCOME = 16
    PONG = 17
    ACCEPTED = 18
    DELTAS = 19
    ERROR = 20
    RESULT = 21


class CallMethod(str, enum.Enum):
    """The `method` of a CALL: every request/reply operation a front-end may ask of the engine.

    A `str` enum so the wire carries the plain name (`CallMethod.STATS == "stats"`); the
    engine answers a name outside this list with 400 `unknown_method`.
    """

    STATUS = "status"
    LIST_MODELS = "list_models"
    STATS = "stats"
    UNLOAD = "unload"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    # {"model": name} -> {"id", "loaded", "kind", "context_window"}: the model a request naming it would run on
    # (aliases, patterns, spellings of a path, --model-fallback), never loading or downloading; 404/400 as there.
    RESOLVE_MODEL = "resolve_model"
    ADAPTERS_LIST = "adapters.list"
    ADAPTERS_ADD = "adapters.add"
    ADAPTERS_REMOVE = "adapters.remove"
    RESPONSES_PUT = "responses.put"
    RESPONSES_GET = "responses.get"
    RESPONSES_DELETE = "responses.delete"
    # Auxiliary models (embedding, transcription, speech slots beside the chat model): args and
    # result are documented at `AUXILIARY_CALLS`. The audio ones are long CALLs: partial RESULTs,
    # then the final one.
    EMBEDDINGS = "embeddings"
    TRANSCRIBE = "audio.transcribe"
    SPEECH = "audio.speech"
    # {"count": steps timed so far, "gaps_ms": the last <= 4096 gaps between decode steps}: the engine's own ITL
    STEP_GAPS = "step_gaps"
    DRAIN = "drain"  # {"draining": bool}: PONGs say "draining", routers send no new work (rolling restarts)
    DEBUG_SLEEP = "debug_sleep"  # fault injection (tests only): wedges the mlx thread
    DEBUG_CRASH = "debug_crash"  # fault injection (tests only): kills the mlx thread


# The auxiliary CALLs' args and results. Arrays travel as raw little-endian float32 `bytes`
# (a msgpack list of floats is several times slower to pack and unpack).
# An ABORT whose `rids` holds a CALL's `cid` drops that auxiliary job (its client left).
AUXILIARY_CALLS = {
    CallMethod.EMBEDDINGS: {
        # input: a list of strings or a list of token-id lists (never mixed); dimensions: Matryoshka size or None
        "args": {"model": "str | None", "input": "list[str] | list[list[int]]", "dimensions": "int | None"},
        # data: one float32 vector per input, in order; model: the name that served it
        "result": {"model": "str", "data": "list[bytes]", "dimensions": "int", "prompt_tokens": "int"},
    },
    CallMethod.TRANSCRIBE: {
        # audio: 16 kHz mono float32; task: "transcribe" | "translate"; temperature None: Whisper's fallback
        # schedule; timestamps: decode with timestamp tokens (segments); stream: send each window's segments
        "args": {"model": "str", "audio": "bytes", "task": "str", "language": "str | None", "prompt": "str | None",
                 "temperature": "float | None", "timestamps": "bool", "word_timestamps": "bool", "stream": "bool"},
        # partial (stream only): {"delta": str, "segments": [segment]} per window
        "result": {"model": "str", "text": "str", "language": "str", "language_name": "str", "duration": "float",
                   "segments": "list[{id, seek, start, end, text, tokens, temperature, avg_logprob, "
                               "compression_ratio, no_speech_prob, words?}]"},
    },
    CallMethod.SPEECH: {
        "args": {"model": "str", "input": "str", "voice": "str | None", "instructions": "str | None"},
        # partials: {"audio": bytes (float32 mono), "sample_rate": int}, one per synthesized segment
        "result": {"model": "str", "sample_rate": "int", "samples": "int"},
    },
}

FRONTEND_TO_ENGINE = frozenset(
    {MsgType.HELLO, MsgType.PING, MsgType.ADD, MsgType.ABORT, MsgType.CALL, MsgType.BYE}
)
ENGINE_TO_FRONTEND = frozenset(MsgType) - FRONTEND_TO_ENGINE

NUMBER = (int, float)
NONE = type(None)

# A function tool's `strict` in an ADD: `true` is OpenAI's (every object that lists `properties` is closed and
# requires each of them), STRICT_CLOSED Anthropic's (objects closed, `required` as the schema writes it: a property
# left out of it stays optional). Either way the engine holds a constrained call to the schema so read.
STRICT_CLOSED = "closed"

# field -> (allowed types, required)
Schema = dict[str, tuple[tuple[type, ...], bool]]

SCHEMAS: dict[MsgType, Schema] = {
    MsgType.HELLO: {
        "version": ((int,), True),
        "frontend_id": ((str,), True),
        "pid": ((int,), False),
        "host": ((str,), False),
    },
    # rx: bytes of frames this front-end has read from the engine since it connected. A peer that leaves more
    # than the engine's --peer-max-queued unread has its requests aborted; one whose PINGs carry no rx is
    # counted as having read nothing.
    MsgType.PING: {"t": (NUMBER, False), "rx": ((int,), False)},
    MsgType.ADD: {
        "rid": ((str,), True),
        "epoch": ((int, NONE), False),
        "model": ((str, NONE), False),
        "adapter": ((str, NONE), False),
        # Who asked (a digest of the API key, else the `user` field): decode slots are shared fairly between clients.
        "client": ((str, NONE), False),
        "messages": ((list, NONE), False),
        # A string, token ids, or token ids packed as little-endian uint32 (`protocol.token_ids`; only to an
        # engine whose WELCOME lists that feature)
        "prompt": ((str, list, bytes, NONE), False),
        "params": ((dict,), True),
        "chat_template_kwargs": ((dict, NONE), False),
        "deadline": ((NUMBER, NONE), False),
        # OpenAI chat-format function tools: [{"type": "function", "function": {name, description, parameters,
        # strict (true | STRICT_CLOSED)}}]
        "tools": ((list, NONE), False),
        # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
        "tool_choice": ((str, dict, NONE), False),
        "parallel_tool_calls": ((bool, NONE), False),
        # {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
        "response_format": ((dict, NONE), False),
        # Images / audio for vision models: [{"type": "image"|"audio", "data": bytes, ...}]
        "media": ((list, NONE), False),
        # This request's own context-overflow mode, over its model's: "truncate" | "error" (Responses `truncation`)
        "context_overflow": ((str, NONE), False),
    },
    MsgType.ABORT: {"rids": ((list,), True), "reason": ((str,), False)},
    MsgType.CALL: {
        "cid": ((str,), True),
        "method": ((str,), True),
        "args": ((dict,), False),
    },
    MsgType.BYE: {},
    MsgType.WELCOME: {
        "version": ((int,), True),
        "epoch": ((int,), True),
        "state": ((str,), True),
        "model": ((str, NONE), False),
        "adapter": ((str, NONE), False),
        "started_at": (NUMBER, False),
        "pid": ((int,), False),
        # An engine group's rank 0: {"mode", "size", "backend", "ranks": [{"rank", "weights_bytes", ...}], ...}
        "group": ((dict, NONE), False),
        # What this engine reads beyond the version's baseline, e.g. `protocol.token_ids.FEATURE`: a front-end
        # uses a feature only with an engine that lists it, so either side may be upgraded first.
        "features": ((list, NONE), False),
    },
    MsgType.PONG: {
        "epoch": ((int,), True),
        "state": ((str,), True),
        "queued": ((int,), False),
        "running": ((int,), False),
        "model": ((str, NONE), False),  # the loaded model: routers prefer engines that serve the one asked for
        "t": (NUMBER, False),
    },
    MsgType.ACCEPTED: {
        "rid": ((str,), True),
        "prompt_tokens": ((int,), True),
        "cached_tokens": ((int,), False),
        "model": ((str,), False),
        # Set when older turns made way for the window: {"mode": "truncated"|"summarized", "dropped_messages": n}
        "context_overflow": ((dict, NONE), False),
    },
    MsgType.DELTAS: {"items": ((list,), True)},
    MsgType.ERROR: {
        "rid": ((str, NONE), False),
        "cid": ((str, NONE), False),
        "status": ((int,), True),
        "code": ((str,), True),
        "message": ((str,), True),
        "type": ((str,), False),
        "param": ((str, NONE), False),
    },
    # `partial`: one of several RESULTs of a long CALL (audio.transcribe / audio.speech: a transcript
    # segment, a piece of audio); the call stays open until the RESULT without it.
    MsgType.RESULT: {"cid": ((str,), True), "result": ((object,), False), "partial": ((bool,), False)},
}

# Sampling and limit fields an ADD may carry in `params`, with their types.
PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "max_tokens": (int, NONE),
    "temperature": NUMBER + (NONE,),
    "top_p": NUMBER + (NONE,),
    "top_k": (int, NONE),
    "min_p": NUMBER + (NONE,),
    "repetition_penalty": NUMBER + (NONE,),
    "seed": (int, NONE),
    "stop": (list, NONE),
    "ignore_eos": (bool, NONE),
    "presence_penalty": NUMBER + (NONE,),
    "frequency_penalty": NUMBER + (NONE,),
    "logit_bias": (dict, NONE),  # {"<token id>": bias}
    "logprobs": (bool, NONE),
    "top_logprobs": (int, NONE),
    "thinking_budget": (int, NONE),
    "min_tokens": (int, NONE),  # no EOS before this many tokens (vLLM's)
    # The prompt's own logprobs, with this many alternatives per token (`PROMPT_LOGPROBS`); then max_tokens may be 0
    "prompt_logprobs": (int, NONE),
}

# One item of a DELTAS message (documented here; the front-end reads these keys).
# `text` is answer text; `reasoning` is text inside the model's thinking block; `tool_calls`
# holds complete parsed calls: [{"index", "id", "name", "arguments" (a JSON string)}]; a call cut by
# max_tokens comes with `"partial": true` and its arguments as far as they got (not valid JSON).
# `tool_call_deltas` streams the call being written: [{"index", "arguments" (the next piece)}], the first
# piece of a call with its "id" and "name"; its complete `tool_calls` entry (same index and id) comes
# later, its arguments starting with the pieces. A reader that ignores the key still gets every call whole.
# `stop_sequence` on the last item names the stop string that ended the request, if one did.
# `prompt_logprobs` (a request that asked for them): the next prompt tokens' entries, in order, before any text;
# the prompt's first token has a null `logprob` and `top_logprobs` (nothing predicts it).
DELTA_ITEM_KEYS = ("rid", "seq", "text", "reasoning", "tool_calls", "tool_call_deltas", "token_ids", "logprobs",
                   "finish_reason", "stop_sequence", "usage", "prompt_logprobs")

# In WELCOME `features`: the engine reads the `prompt_logprobs` param (a front-end asks no engine without it).
PROMPT_LOGPROBS = "prompt_logprobs"

# Engine states reported in WELCOME / PONG.
ENGINE_STATES = ("idle", "loading", "ready", "stalled", "draining")


def new_request_id(frontend_id: str) -> str:
    """Request ids are `<frontend-id>:<uuid>` so the engine can tell owners apart."""
    return f"{frontend_id}:{uuid.uuid4().hex}"


def request_id_owner(rid: str) -> str:
    """The front-end id part of a request id ('' when the id has no owner part)."""
    owner, sep, _ = rid.partition(":")
    return owner if sep else ""


def check_fields(body: dict[str, Any], schema: Schema) -> str | None:
    """Returns a description of the first schema violation, or None when valid."""
    for name, (types, required) in schema.items():
        if name not in body:
            if required:
                return f"missing field '{name}'"
            continue
        value = body[name]
        if object in types:
            continue
        # bool is an int subclass: never accept it where a number is meant.
        if isinstance(value, bool) and bool not in types:
            return f"field '{name}' has wrong type bool"
        if not isinstance(value, types):
            return f"field '{name}' has wrong type {type(value).__name__}"
    return None
