"""Chat requests with images and audio as model inputs for a vision model (mlx-vlm).

Media arrive in the ADD's `media` list as bytes (the front-end fetched and checked them:
the engine never does network I/O), each with a `placeholder` string that marks its place
in a message's content. Here the placeholders become the model's own image markers
(mlx-vlm's `apply_chat_template`), the bytes become decoded, EXIF-rotated RGB images, and
mlx-vlm's processor turns both into token ids and pixel arrays. Every problem with the
input is a 400 before the request is admitted, never an error on the model thread later.

Everything here runs on the mlx thread.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine_daemon.errors import RequestError, describe
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.vision_support import VisionSupport
from engine_daemon.request.prompt import template_tools
from engine_daemon.request.state import EngineRequest
from engine_daemon.request.template_kwargs import checked_template_kwargs

log = logging.getLogger(__name__)

# Pillow format names a request may send (what the front-end admits too).
IMAGE_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"})  # MPO: phone cameras' JPEGs
AUDIO_FORMATS = frozenset({"wav", "mp3"})
# Decoded pixels per image: larger is refused before decoding (a decompression bomb guard).
MAX_IMAGE_PIXELS = 50_000_000
# Largest `resize_shape` side (mlx-vlm accepts any int; a huge one would only waste memory).
MAX_RESIZE_SIDE = 8192
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
    # content hashes of every image and audio clip, in prompt order: what the prompt's KV depends on
    # besides its token ids (the placeholders are the same tokens for every image)
    media_keys: list[str] = field(default_factory=list)


# -- loading ---------------------------------------------------------------------------------
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
        raise _media_error(f"Image {index + 1} could not be decoded: {describe(exc)}", code="invalid_image") from None
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
        raise _media_error(f"Audio {index + 1} could not be decoded: {describe(exc)}", code="invalid_audio") from None


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
    kwargs = checked_template_kwargs(body.get("chat_template_kwargs"))
    if "chat_template" in kwargs:
        raise RequestError(400, "unsupported_value", "A request's own chat template is not supported for vision "
                           "models", param="chat_template_kwargs")
    if tools := template_tools(body):
        kwargs["tools"] = tools
    try:
        prompt = apply_chat_template(support.processor, support.config, converted, num_images=len(image_order),
                                     num_audios=len(audio_order), **kwargs)
    except Exception as exc:  # jinja and mlx-vlm's formatters raise their own types
        raise RequestError(400, "invalid_messages", f"The chat template rejected the messages: {describe(exc)}",
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
        raise _media_error(f"The model's processor rejected the input: {describe(exc)}") from None
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    return VisionInputs(input_ids=inputs["input_ids"], pixel_values=inputs.get("pixel_values"),
                        mask=inputs.get("attention_mask"), extra=extra,
                        image_keys=[_image_key(media[i]) for i in image_order],
                        media_keys=[f"image:{_image_key(media[i])}" for i in image_order]
                        + [f"audio:{_image_key(media[i])}" for i in audio_order])


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


