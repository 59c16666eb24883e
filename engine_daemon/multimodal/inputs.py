"""Vision (and audio) models through mlx-vlm: loading, and chat requests with images as model inputs.

A model whose config.json has a vision (or audio) tower is loaded with `mlx_vlm.load`
together with its processor; text models keep the mlx-lm path. Media arrive in the ADD's
`media` list as bytes (the front-end fetched and checked them: the engine never does
network I/O), each with a `placeholder` string that marks its place in a message's content.
Here the placeholders become the model's own image markers (mlx-vlm's
`apply_chat_template`), the bytes become decoded, EXIF-rotated RGB images, and mlx-vlm's
processor turns both into token ids and pixel arrays. Every problem with the input is a
400 before the request is admitted, never an error on the model thread later.

The projected image features are cached by content hash (`FeatureCache`): the same image
in the next turn of a conversation is not run through the vision tower again.

Everything here runs on the mlx thread.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from engine_daemon.models.manager import LoadedModel, _kv_bytes_per_token, _read_generation_defaults
from engine_daemon.models.store import ModelRef, context_window_of_config, model_kind
from engine_daemon.request.admission import EngineRequest, RequestError

log = logging.getLogger(__name__)

# Pillow format names a request may send (what the front-end admits too).
IMAGE_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"})  # MPO: phone cameras' JPEGs
AUDIO_FORMATS = frozenset({"wav", "mp3"})
# Decoded pixels per image: larger is refused before decoding (a decompression bomb guard).
MAX_IMAGE_PIXELS = 50_000_000
# Largest `resize_shape` side (mlx-vlm accepts any int; a huge one would only waste memory).
MAX_RESIZE_SIDE = 8192
# Images whose projected features stay cached (per loaded model; freed with it).
FEATURE_CACHE_SIZE = 64
# Where a prepared request keeps its model inputs until it joins the batch.
_INPUTS_ATTR = "vision_inputs"


@dataclass
class VisionInputs:
    """A request's processed multimodal inputs: what `get_input_embeddings` takes."""

    input_ids: mx.array  # [1, prompt length], image markers expanded
    pixel_values: mx.array | None = None
    mask: mx.array | None = None
    # model-specific processor outputs (image_grid_thw, input_features...)
    extra: dict[str, Any] = field(default_factory=dict)
    # one content hash per image, in prompt order (keys of the feature cache)
    image_keys: list[str] = field(default_factory=list)


class FeatureCache:
    """LRU of projected image features keyed by content hash (+ resize), for one loaded model."""

    def __init__(self, size: int = FEATURE_CACHE_SIZE):
        self.size = size
        self._entries: OrderedDict[str, mx.array] = OrderedDict()
        self.hits = 0
        self.encoded = 0

    def get(self, key: str) -> mx.array | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: str, value: mx.array) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        self.encoded += 1
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


# Per-image vision encoders, by model_type: (model, pixel rows of one image, its grid) -> features.
# An architecture listed here gets per-image feature caching (mlx-vlm's `cached_image_features`
# input); any other still works, its images are simply encoded on every request.
def _qwen_vl_encoder(model: Any, pixel_values: mx.array, grid_thw: mx.array) -> mx.array:
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    return model.vision_tower(pixel_values.astype(dtype), grid_thw, output_hidden_states=False)


FEATURE_ENCODERS: dict[str, Callable[[Any, mx.array, mx.array], mx.array]] = {
    "qwen2_vl": _qwen_vl_encoder,
    "qwen2_5_vl": _qwen_vl_encoder,
}


@dataclass
class VisionSupport:
    """What a vision model needs beyond a text model: its processor, capabilities, feature cache."""

    processor: Any
    config: Any  # the mlx-vlm model config object
    model_type: str
    accepts_images: bool
    accepts_audio: bool
    features: FeatureCache = field(default_factory=FeatureCache)

    def stats(self) -> dict[str, int]:
        return {"vision_images_encoded": self.features.encoded, "vision_feature_cache_hits": self.features.hits,
                "vision_feature_cache_entries": len(self.features)}


# -- loading ---------------------------------------------------------------------------------
class _ProcessorKwargsNoise(logging.Filter):
    """Drops transformers' per-request warning about the template kwargs mlx-vlm passes (harmless)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "have to be in `processor_kwargs`" not in record.getMessage()


_NOISE_FILTER = _ProcessorKwargsNoise()


def _accepts_audio(config: dict[str, Any], model: Any) -> bool:
    return bool(config.get("audio_config")) or any(
        getattr(model, name, None) is not None for name in ("audio_tower", "audio_model", "audio_encoder"))


def load_vision_model(ref: ModelRef, trust_remote_code: bool = False) -> LoadedModel:
    """Loads `ref` with `mlx_vlm.load` (model + processor) as a LoadedModel of kind vision/audio.

    `LoadedModel.tokenizer` is mlx-lm's TokenizerWrapper over the same tokenizer files, so
    everything the text path does with a tokenizer (stop/EOS handling, streaming
    detokenizer, output parsing, /tokenize) works unchanged for vision models.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm import load as mlx_vlm_load

    config = json.loads((ref.path / "config.json").read_text())
    kind = model_kind(ref.path)
    logging.getLogger("transformers.processing_utils").addFilter(_NOISE_FILTER)  # idempotent
    model, processor = mlx_vlm_load(str(ref.path), trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(Path(ref.path), eos_token_ids=config.get("eos_token_id"))
    # Text exactly as mlx-vlm writes it (mlx_vlm.generate / mlx_vlm.server): its streaming
    # detokenizer keeps the first token's leading space, which mlx-lm's trims.
    detokenizer = getattr(processor, "detokenizer", None)
    if detokenizer is not None and hasattr(tokenizer, "_detokenizer"):
        tokenizer._detokenizer = detokenizer
    parameters = [p for _, p in tree_flatten(model.parameters())]
    itemsize = max((p.dtype.size for p in parameters if mx.issubdtype(p.dtype, mx.floating)), default=2)
    text_config = {**config, **(config.get("text_config") or {})}
    support = VisionSupport(processor=processor, config=model.config, model_type=config.get("model_type", ""),
                            accepts_images=bool(config.get("vision_config")),
                            accepts_audio=_accepts_audio(config, model))
    if support.model_type not in FEATURE_ENCODERS:
        log.info("model type %s: no per-image feature cache (images are encoded on every request)",
                 support.model_type)
    return LoadedModel(
        ref=ref, model=model, tokenizer=tokenizer, context_window=context_window_of_config(config),
        vocab_size=int(text_config.get("vocab_size") or 0),
        weights_bytes=sum(p.nbytes for p in parameters),
        kv_bytes_per_token=_kv_bytes_per_token(config, itemsize),
        generation_defaults=_read_generation_defaults(ref.path), kind=kind, vision=support)


# -- admission -------------------------------------------------------------------------------
def _media_error(message: str, code: str = "invalid_media", param: str | None = "messages") -> RequestError:
    return RequestError(400, code, message, param=param)


def _checked_media(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ADD's media list, shape-checked (the codec only knows it is a list)."""
    media = body.get("media") or []
    for index, item in enumerate(media):
        if (not isinstance(item, dict) or item.get("type") not in ("image", "audio")
                or not isinstance(item.get("data"), bytes) or not isinstance(item.get("placeholder"), str)
                or not item["placeholder"]):
            raise _media_error(f"media[{index}] must be a map with type 'image' or 'audio', bytes 'data' and a "
                               "'placeholder' string")
    return media


def check_media_allowed(body: dict[str, Any], loaded: LoadedModel) -> None:
    """400 when a request sends images or audio that the loaded model cannot take."""
    media = _checked_media(body)
    kinds = {item["type"] for item in media}
    support: VisionSupport | None = loaded.vision
    if "image" in kinds and (support is None or not support.accepts_images):
        raise _media_error(f"Model '{loaded.ref.id}' is a text-only model and cannot take images; "
                           "send images to a vision model", code="images_not_supported")
    if "audio" in kinds and (support is None or not support.accepts_audio):
        raise _media_error(f"Model '{loaded.ref.id}' has no audio encoder and cannot take input_audio parts",
                           code="audio_not_supported")


def resize_shape_of(item: dict[str, Any]) -> tuple[int, int] | None:
    """mlx-vlm's `resize_shape`: [size] or [height, width], normalised to a pair; None when absent."""
    value = item.get("resize_shape")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) not in (1, 2)
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_RESIZE_SIDE for v in value)):
        raise _media_error(f"'resize_shape' must be [size] or [height, width] with sides in 1..{MAX_RESIZE_SIDE}",
                           param="resize_shape")
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])


def decode_image(item: dict[str, Any], index: int) -> Any:
    """The item's bytes as an RGB PIL image, EXIF orientation applied, resized when asked."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    resize = resize_shape_of(item)
    try:
        image = Image.open(io.BytesIO(item["data"]))
        if image.format not in IMAGE_FORMATS:
            raise _media_error(f"Image {index + 1} is {image.format or 'of an unknown format'}; supported formats "
                               f"are {', '.join(sorted(IMAGE_FORMATS))}", code="unsupported_image_format")
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise _media_error(f"Image {index + 1} has {image.width}x{image.height} pixels, more than "
                               f"{MAX_IMAGE_PIXELS}", code="image_too_large")
        image = ImageOps.exif_transpose(image).convert("RGB")  # convert() decodes every pixel
    except RequestError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _media_error(f"Image {index + 1} could not be decoded: {exc}", code="invalid_image") from None
    if resize is not None:
        from mlx_vlm.utils import resize_image

        image = resize_image(image, resize)  # exactly what mlx_vlm.server does with resize_shape
    return image


def decode_audio(item: dict[str, Any], index: int, sample_rate: int) -> Any:
    """The item's wav/mp3 bytes as mono float32 samples at the processor's rate."""
    from mlx_vlm.utils import load_audio

    if item.get("format") not in AUDIO_FORMATS:
        raise _media_error(f"Audio {index + 1} must be one of {sorted(AUDIO_FORMATS)}", code="unsupported_audio_format")
    try:
        return load_audio(io.BytesIO(item["data"]), sr=sample_rate)
    except Exception as exc:  # decoders raise their own exception types
        raise _media_error(f"Audio {index + 1} could not be decoded: {exc}", code="invalid_audio") from None


def _image_key(item: dict[str, Any]) -> str:
    resize = item.get("resize_shape") or []
    return "sha256:" + hashlib.sha256(item["data"]).hexdigest() + ":" + "x".join(map(str, resize))


def _split_messages(messages: list[dict[str, Any]], media: list[dict[str, Any]]
                    ) -> tuple[list[dict[str, Any]], list[int], list[int]]:
    """Messages with placeholders turned into ordered text/image parts; image and audio item order."""
    by_placeholder = {item["placeholder"]: index for index, item in enumerate(media)}
    pattern = re.compile("|".join(re.escape(p) for p in sorted(by_placeholder, key=len, reverse=True)))
    images: list[int] = []
    audios: list[int] = []
    converted = []
    for position, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str) or not pattern.search(content):
            converted.append(message)
            continue
        if message.get("role") != "user":
            raise _media_error(f"messages.[{position}]: images and audio are only supported in user messages",
                               param=f"messages.[{position}].content")
        parts: list[dict[str, Any]] = []
        start = 0
        for match in pattern.finditer(content):
            if match.start() > start:
                parts.append({"type": "text", "text": content[start:match.start()]})
            index = by_placeholder[match.group()]
            if index in images or index in audios:
                raise _media_error(f"media[{index}] is referenced twice")
            if media[index]["type"] == "image":
                parts.append({"type": "image"})
                images.append(index)
            else:
                audios.append(index)  # mlx-vlm places audio markers itself (on the last user turn)
            start = match.end()
        if start < len(content):
            parts.append({"type": "text", "text": content[start:]})
        converted.append({**message, "content": parts})
    unused = set(range(len(media))) - set(images) - set(audios)
    if unused:
        raise _media_error(f"media[{min(unused)}] is not referenced by any message")
    return converted, images, audios


def build_inputs(body: dict[str, Any], loaded: LoadedModel) -> VisionInputs:
    """Prompt + media of a chat request as mlx-vlm model inputs (400 on anything unusable)."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    support: VisionSupport = loaded.vision
    media = _checked_media(body)
    messages = body.get("messages")
    if messages is None:
        raise _media_error("Images and audio need chat 'messages'", param="prompt")
    converted, image_order, audio_order = _split_messages(messages, media)
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("tools") and body.get("tool_choice") != "none":
        kwargs["tools"] = body["tools"]
    try:
        prompt = apply_chat_template(support.processor, support.config, converted, num_images=len(image_order),
                                     num_audios=len(audio_order), **kwargs)
    except Exception as exc:  # jinja and mlx-vlm's formatters raise their own types
        raise RequestError(400, "invalid_messages", f"The chat template rejected the messages: {exc}",
                           param="messages") from None
    images = [decode_image(media[i], n) for n, i in enumerate(image_order)] or None
    audio = None
    if audio_order:
        extractor = getattr(support.processor, "feature_extractor", None)
        rate = getattr(extractor, "sampling_rate", 16000)
        audio = [decode_audio(media[i], n, rate) for n, i in enumerate(audio_order)]
    try:
        inputs = prepare_inputs(
            support.processor, images=images, audio=audio, prompts=prompt,
            image_token_index=getattr(support.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(support.model_type, support.processor))
    except Exception as exc:  # the processor's own validation (sizes, counts)
        raise _media_error(f"The model's processor rejected the input: {exc}") from None
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    return VisionInputs(input_ids=inputs["input_ids"], pixel_values=inputs.get("pixel_values"),
                        mask=inputs.get("attention_mask"), extra=extra,
                        image_keys=[_image_key(media[i]) for i in image_order])


def prepare(request: EngineRequest, loaded: LoadedModel) -> None:
    """Admission of a request with media to a vision model: builds its inputs, then hands the rest on.

    The request's body becomes a token-id prompt (media dropped), so the shared admission
    (limits, sampling, stop strings, output parsing) runs on it exactly as on any request;
    the processed inputs wait on the request until it joins the batch.
    """
    inputs = build_inputs(request.body, loaded)
    setattr(request, _INPUTS_ATTR, inputs)
    request.body = {**request.body, "messages": None, "media": None,
                    "prompt": [int(t) for t in inputs.input_ids[0].tolist()]}


def take_inputs(request: EngineRequest) -> VisionInputs:
    """The inputs `prepare` built (released from the request: pixels are not kept while it decodes),
    or text-only inputs from the request's prompt tokens."""
    inputs = getattr(request, _INPUTS_ATTR, None)
    if inputs is None:
        return VisionInputs(input_ids=mx.array([request.prompt_tokens]))
    setattr(request, _INPUTS_ATTR, None)
    return inputs


def image_features(model: Any, support: VisionSupport, inputs: VisionInputs) -> mx.array | None:
    """Projected features of the request's images, reusing cached ones; None when not cacheable."""
    encoder = FEATURE_ENCODERS.get(support.model_type)
    grid = inputs.extra.get("image_grid_thw")
    if encoder is None or inputs.pixel_values is None or grid is None or grid.shape[0] != len(inputs.image_keys):
        return None
    rows = [int(t) * int(h) * int(w) for t, h, w in grid.tolist()]
    features, start = [], 0
    for index, key in enumerate(inputs.image_keys):
        cached = support.features.get(key)
        if cached is None:
            cached = encoder(model, inputs.pixel_values[start:start + rows[index]], grid[index:index + 1])
            mx.eval(cached)
            support.features.put(key, cached)
        features.append(cached)
        start += rows[index]
    return features[0] if len(features) == 1 else mx.concatenate(features, axis=0)


def cache_stats(loaded: LoadedModel | None) -> dict[str, int]:
    support = loaded.vision if loaded is not None else None
    return support.stats() if support is not None else {}
