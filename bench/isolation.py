"""Attacks against a live stack while a victim stream runs: what each attacker gets and what the victim sees.

For every attack of the isolation issue that an HTTP client or a raw engine socket can play,
this starts a victim stream, plays the attack once it streams, and reports the attacker's
status and error code, the victim's longest gap between two SSE events while the attack
ran, whether the victim saw an error, how long the next small request took, and /health.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/isolation.py

Timings here are client-side on a shared machine: figures for the closing note, not test assertions.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.stack import our_stack  # noqa: E402
from model_builders.text import build_model, derive_model  # noqa: E402
from protocol import PROTOCOL_VERSION, MsgType, decode, encode  # noqa: E402

PLAIN_CHATML = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


class Victim(threading.Thread):
    """A long greedy stream; records the gap between consecutive events and any error."""

    def __init__(self, base: str, model: str):
        super().__init__(daemon=True)
        self.base, self.model = base, model
        self.stamps: list[float] = []
        self.error: str | None = None
        self.window: tuple[float, float] | None = None

    def run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Tell a long story"}],
                "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/chat/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.stamps.append(time.monotonic())
                        if '"error"' in line:
                            self.error = line[6:200]
        except Exception as exc:
            self.error = repr(exc)

    def max_gap_during(self, start: float, end: float) -> float:
        inside = [t for t in self.stamps if start - 1.0 <= t <= end + 1.0]
        return max((b - a for a, b in zip(inside, inside[1:])), default=float("nan"))


def post(base: str, body: dict[str, Any], path: str = "/chat/completions") -> tuple[int, str]:
    # ensure_ascii: a lone surrogate travels as the JSON escape a hostile client would send
    response = httpx.post(f"{base}{path}", content=json.dumps(body).encode(), timeout=300,
                          headers={"content-type": "application/json"})
    try:
        code = response.json()["error"]["code"]
    except Exception:
        code = ""
    return response.status_code, code


def hello_then_add(endpoint: str) -> tuple[int, str]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION + 7, "frontend_id": "old"}))
        refused = decode(sock.recv())[1].get("code") if sock.poll(5000) else "no answer"
        sock.send(encode(MsgType.ADD, {"rid": "old:1", "prompt": "hi", "params": {"max_tokens": 4}}))
        served = sock.poll(2000)
        return (0 if not served else 1), f"{refused}; then {'served' if served else 'ignored'}"
    finally:
        sock.close()


def attacks(model: str, plain_model: str, endpoint: str) -> dict[str, Callable[[str], tuple[int, str]]]:
    ask = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    id_schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments", "id"],
                 "properties": {"name": {"const": "f"}, "id": {"const": 1e30},
                                "arguments": {"type": "object", "properties": {}, "additionalProperties": False}}}
    return {
        "1 tool-call id past 64 bits": lambda b: post(b, {
            **ask, "model": plain_model, "max_tokens": 64, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": id_schema}}}),
        "2 chat_template_kwargs tokenize=false": lambda b: post(
            b, {**ask, "chat_template_kwargs": {"tokenize": False}}),
        "3 client Jinja nested loop": lambda b: post(b, {**ask, "chat_template_kwargs": {"chat_template": (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")}}),
        "4 4 MB of messages": lambda b: post(b, {**ask, "messages": [
            {"role": "user", "content": "word " * 200_000} for _ in range(4)]}),
        "5 16 stop strings of 100k chars": lambda b: post(b, {**ask, "stop": ["x" * 100_000] * 16}),
        "6 body past the 32 MiB frame when packed": lambda b: post(b, {
            **ask, "chat_template_kwargs": {"v": [0.5] * 3_800_000}}),  # 15 MB of JSON, 34 MB packed
        "8 a million empty metadata maps": lambda b: post(b, {
            "model": model, "input": "hi", "max_output_tokens": 16, "metadata": {"k": [{}] * 1_000_000}},
            path="/responses"),
        "13 HELLO of another protocol, then ADD": lambda b: hello_then_add(endpoint),
        "14 a 300-byte model name": lambda b: post(b, {**ask, "model": "m" * 300}),
        "14 a lone surrogate": lambda b: post(b, {**ask, "messages": [{"role": "user", "content": "\ud800"}]}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    models = Path.home() / ".cache" / "mlx-engined" / "bench-models"
    tiny = build_model(models / "tiny-qwen2", size="tiny", seed=0)
    plain = derive_model(tiny, models / "tiny-plain-chatml", PLAIN_CHATML)
    rows = []
    with our_stack(tiny, engine_args=["--model-dir", str(models)]) as (base, engine):
        for name, attack in attacks(str(tiny), str(plain), engine.endpoint).items():
            victim_model = str(plain) if name.startswith("1 ") else str(tiny)
            post(base, {"model": victim_model, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 2})
            victim = Victim(base, victim_model)
            victim.start()
            while len(victim.stamps) < 5 and victim.is_alive():
                time.sleep(0.02)
            start = time.monotonic()
            status, code = attack(base)
            end = time.monotonic()
            gap = victim.max_gap_during(start, end)
            t0 = time.monotonic()
            nxt = post(base, {"model": victim_model, "messages": [{"role": "user", "content": "next"}],
                              "max_tokens": 1})
            next_ms = (time.monotonic() - t0) * 1000
            health = httpx.get(base.replace("/v1", "") + "/health", timeout=10).json().get("status")
            victim.join(300)
            rows.append({"attack": name, "attacker": f"{status} {code}".strip(), "attack_s": round(end - start, 2),
                         "victim_max_gap_ms": round(gap * 1000), "victim_error": victim.error or "none",
                         "next_request": f"{nxt[0]} in {next_ms:.0f} ms", "health": health})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| attack | attacker gets | victim's longest gap | victim error | next request | /health |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['attack']} | {row['attacker']} | {row['victim_max_gap_ms']} ms | {row['victim_error']} | "
              f"{row['next_request']} | {row['health']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
