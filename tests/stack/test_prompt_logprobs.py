"""A prompt's own logprobs (`echo` with `logprobs` on /v1/completions) through the real stack: openai SDK ->
gunicorn -> engined, checked against a full forward pass of the same model in this process."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_daemon.scheduling.scoring_budget import FIRST_SLICE
from tests.helpers import Frontend, client_for, error_of, running_stack, stream_running

TEXT = ("The quick brown fox jumps over the lazy dog while the river runs down to the sea and the town wakes up. "
        "Evaluation harnesses score the continuation of a context by the sum of its tokens' log probabilities. ")


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    """(tokenizer, function: ids -> each token's logprob given the ones before it, and the top alternative's)."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model))

    def logprobs(ids: list[int]) -> tuple[list[float], list[float]]:
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        table = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(table[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0]
        return chosen.tolist(), table[:-1].max(axis=-1).tolist()

    return tokenizer, logprobs


def engine_stats(frontend: Frontend) -> dict[str, Any]:
    return httpx.get(f"{frontend.base_url}/stats", timeout=30).json()


def streaming(client: Any, request: dict[str, Any]) -> tuple[threading.Thread, list[str]]:
    """A completion streamed on a thread of its own, its first chunk already in: (the thread, its texts so far)."""
    texts: list[str] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in client.completions.create(**request, stream=True):
            started.set()
            texts.append(chunk.choices[0].text)

    runner = threading.Thread(target=stream)
    runner.start()
    assert started.wait(60)
    return runner, texts


def queue_emptied(frontend: Frontend) -> dict[str, Any]:
    """The engine's stats once no prompt waits to be scored (an abort reaches it after the client left)."""
    for _ in range(200):
        stats = engine_stats(frontend)
        if stats["prompt_logprob_queued"] == 0:
            break
        threading.Event().wait(0.05)
    return stats


def test_prompt_logprobs_equal_a_full_forward_pass_and_the_completion_is_unchanged(
        frontend: Frontend, model_id: str, reference: Any) -> None:
    tokenizer, logprobs = reference
    ids = tokenizer.encode(TEXT * 3)
    expected, best = logprobs(ids)
    client = client_for(frontend)
    before = engine_stats(frontend)
    plain = client.completions.create(model=model_id, prompt=ids, max_tokens=8, temperature=0)
    scored = client.completions.create(model=model_id, prompt=ids, max_tokens=8, temperature=0, echo=True, logprobs=2)
    choice, legacy = scored.choices[0], scored.choices[0].logprobs
    read_back = httpx.post(f"{frontend.base_url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    # The KV the scoring pass built is the prefill the completion continues from: the same greedy text.
    assert choice.text == read_back + plain.choices[0].text
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == plain.usage.completion_tokens
    n = len(ids)
    assert len(legacy.tokens) == n + plain.usage.completion_tokens
    assert legacy.token_logprobs[0] is None and legacy.top_logprobs[0] is None
    assert legacy.token_logprobs[1:n] == pytest.approx(expected, abs=2e-4)
    for i in range(1, n):
        assert len(legacy.top_logprobs[i]) == 2
        assert max(legacy.top_logprobs[i].values()) == pytest.approx(best[i - 1], abs=2e-4)
        assert legacy.token_logprobs[i] <= max(legacy.top_logprobs[i].values()) + 1e-6
    assert "".join(legacy.tokens[:n]) == tokenizer.decode(ids)
    after = engine_stats(frontend)
    assert after["prompt_logprob_tokens"] - before["prompt_logprob_tokens"] == n - 1
    assert after["prompt_logprob_requests"] - before["prompt_logprob_requests"] == 1
    metrics = httpx.get(f"{frontend.base_url}/metrics", timeout=30).text
    scored = [line for line in metrics.splitlines() if line.startswith("mlx_engine_prompt_logprob_tokens_total")]
    assert scored and float(scored[0].split()[-1]) >= n - 1


def test_lm_eval_loglikelihood_request_and_scoring_only(frontend: Frontend, model_id: str, reference: Any) -> None:
    """lm-evaluation-harness's `local-completions` loglikelihood payload (a batch of one token prompt, `max_tokens`
    1, `logprobs` 1, `echo`), read as it reads it: token_logprobs[ctxlen:-1] summed, greedy if each equals its
    top alternative. Then `max_tokens` 0: the prompt's logprobs and nothing generated, streamed and not."""
    tokenizer, logprobs = reference
    context, continuation = tokenizer.encode(TEXT), tokenizer.encode(" the lazy dog")
    ids = context + continuation
    expected, best = logprobs(ids)
    payload = {"model": model_id, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    out = httpx.post(f"{frontend.base_url}/v1/completions", json=payload, timeout=60).json()
    choice = out["choices"][0]
    ctxlen = len(context)
    assert sum(choice["logprobs"]["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(expected[ctxlen - 1:]), abs=1e-3)
    greedy = all(token == max(top.values()) for token, top in zip(choice["logprobs"]["token_logprobs"][ctxlen:-1],
                                                                 choice["logprobs"]["top_logprobs"][ctxlen:-1]))
    assert greedy == all(e >= b - 1e-6 for e, b in zip(expected[ctxlen - 1:], best[ctxlen - 1:]))

    client = client_for(frontend)
    only = client.completions.create(model=model_id, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].finish_reason == "length" and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=2e-4)
    assert only.choices[0].logprobs.top_logprobs[1:] == [{}] * (len(ids) - 1)
    chunks = list(client.completions.create(model=model_id, prompt=ids, max_tokens=0, echo=True, logprobs=0,
                                            stream=True))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == only.choices[0].logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == only.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_scoring_beside_a_running_stream_is_sliced_and_exact(frontend: Frontend, model_id: str,
                                                             reference: Any) -> None:
    """While a stream decodes, the prompt goes through in slices sized from the stream's step (the first one of
    `FIRST_SLICE` positions): the logprobs are still those of one full pass, and the stream is not hurt."""
    tokenizer, logprobs = reference
    ids = tokenizer.encode(TEXT * 6)
    expected, _ = logprobs(ids)
    client = client_for(frontend)
    runner, streamed = streaming(client, {"model": model_id, "prompt": "Count:", "max_tokens": 1500, "temperature": 0,
                                          "extra_body": {"ignore_eos": True}})
    before = engine_stats(frontend)
    scored = client.completions.create(model=model_id, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    after = engine_stats(frontend)
    runner.join(120)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=2e-4)
    assert len(ids) - 1 > FIRST_SLICE and after["prompt_logprob_slices"] - before["prompt_logprob_slices"] >= 2
    # The slices rode in the stream's decode steps (`SideSlice`): none was a pass of its own.
    riding = after["prompt_logprob_riding_slices"] - before["prompt_logprob_riding_slices"]
    assert riding == after["prompt_logprob_slices"] - before["prompt_logprob_slices"], (before, after)
    assert not runner.is_alive()
    alone = client.completions.create(model=model_id, prompt="Count:", max_tokens=1500, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(streamed) == alone.choices[0].text


def test_prompt_logprobs_refusals(frontend: Frontend, model_id: str) -> None:
    base = f"{frontend.base_url}/v1/completions"
    response = httpx.post(base, json={"model": model_id, "prompt": "hi", "max_tokens": 0}, timeout=30)
    assert response.status_code == 400 and error_of(response)["param"] == "max_tokens"
    response = httpx.post(base, json={"model": model_id, "prompt": "hi", "echo": True, "logprobs": 21}, timeout=30)
    assert response.status_code == 400 and error_of(response)["param"] == "logprobs"


def test_a_prompt_is_scored_only_while_a_slot_is_free(tiny_model: Path, ipc_dir: Path, tmp_path: Path,
                                                      reference: Any) -> None:
    """A scored prompt holds its KV until it joins the batch: with every decode slot taken, none is scored; it
    waits, and is scored and answered once the slot is free."""
    tokenizer, logprobs = reference
    ids = tokenizer.encode(TEXT)
    with running_stack(f"ipc://{ipc_dir}/one-slot.sock", tmp_path, model=str(tiny_model),
                       engine_args=["--decode-concurrency", "1"]) as (_, frontend):
        answers: list[Any] = []
        scorer = threading.Thread(target=lambda: answers.append(client_for(frontend).completions.create(
            model=str(tiny_model), prompt=ids, max_tokens=2, echo=True, logprobs=0)))
        with stream_running(f"{frontend.base_url}/v1/chat/completions", str(tiny_model), 100_000):
            scorer.start()
            seen = []
            for _ in range(20):
                stats = engine_stats(frontend)
                seen.append((stats["prompt_logprob_queued"], stats["prompt_logprob_slices"]))
                threading.Event().wait(0.05)
            assert all(slices == 0 for _, slices in seen), seen
            assert engine_stats(frontend)["queued"] == 1
        scorer.join(120)
        assert answers and answers[0].choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(
            logprobs(ids)[0], abs=2e-4)
        assert engine_stats(frontend)["prompt_logprob_slices"] >= 1


def test_a_batch_of_token_prompts_is_scored_prompt_by_prompt(frontend: Frontend, model_id: str,
                                                             reference: Any) -> None:
    """lm-eval's `--batch_size` > 1: an array of token prompts, each choice the prompt at its index."""
    tokenizer, logprobs = reference
    batch = [tokenizer.encode(TEXT), tokenizer.encode("A short one."), tokenizer.encode(TEXT[:60])]
    out = httpx.post(f"{frontend.base_url}/v1/completions", timeout=60, json={
        "model": model_id, "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for ids, choice in zip(batch, out["choices"], strict=True):
        assert choice["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(logprobs(ids)[0], abs=2e-4)
    assert out["usage"]["prompt_tokens"] == sum(map(len, batch))


def test_a_client_leaving_mid_scoring_aborts_it(tiny_model: Path, ipc_dir: Path, tmp_path: Path,
                                                 reference: Any) -> None:
    """Slices of 16 positions (`--prefill-step-size 16`): a client that reads the first chunk and leaves takes its
    prompt out of the scoring queue (its KV freed), and the engine goes on serving."""
    tokenizer, logprobs = reference
    ids = tokenizer.encode(TEXT * 80)  # ~400 slices: the client is gone long before the last
    with running_stack(f"ipc://{ipc_dir}/abort-scoring.sock", tmp_path, model=str(tiny_model),
                       engine_args=["--prefill-step-size", "16"]) as (_, frontend):
        body = {"model": str(tiny_model), "prompt": ids, "echo": True, "logprobs": 5, "max_tokens": 0,
                "stream": True}
        with httpx.stream("POST", f"{frontend.base_url}/v1/completions", json=body, timeout=60) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert len(json.loads(first[6:])["choices"][0]["logprobs"]["tokens"]) >= 1
        stats = queue_emptied(frontend)
        assert stats["prompt_logprob_queued"] == 0
        assert stats["prompt_logprob_tokens"] < len(ids) - 1 and stats["prompt_logprob_requests"] == 0
        again = client_for(frontend).completions.create(model=str(tiny_model), prompt=ids[:50], max_tokens=0,
                                                        echo=True, logprobs=0)
        assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(logprobs(ids[:50])[0], abs=2e-4)


def test_choices_sharing_a_context_are_scored_from_where_they_part(frontend: Frontend, model_id: str,
                                                                   reference: Any) -> None:
    """lm-evaluation-harness's multiple choice: one request per choice, the same context before each, sent
    together. The context is computed once: the other choices compute only their own tokens (`ScoredPrefixes`
    and the prefix cache), and every logprob is still a full forward pass's."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer, logprobs = reference
    context = tokenizer.encode("Choices share this context, a question long enough to be worth keeping. " + TEXT)
    choices = [tokenizer.encode(text) for text in (" red", " a green leaf", " the blue sky", " yellow")]

    def ask(choice: list[int]) -> dict[str, Any]:
        payload = {"model": model_id, "prompt": [context + choice], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                   "echo": True}
        return httpx.post(f"{frontend.base_url}/v1/completions", json=payload, timeout=120).json()

    before = engine_stats(frontend)
    with ThreadPoolExecutor(len(choices)) as pool:
        answers = list(pool.map(ask, choices))
    after = engine_stats(frontend)
    for choice, answer in zip(choices, answers, strict=True):
        ids = context + choice
        expected, _ = logprobs(ids)
        assert answer["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=2e-4)
    reused = after["prompt_logprob_reused_tokens"] - before["prompt_logprob_reused_tokens"]
    computed = after["prompt_logprob_tokens"] - before["prompt_logprob_tokens"]
    assert reused >= (len(choices) - 1) * (len(context) - 1)  # every choice but the first reused the context
    assert computed + reused == sum(len(context) + len(choice) - 1 for choice in choices)
    assert sum(answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers) == reused


def test_a_client_leaving_while_its_slices_ride_leaves_the_stream_unchanged(frontend: Frontend, model_id: str,
                                                                            reference: Any) -> None:
    """A scored prompt's slices ride in a stream's decode steps; its client reads the first chunk and leaves. The
    engine drops the job with a slice in flight, and the stream's greedy text is the one it has alone."""
    tokenizer, logprobs = reference
    client = client_for(frontend)
    request = {"model": model_id, "prompt": "Riding:", "max_tokens": 600, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**request).choices[0].text
    runner, beside = streaming(client, request)
    before = engine_stats(frontend)
    ids = tokenizer.encode(TEXT * 80 + " A client that leaves.")  # many slices: the client is gone before the last
    body = {"model": model_id, "prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 0, "stream": True}
    with httpx.stream("POST", f"{frontend.base_url}/v1/completions", json=body, timeout=60) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["logprobs"]["tokens"]
    runner.join(120)
    assert "".join(beside) == alone
    after = queue_emptied(frontend)
    assert after["prompt_logprob_queued"] == 0
    assert after["prompt_logprob_riding_slices"] > before["prompt_logprob_riding_slices"]
    again = client.completions.create(model=model_id, prompt=ids[:40], max_tokens=0, echo=True, logprobs=0)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(logprobs(ids[:40])[0], abs=2e-4)
