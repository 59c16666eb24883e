"""Mixed-feature soak: concurrent requests of every kind against a running server, a fifth abandoned.

Chat (plain, streamed, n>1 seeded, forced tool calls, json_schema, stop + logprobs), completions,
Responses, Anthropic Messages, image chats on a vision model (so the engine switches models under
load), and requests that must be 400s. Prints the status counts and the server's health afterwards:
no 5xx and a healthy, idle engine are the pass criteria.

    python bench/mixed_soak.py --base-url http://127.0.0.1:8080 --text-model TEXT --vision-model VLM
"""
import argparse
import asyncio
import base64
import io
import json
import random
import time

import httpx
import numpy as np
from PIL import Image

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--base-url", required=True)
parser.add_argument("--text-model", required=True)
parser.add_argument("--vision-model", required=True)
parser.add_argument("--requests", type=int, default=1000)
parser.add_argument("--concurrency", type=int, default=16)
ARGS = parser.parse_args()
BASE, TEXT, VLM, N = ARGS.base_url, ARGS.text_model, ARGS.vision_model, ARGS.requests
def png(seed):
    px = (np.random.default_rng(seed).random((56, 56, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(px).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()
IMG = png(1)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
          "b": {"type": "string", "maxLength": 8}}, "required": ["a", "b"], "additionalProperties": False}
def chat(**kw):
    content = "hi " * random.randint(1, 50)
    return ("/v1/chat/completions", {"model": TEXT, "messages": [{"role": "user", "content": content}],
                                     "max_tokens": random.randint(1, 40), **kw})
KINDS = [
    lambda: chat(),
    lambda: chat(stream=True, stream_options={"include_usage": True}),
    lambda: chat(temperature=1.0, seed=random.randint(0, 9), n=random.randint(1, 3)),
    lambda: chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60),
    lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                 max_tokens=60),
    lambda: chat(stop=["e", "the"], logprobs=True, top_logprobs=3),
    lambda: ("/v1/completions", {"model": TEXT, "prompt": "Once upon a time", "max_tokens": 20, "stream": True}),
    lambda: ("/v1/responses", {"model": TEXT, "input": "hello", "max_output_tokens": 20,
                               "stream": random.random() < .5}),
    lambda: ("/v1/messages", {"model": TEXT, "max_tokens": 20, "messages": [{"role": "user", "content": "hey"}],
                              "stream": random.random() < .5}),
    lambda: ("/v1/chat/completions", {"model": VLM, "max_tokens": 8, "stream": random.random() < .5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64," + IMG}}]}]}),
    lambda: chat(temperature="hot"),  # 400
    lambda: ("/v1/chat/completions", {"model": TEXT, "messages": [{"role": "user", "content": [{"type": "image_url",
             "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 4}),  # 400
]
async def one(client, i, stats):
    path, body = random.choice(KINDS)()
    abandon = random.random() < 0.2
    try:
        if body.get("stream"):
            async with client.stream("POST", BASE + path, json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += 1
                    if abandon and n > 3:
                        break
                stats[r.status_code] = stats.get(r.status_code, 0) + 1
        else:
            try:  # an abandoning client hangs up after 0.3 s
                r = await asyncio.wait_for(client.post(BASE + path, json=body), 0.3 if abandon else None)
            except asyncio.TimeoutError:
                stats["abandoned"] = stats.get("abandoned", 0) + 1
                return
            stats[r.status_code] = stats.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                print("5xx", path, r.text[:300])  # the failure this soak looks for
    except Exception as exc:
        stats[type(exc).__name__] = stats.get(type(exc).__name__, 0) + 1
async def main():
    stats = {}
    t = time.time()
    async with httpx.AsyncClient(timeout=120) as client:
        sem = asyncio.Semaphore(ARGS.concurrency)
        async def guarded(i):
            async with sem:
                await one(client, i, stats)
        await asyncio.gather(*(guarded(i) for i in range(N)))
        h = (await client.get(BASE + "/health")).json()
    engine = h["engine"]
    print(json.dumps(stats), f"{time.time()-t:.0f}s", h["status"], engine["state"], "queued", engine["queued"],
          "running", engine["running"])
asyncio.run(main())
