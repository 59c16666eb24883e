"""What a huge token prompt's frame costs the engine itself: its step gaps while such ADDs arrive, no HTTP.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/token_frame.py --rounds 3

`token_body.py` goes through a gunicorn worker, whose own JSON parsing of a 13 MB body and the
client's encoding of it take both of this machine's cores, so the engine's steps wait for a CPU
whatever its io thread does. Here two front-ends made by hand talk to the engine directly: one
streams a greedy completion (the victim), the other sends, one after the other, ADDs whose prompt
is `--ids` token ids (`--id-value` each, refused by the model's window), as a msgpack array (what a
front-end sends an engine without `packed_token_ids`) or packed (`protocol.token_ids`). Rounds
alternate the two. Prints the engine's longest gaps between two of the victim's decode steps (CALL
`step_gaps`, the engine's clock) and the time the io thread needs to decode each kind of frame.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stack import bench_model  # noqa: E402

from protocol import PROTOCOL_VERSION, MsgType, decode, encode  # noqa: E402
from protocol.token_ids import pack_token_ids  # noqa: E402
from tests.helpers import Engine, call_engine  # noqa: E402


def peer(endpoint: str, name: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(encode(MsgType.HELLO, {"version": PROTOCOL_VERSION, "frontend_id": name}))
    return sock


def drain(sock: zmq.Socket) -> list[tuple[MsgType, dict]]:
    frames = []
    while sock.poll(0):
        frames.append(decode(sock.recv()))
    return frames


def round_gaps(endpoint: str, bodies: list[bytes], index: int) -> tuple[list[float], int]:
    """The engine's step gaps while the victim streams and the `bodies` frames arrive, one at a time."""
    victim, sender = peer(endpoint, f"victim{index}"), peer(endpoint, f"sender{index}")
    try:
        victim.send(encode(MsgType.ADD, {"rid": f"v{index}", "prompt": "hello", "params": {
            "max_tokens": 100_000, "temperature": 0, "ignore_eos": True}}))
        time.sleep(2)
        drain(victim)
        before = call_engine(endpoint, "step_gaps")["count"]
        refused = 0
        for number, frame in enumerate(bodies):
            sender.send(frame)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not refused > number:
                if sender.poll(100):
                    kind, body = decode(sender.recv())
                    refused += kind == MsgType.ERROR
                drain(victim)
            time.sleep(0.3)
            drain(victim)
        answer = call_engine(endpoint, "step_gaps")
        new = answer["count"] - before
        victim.send(encode(MsgType.ABORT, {"rids": [f"v{index}"], "reason": "client"}))
        return sorted(answer["gaps_ms"][-new:] if new > 0 else [], reverse=True), refused
    finally:
        victim.close()
        sender.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=6_500_000)
    parser.add_argument("--id-value", type=int, default=1000, help="every id (a 3-byte msgpack int; 1 byte below 128)")
    parser.add_argument("--bodies", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ids = [args.id_value] * args.ids
    frames = {"list": lambda rid: encode(MsgType.ADD, {"rid": rid, "prompt": ids, "params": {"max_tokens": 1}}),
              "packed": lambda rid: encode(MsgType.ADD, {"rid": rid, "prompt": pack_token_ids(ids),
                                                         "params": {"max_tokens": 1}})}
    for kind, make in frames.items():
        frame = make("x")
        timings = []
        for _ in range(5):
            started = time.perf_counter()
            decode(frame)
            timings.append(time.perf_counter() - started)
        print(f"{kind}: {len(frame) / 1e6:.1f} MB frame, decoded in {statistics.median(timings) * 1000:.0f} ms "
              "(median of 5, this process)", flush=True)
    work = Path(tempfile.mkdtemp(prefix="mlxe-bench-"))
    engine = Engine(f"ipc://{work}/e.sock", work / "engined.log", model=str(bench_model("tiny")))
    try:
        engine.wait_ready(timeout=600)
        for number in range(args.rounds):
            for kind, make in frames.items():
                bodies = [make(f"{kind}{number}.{body}") for body in range(args.bodies)]
                gaps, refused = round_gaps(engine.endpoint, bodies, number)
                median = gaps[len(gaps) // 2] if gaps else float("nan")
                print(f"round {number} {kind}: {refused} of {args.bodies} refused; engine's longest step gaps "
                      f"{', '.join(f'{gap:.0f}' for gap in gaps[:args.bodies + 1])} ms (median {median:.0f}, "
                      f"{len(gaps)} steps)", flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
