"""Prometheus metrics for one front-end worker: its HTTP and token-latency figures, and the engine's.

Each gunicorn worker is its own process with its own counters, so every
front-end family carries a `pid` label: sum over it for the whole front-end.
The engine's figures are fetched over the protocol (`CALL stats`) at scrape time;
when the engine does not answer, /metrics still answers with `mlx_engine_up 0`.

The text exposition format (0.0.4) is written by hand: it is a few lines, and the
front-end stays free of dependencies it would only use here.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from typing import Any

import falcon.asgi

from http_frontend.engine.client import EngineClient, EngineError, EngineUnavailable
from protocol import CallMethod

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
START_KEY = "mlx_engined.started"  # scope key: perf_counter() when the request arrived
RID_KEY = "mlx_engined.rid"  # scope key: the engine request id, once submitted

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

Labels = tuple[tuple[str, str], ...]


# -- exposition -------------------------------------------------------------------------
def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _sample(name: str, labels: Labels, value: float) -> str:
    if not labels:
        return f"{name} {_number(value)}"
    rendered = ",".join(f'{key}="{_escape_label(str(val))}"' for key, val in labels)
    return f"{name}{{{rendered}}} {_number(value)}"


def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, Labels, float]]) -> list[str]:
    """HELP, TYPE and the samples of one metric family; `samples` are (suffix, labels, value)."""
    help_text = help_text.replace("\\", "\\\\").replace("\n", "\\n")
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines.extend(_sample(name + suffix, labels, value) for suffix, labels, value in samples)
    return lines


class Counter:
    """A counter keyed by label values."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()):
        self.name, self.help_text, self.labelnames = name, help_text, labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labelvalues: str, amount: float = 1) -> None:
        self.values[labelvalues] = self.values.get(labelvalues, 0) + amount

    def render(self, const: Labels) -> list[str]:
        return family(self.name, "counter", self.help_text,
                      (("", const + tuple(zip(self.labelnames, key)), value)
                       for key, value in sorted(self.values.items())))


class Histogram:
    """A histogram with fixed upper bounds (seconds), keyed by label values."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...], labelnames: tuple[str, ...] = ()):
        self.name, self.help_text, self.labelnames = name, help_text, labelnames
        self.bounds = tuple(sorted(buckets))
        # per label key: [per-bucket counts (non-cumulative, last = +Inf)], sum, count
        self.values: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labelvalues: str, count: int = 1) -> None:
        """Records `count` observations of `value` (merged deltas carry several tokens)."""
        if count < 1:
            return
        buckets, totals = self.values.setdefault(labelvalues, ([0] * (len(self.bounds) + 1), [0.0, 0]))
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        buckets[index] += count
        totals[0] += value * count
        totals[1] += count

    def render(self, const: Labels) -> list[str]:
        samples: list[tuple[str, Labels, float]] = []
        keys = sorted(self.values) or ([()] if not self.labelnames else [])
        for key in keys:
            buckets, totals = self.values.get(key, ([0] * (len(self.bounds) + 1), [0.0, 0]))
            labels = const + tuple(zip(self.labelnames, key))
            running = 0
            for bound, hits in zip((*self.bounds, math.inf), buckets):
                running += hits
                samples.append(("_bucket", labels + (("le", _number(float(bound))),), running))
            samples.append(("_sum", labels, totals[0]))
            samples.append(("_count", labels, int(totals[1])))
        return family(self.name, "histogram", self.help_text, samples)


# -- the worker's figures ----------------------------------------------------------------
class FrontendMetrics:
    """Everything one worker counts, plus the scrape that renders it with the engine's figures."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.requests = Counter("mlx_frontend_requests_total",
                                "HTTP requests answered by this worker, by route, method and status.",
                                ("route", "method", "status"))
        self.duration = Histogram("mlx_frontend_request_duration_seconds",
                                  "Seconds from request arrival to the last byte of the response (whole stream).",
                                  DURATION_BUCKETS, ("route",))
        self.ttft = Histogram("mlx_frontend_time_to_first_token_seconds",
                              "Seconds from request arrival to the first generated content reaching this worker.",
                              TTFT_BUCKETS)
        self.itl = Histogram("mlx_frontend_inter_token_latency_seconds",
                             "Seconds between generated tokens, per token (gaps of merged deltas are split evenly).",
                             ITL_BUCKETS)
        self.open_streams = 0

    # -- recording ------------------------------------------------------------------------
    def token_timer(self, scope: dict[str, Any]) -> TokenTimer:
        return TokenTimer(self, scope.get(START_KEY) or time.perf_counter())

    def stream_opened(self) -> None:
        self.open_streams += 1

    def stream_closed(self) -> None:
        self.open_streams -= 1

    def record_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.inc(route, method, str(status))
        self.duration.observe(seconds, route)

    # -- rendering ------------------------------------------------------------------------
    def render_frontend(self) -> list[str]:
        const: Labels = (("pid", str(os.getpid())),)
        lines = []
        for metric in (self.requests, self.duration, self.ttft, self.itl):
            lines += metric.render(const)
        lines += family("mlx_frontend_open_streams", "gauge", "Server-sent-event responses this worker is streaming.",
                        [("", const, self.open_streams)])
        lines += family("mlx_frontend_inflight_requests", "gauge",
                        "Requests of this worker the engine has not finished yet (streamed or not).",
                        [("", const, len(self.client.streams))])
        return lines

    async def render(self) -> str:
        call_each = getattr(self.client, "call_each", None)
        if call_each is None or len(getattr(self.client, "links", ())) < 2:
            try:
                stats = await self.client.call(CallMethod.STATS, timeout=1.0)
            except (EngineUnavailable, EngineError) as exc:
                log.debug("engine stats unavailable for /metrics: %s", exc)
                stats = None
            return "\n".join(self.render_frontend() + engine_lines(stats)) + "\n"
        # Several engines: every engine series carries `engine`, one HELP/TYPE per family.
        answers = await call_each(CallMethod.STATS, timeout=1.0)
        per_engine = [engine_lines(answer if isinstance(answer, dict) else None, (("engine", engine_id),))
                      for engine_id, answer in answers.items()]
        return "\n".join(self.render_frontend() + merge_families(per_engine)) + "\n"


def merge_families(blocks: list[list[str]]) -> list[str]:
    """Exposition blocks with the same families (one per engine) as one: each family's HELP/TYPE once."""
    order: list[str] = []
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for block in blocks:
        name = ""
        for line in block:
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                if name not in headers:
                    order.append(name)
                    headers[name], samples[name] = [], []
                if len(headers[name]) < 2:
                    headers[name].append(line)
            else:
                samples[name].append(line)
    return [line for name in order for line in headers[name] + samples[name]]


def engine_lines(stats: dict[str, Any] | None, const: Labels = ()) -> list[str]:
    """The engine's `stats` CALL as metric families; only `mlx_engine_up 0` when it is down.

    `const`: labels on every sample (the engine's id, behind several engines).
    """
    lines = family("mlx_engine_up", "gauge", "1 when the engine answered this scrape's stats call, else 0.",
                   [("", const, 1 if stats else 0)])
    if not stats:
        return lines

    def one(name: str, kind: str, help_text: str, key: str) -> None:
        value = stats.get(key)
        if isinstance(value, (int, float)):
            lines.extend(family(name, kind, help_text, [("", const, value)]))

    lines += family("mlx_engine_info", "gauge", "Engine state, loaded model and scheduler (value is always 1).",
                    [("", const + (("state", str(stats.get("state") or "")), ("model", str(stats.get("model") or "")),
                                   ("scheduler", str(stats.get("scheduler") or ""))), 1)])
    one("mlx_engine_epoch", "gauge", "Engine epoch: changes when the engine restarts.", "epoch")
    one("mlx_engine_uptime_seconds", "gauge", "Seconds since the engine started.", "uptime")
    one("mlx_engine_frontends", "gauge", "Front-end connections the engine knows.", "frontends")
    one("mlx_engine_queued_requests", "gauge", "Requests waiting to start (queue depth).", "queued")
    one("mlx_engine_running_requests", "gauge", "Requests prefilling or decoding.", "running")
    one("mlx_engine_batch_size", "gauge", "Requests in the current decode batch.", "batch_size")
    one("mlx_engine_max_batch_size", "gauge", "Largest decode batch since the engine started.", "max_batch_size")
    one("mlx_engine_decode_concurrency", "gauge", "Most requests decoding in one batch.", "decode_concurrency")
    one("mlx_engine_tokens_generated_total", "counter", "Tokens generated since the engine started.",
        "tokens_generated")
    one("mlx_engine_prompt_tokens_total", "counter", "Prompt tokens admitted since the engine started.",
        "prompt_tokens")
    one("mlx_engine_prompt_cache_hits_total", "counter", "Requests that reused a cached prompt prefix.",
        "prompt_cache_hits")
    one("mlx_engine_prompt_cache_misses_total", "counter", "Requests that found no cached prompt prefix.",
        "prompt_cache_misses")
    hits, misses = stats.get("prompt_cache_hits"), stats.get("prompt_cache_misses")
    if isinstance(hits, int) and isinstance(misses, int):
        rate = hits / (hits + misses) if hits + misses else 0.0
        lines += family("mlx_engine_prompt_cache_hit_rate", "gauge",
                        "Prompt-cache hits / (hits + misses) since the engine started.", [("", const, rate)])
    one("mlx_engine_cached_tokens_total", "counter", "Prompt tokens served from the prompt cache.", "cached_tokens")
    one("mlx_engine_prompt_cache_entries", "gauge", "Entries in the prompt cache.", "prompt_cache_entries")
    one("mlx_engine_prompt_cache_bytes", "gauge", "Bytes held by the prompt cache.", "prompt_cache_bytes")
    tiers = [(("tier", tier), stats[key]) for tier, key in (
        ("memory", "prompt_cache_memory_hits"), ("disk", "prompt_cache_disk_loads"),
        ("in_flight", "prompt_cache_in_flight_hits"), ("vision_kv", "vision_kv_hits"),
        ("vision_disk", "vision_kv_disk_hits"))
        if isinstance(stats.get(key), int)]
    if tiers:
        lines += family("mlx_engine_prefix_cache_hits_total", "counter",
                        "Prefix reuse by tier: memory hits, disk loads, hits on prompts shared at the end of their "
                        "prefill while their request still ran (in_flight), vision models' KV blocks (mlx-vlm's "
                        "prefix cache) and their disk loads.",
                        [("", const + (label,), value) for label, value in tiers])
    one("mlx_engine_prefix_published_at_prefill_total", "counter",
        "Prompts whose KV entered the prefix cache the step their prefill ended.", "prefix_published_at_prefill")
    one("mlx_engine_prefix_waits_total", "counter", "Requests that waited for another's prefill of a shared prefix.",
        "prefix_waits_for_shared_prefill")
    one("mlx_engine_prompt_cache_disk_entries", "gauge", "Files in --prompt-cache-dir.", "prompt_cache_disk_entries")
    one("mlx_engine_prompt_cache_disk_bytes", "gauge", "Bytes in --prompt-cache-dir.", "prompt_cache_disk_bytes")
    one("mlx_engine_prompt_cache_disk_writes_total", "counter", "Prefixes written to disk.", "prompt_cache_disk_writes")
    one("mlx_engine_prompt_cache_disk_corrupt_total", "counter", "Damaged cache files skipped and deleted.",
        "prompt_cache_disk_corrupt")
    one("mlx_engine_prompt_cache_disk_read_failures_total", "counter",
        "Cache files the machine could not read (memory, descriptors, I/O): kept, the prompt prefilled.",
        "prompt_cache_disk_read_failures")
    one("mlx_engine_prompt_cache_disk_spills_waited_total", "counter",
        "Evictions that waited for the disk writer (over 1 GiB of evicted KV not yet written).",
        "prompt_cache_disk_spills_waited")
    one("mlx_engine_vision_prompt_cache_disk_writes_total", "counter", "Vision models' prefixes written to disk.",
        "vision_kv_disk_writes")
    one("mlx_engine_vision_prompt_cache_disk_corrupt_total", "counter",
        "Damaged cache files a vision model skipped and deleted.", "vision_kv_disk_corrupt")
    one("mlx_engine_prompt_logprob_requests_total", "counter",
        "Requests whose prompts' own logprobs were computed (/v1/completions echo with logprobs).",
        "prompt_logprob_requests")
    one("mlx_engine_prompt_logprob_tokens_total", "counter", "Prompt positions scored for their logprobs.",
        "prompt_logprob_tokens")
    one("mlx_engine_prompt_logprob_reused_tokens_total", "counter",
        "Prompt positions whose logprobs and KV came from an earlier prompt sharing them.",
        "prompt_logprob_reused_tokens")
    one("mlx_engine_requests_preempted_total", "counter",
        "Requests paused so a client holding fewer decode slots got one (--fair-preemption).", "requests_preempted")
    one("mlx_engine_tool_parses_timed_out_total", "counter",
        "Tool-call texts whose family parser ran past its time bound (hostile or broken markup).",
        "tool_parses_timed_out")
    group = stats.get("group")
    if isinstance(group, dict):  # an engine group: alerting tells its failure from a slow step
        lines += family("mlx_engine_group_ranks", "gauge", "Ranks of the engine group.",
                        [("", const + (("mode", str(group.get("mode") or "")),), group.get("size") or 0)])
        lines += family("mlx_engine_group_failed", "gauge", "1 once the engine group failed (it exits to restart).",
                        [("", const, 1 if group.get("failed") else 0)])
        if isinstance(group.get("failed_rank"), int):
            lines += family("mlx_engine_group_failed_rank", "gauge", "The rank the group's failure was traced to.",
                            [("", const, group["failed_rank"])])
    one("mlx_engine_cpu_decode_attention_layers_total", "counter",
        "Decode steps' layers whose attention took the CPU's NumPy path (long contexts, --cpu-decode-attention).",
        "cpu_decode_attention_layers")
    one("mlx_engine_model_loads_total", "counter", "Model loads since the engine started.", "model_loads")
    outcomes = [(("outcome", outcome.removeprefix("requests_")), stats[outcome])
                for outcome in ("requests_added", "requests_finished", "requests_aborted", "requests_rejected")
                if isinstance(stats.get(outcome), int)]
    if outcomes:
        lines += family("mlx_engine_requests_total", "counter", "Engine requests by outcome.",
                        [("", const + (label,), value) for label, value in outcomes])
    rejections = stats.get("rejections")
    if isinstance(rejections, dict) and rejections:
        lines += family("mlx_engine_rejections_total", "counter", "Requests refused at admission, by error code.",
                        [("", const + (("code", str(code)),), count) for code, count in sorted(rejections.items())])
    return lines


class TokenTimer:
    """TTFT and inter-token latency of one request, fed with the engine's merged updates."""

    def __init__(self, metrics: FrontendMetrics, started: float):
        self.metrics = metrics
        self.started = started
        self.last: float | None = None

    def on_update(self, update: Any) -> None:
        tokens = len(update.token_ids) or (1 if update.text else 0)
        if not tokens:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.started)
            tokens -= 1  # tokens merged with the first one have no gap of their own to measure
        elif tokens:
            self.metrics.itl.observe((now - self.last) / tokens, count=tokens)
        self.last = now


class MetricsResource:
    """GET /metrics in the Prometheus text format (covered by the API key like every route)."""

    def __init__(self, metrics: FrontendMetrics):
        self.metrics = metrics

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = CONTENT_TYPE
        resp.text = await self.metrics.render()
