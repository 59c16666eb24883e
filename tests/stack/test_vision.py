"""Vision models through the real stack: openai SDK -> gunicorn -> engined -> mlx-vlm.

One engine serves a --model-dir holding a tiny random-weight Qwen2-VL (model_builders/vlm.py,
loaded by the real `mlx_vlm.load`) and a tiny text model; requests switch between them with
`model`. Images come as data: URLs and as http URLs of a local HTTP server. Greedy output of
the server is compared with `mlx_vlm.generate` in this process for the same image and prompt.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import http.server
import io
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from PIL import Image

from http_frontend.errors import APIError
from http_frontend.parsing.media import MediaCollector, is_public_address
from http_frontend.settings import FrontendSettings
from protocol import MsgType, decode, encode
from tests.helpers import Engine, Frontend, call_engine, data_url, png

VLM = "tiny-qwen2-vl"
TEXT = "tiny-qwen2"
PROMPT = "Describe this image."
MAX_IMAGE_BYTES = 200_000


IMAGE = png(2)
OTHER_IMAGE = png(5)
ZEROS_GZIP = gzip.compress(bytes(100 << 20), compresslevel=9)


# -- fixtures ---------------------------------------------------------------------------------
class _Images(http.server.BaseHTTPRequestHandler):
    """Local image server: a good image, a slow one, a too-big one, a non-image, redirects."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/image.png":
            self._send(200, "image/png", IMAGE)
        elif self.path == "/slow.png":
            time.sleep(4)
            self._send(200, "image/png", IMAGE)
        elif self.path == "/big.png":
            self._send(200, "image/png", png(7, 400, 400))  # ~480 KB of noise: over the 200 KB cap
        elif self.path == "/page.html":
            self._send(200, "text/html", b"<html></html>")
        elif self.path == "/redirect":
            self._redirect("/image.png")
        elif self.path == "/to-file":
            self._redirect("file:///etc/passwd")
        elif self.path == "/short.png":  # promises 100 KB, sends 10 bytes, hangs up
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(IMAGE[:10])
            self.close_connection = True
        elif self.path == "/bad-chunks.png":  # chunked, then a chunk size that is not hex
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"a\r\n" + IMAGE[:10] + b"\r\nzz\r\n" + IMAGE[10:40] + b"\r\n0\r\n\r\n")
            self.close_connection = True
        elif self.path == "/deflated.png":  # ~100 KB on the wire, 100 MB inflated: compressed whatever was asked
            _Images.accept_encodings.append(self.headers.get("Accept-Encoding"))
            self._send(200, "image/png", ZEROS_GZIP, {"Content-Encoding": "gzip"})
        else:
            self._send(404, "text/plain", b"not found")

    accept_encodings: list[str | None] = []

    def _send(self, status: int, content_type: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the front-end gave up (timeout, byte cap): expected

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_builders.text import build_model
    from model_builders.vlm import build_vlm

    root = tmp_path_factory.mktemp("vision-models")
    build_vlm(root / VLM, seed=1)
    build_model(root / TEXT, size="tiny", seed=0)
    return root


@pytest.fixture(scope="module")
def stack(model_dir: Path, ipc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frontend]:
    logs = tmp_path_factory.mktemp("vision-logs")
    # Fault injection: the batching test holds the mlx thread (debug_sleep) while its requests arrive.
    engine = Engine(f"ipc://{ipc_dir}/vision.sock", logs / "engined.log", args=["--model-dir", str(model_dir)],
                    env={"MLX_ENGINE_FAULT_INJECTION": "1"})
    frontend = Frontend(engine.endpoint, logs / "frontend.log", workers=2,
                        args=["--allow-private-image-urls", "--image-fetch-timeout", "1.5",
                              "--max-image-bytes", str(MAX_IMAGE_BYTES)])
    try:
        engine.wait_ready(model_loaded=False)
        frontend.wait_healthy()
        frontend.engine = engine  # type: ignore[attr-defined]
        yield frontend
    finally:
        frontend.stop()
        engine.stop()


@pytest.fixture(scope="module")
def client(stack: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    """mlx_vlm.generate in this process: greedy text for IMAGE and PROMPT (16 tokens)."""
    from mlx_vlm import apply_chat_template, generate, load

    model, processor = load(str(model_dir / VLM))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    out = generate(model, processor, prompt, image=[Image.open(io.BytesIO(IMAGE))], max_tokens=16, temperature=0.0)
    # The comparison is on text: make sure it is the plain decode of the tokens (no split UTF-8 at the end).
    assert out.text == processor.tokenizer.decode(out.token_ids)
    return {"text": out.text, "prompt_tokens": out.prompt_tokens, "tokens": out.generation_tokens}


def image_chat(client: openai.OpenAI, url: str, *, model: str = VLM, max_tokens: int = 16, temperature: float = 0,
               **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=temperature,
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                               {"type": "image_url", "image_url": {"url": url}}]}],
        **extra)


def stats(frontend: Frontend) -> dict[str, Any]:
    return httpx.get(f"{frontend.base_url}/stats", timeout=10).json()


def expect_400(call: Any, code: str) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert caught.value.status_code == 400 and error["code"] == code, error
    return error


# -- the vision path end to end ------------------------------------------------------------------
def test_data_url_image_matches_mlx_vlm_generate(client: openai.OpenAI, stack: Frontend,
                                                 reference: dict[str, Any]) -> None:
    result = image_chat(client, data_url(IMAGE))
    assert result.choices[0].message.content == reference["text"]
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == reference["prompt_tokens"]
    assert result.usage.completion_tokens == reference["tokens"] == 16

    chunks = list(client.chat.completions.create(
        model=VLM, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                               {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}]}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].usage.prompt_tokens == reference["prompt_tokens"]

    # Logprobs line up with the tokens: greedy picks the most likely token every time.
    with_logprobs = image_chat(client, data_url(IMAGE), logprobs=True, top_logprobs=2)
    entries = with_logprobs.choices[0].logprobs.content
    assert with_logprobs.choices[0].message.content == reference["text"] and len(entries) == 16
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)

    # The image really steers the output: another image, another answer.
    assert image_chat(client, data_url(OTHER_IMAGE)).choices[0].message.content != reference["text"]
    health = httpx.get(f"{stack.base_url}/health").json()
    assert health["loaded_model"] == VLM and health["loaded_model_kind"] == "vision"


def test_same_image_is_not_encoded_again(client: openai.OpenAI, stack: Frontend,
                                         reference: dict[str, Any]) -> None:
    image = data_url(png(11))
    first = image_chat(client, image).choices[0].message.content
    before = stats(stack)
    # Next turn of the conversation about the same image: the vision tower is not run again.
    second = client.chat.completions.create(
        model=VLM, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT},
                                               {"type": "image_url", "image_url": {"url": image}}]},
                  {"role": "assistant", "content": first},
                  {"role": "user", "content": "And the colours?"}])
    after = stats(stack)
    assert second.choices[0].message.content
    assert after["vision_feature_cache_hits"] == before["vision_feature_cache_hits"] + 1
    assert after["vision_images_encoded"] == before["vision_images_encoded"]
    # A cached image gives exactly the output of a freshly encoded one (the first test's).
    for _ in range(2):
        assert image_chat(client, data_url(IMAGE)).choices[0].message.content == reference["text"]


def test_prompt_kv_is_reused_and_answers_as_a_cold_run(client: openai.OpenAI, stack: Frontend) -> None:
    """mlx-vlm's prefix cache behind `VisionBatchGenerator`: a vision model's text conversation reuses
    its KV (all but the last partial 16-token block) and answers exactly as the cold run did."""
    system = {"role": "system", "content": "You answer questions about pictures, briefly and kindly. " * 6}
    turn = [system, {"role": "user", "content": "What is a histogram?"}]

    def ask(messages: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(model=VLM, max_tokens=8, temperature=0, messages=messages)

    before = stats(stack)
    cold = ask(turn)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = ask(turn)
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert cold.usage.prompt_tokens - 16 <= warm.usage.prompt_tokens_details.cached_tokens < cold.usage.prompt_tokens
    after = stats(stack)
    assert after["vision_kv_cached_tokens"] >= before.get("vision_kv_cached_tokens", 0) + cold.usage.prompt_tokens - 16
    # The next turn of the conversation prefills only what is new.
    follow = ask([*turn, {"role": "assistant", "content": cold.choices[0].message.content},
                  {"role": "user", "content": "And a bar chart?"}])
    assert follow.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens - 16
    metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    assert 'tier="vision_kv"' in metrics


def test_image_prompts_never_take_another_images_kv(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    """Image placeholders are the same token ids for every image: the media salt keeps images apart."""
    first = image_chat(client, data_url(png(21)))
    again = image_chat(client, data_url(png(21)))
    other = image_chat(client, data_url(png(22)))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert image_chat(client, data_url(IMAGE)).choices[0].message.content == reference["text"]


def test_several_images_keep_their_order(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    def ask(*images: bytes) -> Any:
        parts = [{"type": "text", "text": PROMPT}]
        parts += [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
        return client.chat.completions.create(model=VLM, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": parts}])

    both, swapped = ask(IMAGE, OTHER_IMAGE), ask(OTHER_IMAGE, IMAGE)
    # 16 image tokens + vision start/end markers per extra image.
    assert both.usage.prompt_tokens == swapped.usage.prompt_tokens == reference["prompt_tokens"] + 18
    assert both.choices[0].message.content != swapped.choices[0].message.content
    # Images in earlier turns stay where they were.
    history = client.chat.completions.create(model=VLM, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                                     {"type": "text", "text": "First."}]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [{"type": "text", "text": "Second:"},
                                     {"type": "image_url", "image_url": {"url": data_url(OTHER_IMAGE)}}]}])
    assert history.usage.prompt_tokens > both.usage.prompt_tokens


def test_http_image_url(client: openai.OpenAI, image_server: str, reference: dict[str, Any]) -> None:
    assert image_chat(client, f"{image_server}/image.png").choices[0].message.content == reference["text"]
    assert image_chat(client, f"{image_server}/redirect").choices[0].message.content == reference["text"]


def test_slow_or_large_urls_fail_alone(client: openai.OpenAI, image_server: str,
                                       reference: dict[str, Any]) -> None:
    """A URL past the fetch timeout or the byte cap is a 400; requests beside it are served meanwhile."""
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        slow = pool.submit(expect_400, lambda: image_chat(client, f"{image_server}/slow.png"), "image_fetch_timeout")
        time.sleep(0.2)
        other = image_chat(client, data_url(IMAGE))
        other_done = time.monotonic() - started
        slow.result()
        slow_done = time.monotonic() - started
    assert other.choices[0].message.content == reference["text"]
    assert other_done < slow_done and slow_done < 3.5  # the 1.5 s fetch timeout, not the server's 4 s sleep
    expect_400(lambda: image_chat(client, f"{image_server}/big.png"), "image_too_large")
    expect_400(lambda: image_chat(client, f"{image_server}/page.html"), "unsupported_image_format")
    expect_400(lambda: image_chat(client, f"{image_server}/to-file"), "invalid_image_url")
    expect_400(lambda: image_chat(client, "file:///etc/passwd"), "invalid_image_url")


def test_a_requests_images_are_decoded_off_the_mlx_thread_within_a_pixel_budget(client: openai.OpenAI,
                                                                                 stack: Frontend) -> None:
    """Red team: 16 copies of a 6 KB 7071x7071 PNG were decoded on the mlx thread (a 27 s stall, 6 GB).

    Images are decoded on the admission pool (the engine counts them), 100 M pixels a request at most."""
    from PIL import Image

    blank = io.BytesIO()
    Image.new("1", (6000, 6000)).save(blank, "PNG")  # 36 M pixels in a few KB
    image_chat(client, data_url(IMAGE), max_tokens=2)  # the VLM loaded (a request that loads it decodes there)
    before = stats(stack).get("media_decoded", 0)
    parts = [{"type": "text", "text": PROMPT}] + [
        {"type": "image_url", "image_url": {"url": data_url(blank.getvalue())}} for _ in range(3)]
    expect_400(lambda: client.chat.completions.create(model=VLM, max_tokens=4, messages=[
        {"role": "user", "content": parts}]), "image_too_large")
    on_mlx_thread = stats(stack)["media_inputs_on_mlx_thread"]
    image_chat(client, data_url(IMAGE), max_tokens=2)
    assert stats(stack)["media_decoded"] == before + 2
    # The template and the processor ran on the admission pool too: the mlx thread took the inputs as built.
    assert stats(stack)["media_inputs_on_mlx_thread"] == on_mlx_thread
    # And a text-only chat to the vision model is rendered there as a text model's is.
    prepared = stats(stack)["prompts_prepared"]
    client.chat.completions.create(model=VLM, max_tokens=2, messages=[{"role": "user", "content": PROMPT}])
    assert stats(stack)["prompts_prepared"] == prepared + 1


def test_compressed_bodies_and_bad_hosts_are_refused(client: openai.OpenAI, image_server: str) -> None:
    """Red team: 32 KB of zstd inflated to 2 GB in the worker before the byte cap saw it, and `xn--` was a 500.

    Image fetches ask for identity and refuse a body compressed anyway, unread."""
    expect_400(lambda: image_chat(client, f"{image_server}/deflated.png"), "image_fetch_failed")
    assert _Images.accept_encodings[-1] == "identity"
    expect_400(lambda: image_chat(client, "http://xn--/a.png"), "invalid_image_url")
    # Red team, re-verification: a body cut short and a port past 65535 were 500s.
    expect_400(lambda: image_chat(client, f"{image_server}/short.png"), "image_fetch_failed")
    expect_400(lambda: image_chat(client, f"{image_server}/bad-chunks.png"), "image_fetch_failed")
    expect_400(lambda: image_chat(client, "http://127.0.0.1:99999/a.png"), "invalid_image_url")


def test_resize_shape_changes_the_image_tokens(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    # 112x112 is 16 image tokens; fitted into 56x56 it is 4.
    full = image_chat(client, data_url(IMAGE))
    small = image_chat(client, data_url(IMAGE), extra_body={"resize_shape": [56]})
    pair = image_chat(client, data_url(IMAGE), extra_body={"resize_shape": [56, 56]})
    assert full.usage.prompt_tokens == reference["prompt_tokens"]
    assert small.usage.prompt_tokens == full.usage.prompt_tokens - 12 == pair.usage.prompt_tokens
    assert small.choices[0].message.content == pair.choices[0].message.content
    expect_400(lambda: image_chat(client, data_url(IMAGE), extra_body={"resize_shape": [0]}), "invalid_value")
    expect_400(lambda: image_chat(client, data_url(IMAGE), extra_body={"resize_shape": [1, 2, 3]}), "invalid_value")


def engine_run(endpoint: str, bodies: list[dict[str, Any]], timeout: float = 30.0) -> dict[str, Any]:
    """Sends ADDs back to back on one engine socket (so they meet in one batch); rid -> text or ERROR body."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    results: dict[str, Any] = {}
    texts: dict[str, list[str]] = {}
    try:
        for body in bodies:
            sock.send(encode(MsgType.ADD, body))
        deadline = time.monotonic() + timeout
        while len(results) < len(bodies) and time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            msg_type, body = decode(sock.recv())
            if msg_type == MsgType.ERROR:
                results[body["rid"]] = body
            for item in body.get("items", ()) if msg_type == MsgType.DELTAS else ():
                texts.setdefault(item["rid"], []).append(item.get("text") or "")
                if item.get("finish_reason"):
                    results[item["rid"]] = "".join(texts[item["rid"]])
    finally:
        sock.close()
    assert len(results) == len(bodies), results
    return results


def image_add(rid: str, image: bytes | None, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"rid": f"t:{rid}", "model": VLM, "params": {"max_tokens": 16, "temperature": 0.0, **params},
                            "messages": [{"role": "user", "content": PROMPT + ("<p0>" if image else "")}]}
    if image:
        body["media"] = [{"type": "image", "data": image, "placeholder": "<p0>"}]
    return body


def test_concurrent_image_and_text_requests_batch(client: openai.OpenAI, stack: Frontend,
                                                  reference: dict[str, Any]) -> None:
    """Image and text requests to the vision model share one batch; each gets what it gets alone."""
    alone_other = image_chat(client, data_url(OTHER_IMAGE)).choices[0].message.content
    alone_text = client.chat.completions.create(model=VLM, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": PROMPT}]).choices[0].message.content
    endpoint = stack.engine.endpoint  # type: ignore[attr-defined]
    # Hold the mlx thread while the five ADDs arrive, so they are admitted in one go however busy the
    # machine is (otherwise a fast request can finish before the next one is even read).
    sleeper = threading.Thread(target=call_engine, args=(endpoint, "debug_sleep", {"seconds": 1.0}))
    sleeper.start()
    time.sleep(0.2)
    results = engine_run(endpoint, [image_add("b1", IMAGE), image_add("b2", OTHER_IMAGE), image_add("b3", None),
                                    image_add("b4", IMAGE, temperature=0.9, seed=4),
                                    image_add("b5", IMAGE, temperature=0.9, seed=4)])
    sleeper.join()
    assert [results["t:b1"], results["t:b2"], results["t:b3"]] == [reference["text"], alone_other, alone_text]
    # Sampled requests bring their own sampler into the shared batch: a seed gives the same text twice.
    assert results["t:b4"] == results["t:b5"] != reference["text"]
    assert stats(stack)["max_batch_size"] >= 4


def test_switching_between_text_and_vision_models(client: openai.OpenAI, stack: Frontend,
                                                  reference: dict[str, Any]) -> None:
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert models[VLM]["kind"] == "vision" and models[TEXT]["kind"] == "text"

    def text_chat() -> str:
        return client.chat.completions.create(model=TEXT, max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": "Tell me a story."}]).choices[0].message.content

    loads = stats(stack)["model_loads"]
    first = text_chat()
    health = httpx.get(f"{stack.base_url}/health").json()
    assert health["loaded_model"] == TEXT and health["loaded_model_kind"] == "text"
    assert image_chat(client, data_url(IMAGE)).choices[0].message.content == reference["text"]
    assert httpx.get(f"{stack.base_url}/health").json()["loaded_model_kind"] == "vision"
    assert text_chat() == first
    # One model in memory at a time: every switch is a fresh load of the other model.
    assert stats(stack)["model_loads"] == loads + 3
    assert httpx.get(f"{stack.base_url}/v1/models").json()["data"]


def test_clear_400s(client: openai.OpenAI, stack: Frontend) -> None:
    # Images to a text-only model: refused by the engine, which knows what the model is.
    error = expect_400(lambda: image_chat(client, data_url(IMAGE), model=TEXT), "images_not_supported")
    assert TEXT in error["message"]
    # Audio to a model without an audio tower.
    wav = b"RIFF" + (36).to_bytes(4, "little") + b"WAVEfmt " + bytes(28)
    expect_400(lambda: client.chat.completions.create(model=VLM, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Listen."},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}]}]),
        "audio_not_supported")
    # Undecodable, unsupported format, too large: refused by the front-end before the engine sees them.
    expect_400(lambda: image_chat(client, data_url(b"definitely not an image")), "invalid_image")
    expect_400(lambda: image_chat(client, data_url(IMAGE[:200])), "invalid_image")  # truncated PNG
    tiff = io.BytesIO()
    Image.new("RGB", (8, 8)).save(tiff, "TIFF")
    expect_400(lambda: image_chat(client, data_url(tiff.getvalue(), "image/tiff")), "unsupported_image_format")
    expect_400(lambda: image_chat(client, data_url(png(3, 400, 400))), "image_too_large")
    expect_400(lambda: image_chat(client, "data:image/png;base64,@@@"), "invalid_base64")
    expect_400(lambda: client.chat.completions.create(model=VLM, max_tokens=4, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}}]}]),
        "invalid_value")
    # The engine survived all of it.
    assert httpx.get(f"{stack.base_url}/health").json()["status"] == "healthy"


def test_engine_refuses_malformed_media(stack: Frontend) -> None:
    """A front-end bug (or a hostile peer) sending bad media gets a 400, never a crashed engine."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.engine.endpoint)  # type: ignore[attr-defined]
    bodies = [
        [{"type": "image", "data": "not bytes", "placeholder": "<p0>"}],
        [{"type": "image", "data": b"garbage", "placeholder": "<p0>"}],
        [{"type": "image", "data": IMAGE, "placeholder": "<not-in-any-message>"}],
        [{"type": "image", "data": IMAGE, "placeholder": "<p0>", "resize_shape": ["x"]}],
    ]
    try:
        for index, media in enumerate(bodies):
            sock.send(encode(MsgType.ADD, {"rid": f"t:bad{index}", "model": VLM, "params": {"max_tokens": 2},
                                           "messages": [{"role": "user", "content": "look <p0>"}], "media": media}))
            assert sock.poll(20000)
            msg_type, body = decode(sock.recv())
            assert msg_type == MsgType.ERROR and body["status"] == 400, body
    finally:
        sock.close()
    assert httpx.get(f"{stack.base_url}/health").json()["status"] == "healthy"


# -- media checks without processes ----------------------------------------------------------------
def test_private_addresses_are_refused_unless_allowed(image_server: str) -> None:
    async def fetch(allow: bool) -> list[dict[str, Any]] | None:
        media = MediaCollector(FrontendSettings(allow_private_image_urls=allow))
        media.add_part({"type": "image_url", "image_url": {"url": f"{image_server}/image.png"}}, "p", "user")
        return await media.resolve()

    with pytest.raises(APIError) as caught:
        asyncio.run(fetch(False))
    assert caught.value.code == "image_url_not_allowed"
    fetched = asyncio.run(fetch(True))
    assert fetched[0]["data"] == IMAGE and fetched[0]["format"] == "PNG"
    for address, public in [("127.0.0.1", False), ("10.1.2.3", False), ("169.254.169.254", False),
                            ("::1", False), ("::ffff:192.168.0.1", False), ("fd00::1", False),
                            ("8.8.8.8", True), ("2001:4860:4860::8888", True)]:
        import ipaddress

        assert is_public_address(ipaddress.ip_address(address)) is public, address


# -- engine-side decoding without processes ---------------------------------------------------------


def test_chunked_image_prefill_matches_and_reports_progress(model_dir: Path, reference: dict[str, Any]) -> None:
    """Prompts prefilled in small chunks between steps give the same tokens; progress feeds the pacer."""
    import mlx.core as mx

    from engine_daemon.generation.vision_batch import VisionBatchGenerator
    from engine_daemon.models.store import ModelRef
    from engine_daemon.models.vlm_loader import load_vision_model
    from engine_daemon.multimodal import inputs as vision
    from engine_daemon.request.admission import prepare
    from engine_daemon.request.state import EngineRequest

    loaded = load_vision_model(ModelRef(VLM, model_dir / VLM))

    def request(rid: str, image: bytes) -> EngineRequest:
        body = image_add(rid, image)
        engine_request = EngineRequest(rid=rid, peer=b"test", body=body)
        vision.check_media_allowed(body, loaded)
        vision.prepare(engine_request, loaded)
        prepare(engine_request, loaded, 64, {})
        return engine_request

    outputs = {}
    for step in (2048, 8):
        generator = VisionBatchGenerator(loaded, max_tokens=64, completion_batch_size=8, prefill_batch_size=4,
                                         prefill_step_size=step, stream=mx.default_stream(mx.default_device()))
        requests = [request("a", IMAGE), request("b", OTHER_IMAGE)]
        uids = [generator.insert_request(r) for r in requests]
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        progress = []
        while any(len(t) < 16 for t in tokens.values()):
            reported, responses = generator.next()
            progress += reported
            for response in responses:
                tokens[response.uid].append(response.token)
        generator.close()
        outputs[step] = [tokens[uid] for uid in uids]
        assert progress[-1].end_of_prompt and progress[-1].progress[0] == sum(len(r.prompt_tokens) for r in requests)
        if step == 8:
            assert len(progress) > 2  # prefilled over several steps
    assert outputs[8] == outputs[2048]
    assert loaded.tokenizer.decode(outputs[8][0]) == reference["text"]


def test_anthropic_image_block_matches_the_chat_route(stack: Frontend, reference: dict[str, Any]) -> None:
    """An Anthropic base64 image block reaches the VLM like an OpenAI image_url part."""
    import anthropic

    client = anthropic.Anthropic(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(IMAGE).decode()}}
    result = client.messages.create(model=VLM, max_tokens=16, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}, image]}])
    assert "".join(block.text for block in result.content if block.type == "text") == reference["text"]
    assert result.usage.input_tokens + (result.usage.cache_read_input_tokens or 0) == reference["prompt_tokens"]
