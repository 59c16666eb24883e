"""Chat requests with images and audio as model inputs for a vision model (mlx-vlm).

Media arrive in the ADD's `media` list as bytes (the front-end fetched and checked them:
the engine never does network I/O), each with a `placeholder` string that marks its place
in a message's content. Here the placeholders become the model's own image markers
(mlx-vlm's `apply_chat_template`), the bytes become decoded, EXIF-rotated RGB images, and
mlx-vlm's processor turns both into token ids and pixel arrays. Every problem with the
input is a 400 before the request is admitted, never an error on the model thread later.

All of it runs on the admission pool (`prepare_media_inputs`); on the mlx thread only when that could not
(a model loaded for the request meanwhile).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from engine_daemon.errors import RequestError, describe
from engine_daemon.models.loaded import LoadedModel
from engine_daemon.models.vision_support import VisionSupport
from engine_daemon.multimodal.media_decode import (  # noqa: F401 (decode_image, decode_audio: tests use them here)
    _checked_media,
    _media_error,
    decode_audio,
    decode_image,
    decode_media,
)
from engine_daemon.request.preprocess import model_key
from engine_daemon.request.prompt import rendered_tools
from engine_daemon.request.state import EngineRequest
from engine_daemon.request.template_kwargs import checked_template_kwargs

log = logging.getLogger(__name__)

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


def build_inputs(body: dict[str, Any], loaded: LoadedModel, decoded: list[Any] | None = None) -> VisionInputs:
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
    if tools := rendered_tools(body):
        kwargs["tools"] = tools
    try:
        prompt = apply_chat_template(support.processor, support.config, converted, num_images=len(image_order),
                                     num_audios=len(audio_order), **kwargs)
    except Exception as exc:  # jinja and mlx-vlm's formatters raise their own types
        raise RequestError(400, "invalid_messages", f"The chat template rejected the messages: {describe(exc)}",
                           param="messages") from None
    # Decoded on the admission pool (`prepare_media_inputs`), else here, with the same bounds.
    decoded = decoded if decoded is not None else decode_media(body, loaded)
    images = [decoded[i] for i in image_order] or None
    audio = [decoded[i] for i in audio_order] or None
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


def prepare_media_inputs(body: dict[str, Any], loaded: LoadedModel) -> VisionInputs:
    """A vision request's model inputs, built on the admission pool (`Preprocessor`), not the mlx thread.

    Why: the chat template, the processor's resize and normalisation of every image and the audio
    features all run on what a client sent; on the mlx thread they stopped every stream meanwhile.
    MLX streams are per thread (an array built lazily here cannot be evaluated on the mlx thread),
    so every array is evaluated here before it is handed on.
    """
    inputs = build_inputs(body, loaded, decode_media(body, loaded))
    arrays = [leaf for _, leaf in tree_flatten([inputs.input_ids, inputs.pixel_values, inputs.mask, inputs.extra])
              if isinstance(leaf, mx.array)]
    mx.eval(arrays)
    return inputs


def prepare(request: EngineRequest, loaded: LoadedModel) -> bool:
    """Admission of a request with media to a vision model: builds its inputs, then hands the rest on.

    The request's body becomes a token-id prompt (media dropped), so the shared admission
    (limits, sampling, stop strings, output parsing) runs on it exactly as on any request;
    the processed inputs wait on the request until it joins the batch. True when they were built here
    rather than on the admission pool.
    """
    prepared = request.prepared
    decoded = None
    if prepared is not None and prepared.model_key == model_key(loaded):
        if prepared.error is not None:
            raise prepared.error
        decoded = prepared.media
    # Built on the admission pool (`prepare_media_inputs`), else here from the media decoded there (or not).
    built_here = not isinstance(decoded, VisionInputs)
    inputs = build_inputs(request.body, loaded, decoded) if built_here else decoded
    setattr(request, _INPUTS_ATTR, inputs)
    request.body = {**request.body, "messages": None, "media": None,
                    "prompt": [int(t) for t in inputs.input_ids[0].tolist()]}
    return built_here


def take_inputs(request: EngineRequest) -> VisionInputs:
    """The inputs `prepare` built (released from the request: pixels are not kept while it decodes),
    or text-only inputs from the request's prompt tokens."""
    inputs = getattr(request, _INPUTS_ATTR, None)
    if inputs is None:
        return VisionInputs(input_ids=mx.array([request.prompt_tokens]))
    setattr(request, _INPUTS_ATTR, None)
    return inputs


