"""StallFreeBatchGenerator: a prompt's chunks fused into decode steps give the unfused tokens."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from engine_daemon.generation.fused_step import fusable, fused_forward
from engine_daemon.generation.stall_free import StallFreeBatchGenerator
from model_builders.text import build_model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = build_model(tmp_path_factory.mktemp(request.param) / "m", size="tiny", arch=request.param)
    loaded, _ = load(str(Path(path)))
    return loaded


def run(generator: BatchGenerator, prompts: list[list[int]], late: list[int], steps_before_late: int,
        streams_max_tokens: int, first_token_steps: dict[int, int] | None = None,
        **late_options: Any) -> tuple[dict[int, list[int]], BatchGenerator]:
    """Greedy tokens per uid: `prompts` start together, `late` joins after some decode steps.

    `first_token_steps` gets, per uid, how many steps after its insertion its first token came back.
    """
    out: dict[int, list[int]] = {}
    uids = generator.insert(prompts, max_tokens=[streams_max_tokens] * len(prompts))
    inserted = {uid: 0 for uid in uids}
    for uid in uids:
        out[uid] = []
    step = 0
    live = set(uids)
    while live:
        if step == steps_before_late:
            options = {"max_tokens": [8], **late_options}
            (late_uid,) = generator.insert([late], **options)
            out[late_uid], inserted[late_uid] = [], step
            live.add(late_uid)
        _, responses = generator.next()
        for response in responses:
            if not out[response.uid] and first_token_steps is not None:
                first_token_steps[response.uid] = step + 1 - inserted[response.uid]
            out[response.uid].append(response.token)
            if response.finish_reason is not None:
                live.discard(response.uid)
        step += 1
    return out, generator


def test_fused_steps_give_the_same_greedy_tokens(model) -> None:
    assert fusable(model)
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(5 + 3 * i)] for i in range(4)]
    late = [(13 * j) % 2000 + 3 for j in range(150)]
    plain, _ = run(BatchGenerator(model, prefill_step_size=16), prompts, late, 3, 40)
    fused_out, fused = run(StallFreeBatchGenerator(model, prefill_step_size=16), prompts, late, 3, 40)
    assert fused.fused_steps >= 150 // 16 - 1  # the late prompt's chunks rode in decode steps
    assert fused_out == plain


def test_fusion_off_runs_mlx_lm_path(model) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    out, generator = run(StallFreeBatchGenerator(model, prefill_step_size=8, fuse=False), prompts, [3] * 40, 2, 12)
    assert generator.fused_steps == 0
    assert all(out.values())


def test_fused_forward_matches_two_passes(model) -> None:
    """Decode logits and the chunk's KV equal what two separate forward passes compute."""
    decode_prompt = mx.array([[4, 5, 6, 7, 8]])
    chunk = mx.array([[9, 10, 11, 12, 13, 14, 15]])
    caches = [make_prompt_cache(model) for _ in range(4)]
    for cache in (caches[0], caches[2]):
        model(decode_prompt, cache=cache)
    token = mx.array([[21]])
    expected = model(token, cache=caches[0])
    model(chunk, cache=caches[1])
    got = fused_forward(model, token, caches[2], chunk, caches[3])
    assert mx.allclose(got, expected, atol=1e-5).item()
    for plain_layer, fused_layer in zip(caches[1], caches[3]):
        assert plain_layer.offset == fused_layer.offset == chunk.shape[1]
        for plain, fused in ((plain_layer.keys, fused_layer.keys), (plain_layer.values, fused_layer.values)):
            end = plain_layer.offset
            assert mx.allclose(plain[..., :end, :], fused[..., :end, :], atol=1e-5).item()


def test_deferred_join_gives_the_same_greedy_tokens(model) -> None:
    """A prompt joining running streams without its own pass: same tokens, same counts, one step later."""
    prompts = [[(5 * i + j) % 2000 + 3 for j in range(4 + 2 * i)] for i in range(3)]
    late = [(11 * j) % 2000 + 3 for j in range(70)]
    plain, _ = run(BatchGenerator(model, prefill_step_size=16), prompts, late, 2, 30)
    unended = {"first_token_from_last_chunk": False}  # else the last chunk hands back the first token
    deferred_out, deferred = run(StallFreeBatchGenerator(model, prefill_step_size=16, **unended), prompts, late, 2, 30)
    assert deferred.deferred_joins == 1  # the late prompt (5 chunks beside the streams) joined deferred
    assert deferred_out == plain  # max_tokens (8 for the late one) and every token as mlx-lm's path
    immediate, undeferred = run(StallFreeBatchGenerator(model, prefill_step_size=16, defer_join=False,
                                                        first_token_from_last_chunk=False), prompts, late, 2, 30)
    assert undeferred.deferred_joins == 0 and immediate == plain
    short, one_chunk = run(StallFreeBatchGenerator(model, prefill_step_size=128, first_token_from_last_chunk=False),
                           prompts, late, 2, 30)
    assert one_chunk.deferred_joins == 0 and short == plain  # prefilled in one step: joins on mlx-lm's path


def test_deferred_join_honours_stop_sequences(model) -> None:
    """The pending prompt token never completes a stop sequence; generated tokens still do."""
    prompts = [[5, 6, 7, 8]]
    late = [(3 * j) % 2000 + 3 for j in range(40)]
    plain, _ = run(BatchGenerator(model, prefill_step_size=16), prompts, late, 2, 20)
    late_tokens = plain[1]
    generator = StallFreeBatchGenerator(model, prefill_step_size=16, first_token_from_last_chunk=False)
    out: dict[int, list[int]] = {}
    (first,) = generator.insert([prompts[0]], max_tokens=[20])
    out[first] = []
    for _ in range(2):
        for response in generator.next()[1]:
            out[response.uid].append(response.token)
    # Stop on [last prompt token, first generated token]: must not fire; stop on the 2nd-3rd generated must.
    stops = [[late[-1], late_tokens[0]], late_tokens[1:3]]
    (late_uid,) = generator.insert([late], max_tokens=[8], stop_sequences=[StopSequences(stops)])
    out[late_uid] = []
    finished = None
    while finished is None:
        for response in generator.next()[1]:
            out[response.uid].append(response.token)
            if response.uid == late_uid and response.finish_reason is not None:
                finished = response.finish_reason
    assert generator.deferred_joins == 1
    matcher, expected = StopSequences(stops).matcher(), []
    for token in late_tokens:  # where the stop fires over the generated tokens alone
        expected.append(token)
        if matcher.advance(token):
            break
    assert finished == "stop" and out[late_uid] == expected


def test_a_finished_prefill_returns_its_first_token_before_the_others_prefill(model) -> None:
    """Two prompts land together; the short one's first token does not wait for the long one's prefill."""
    short = [(7 * j) % 2000 + 3 for j in range(10)]
    long = [(11 * j) % 2000 + 3 for j in range(200)]

    def run_both(generator: BatchGenerator) -> tuple[dict[int, list[int]], int]:
        """Tokens per uid, and the long prompt's prefill progress in the step returning the short's first token."""
        short_uid, long_uid = generator.insert([short, long], max_tokens=[6, 6])
        out: dict[int, list[int]] = {short_uid: [], long_uid: []}
        done, progress_then, live = 0, None, {short_uid, long_uid}
        while live:
            progress, responses = generator.next()
            advanced = sum(p.progress[0] for p in progress if p.uid == long_uid) - done if progress else 0
            done += max(advanced, 0)
            for response in responses:
                if response.uid == short_uid and not out[short_uid]:
                    progress_then = advanced
                out[response.uid].append(response.token)
                if response.finish_reason is not None:
                    live.discard(response.uid)
        return out, progress_then

    plain_out, plain_progress = run_both(BatchGenerator(model, prefill_step_size=64))
    held = StallFreeBatchGenerator(model, prefill_step_size=64)
    held_out, held_progress = run_both(held)
    assert held_out == plain_out  # the same greedy tokens
    assert held.held_prefill_steps == 2
    assert plain_progress > 0   # mlx-lm: the short's first token comes back with a chunk of the long prompt
    assert held_progress == 0   # held: it comes back from a step that prefilled nothing


def test_next_turns_are_prefilled_one_at_a_time(model) -> None:
    """Short prompts after a long cached prefix: one in the prompt batch at a time, the same tokens."""
    history = [(5 * j) % 2000 + 3 for j in range(300)]
    cache = make_prompt_cache(model)
    model(mx.array([history]), cache=cache)
    mx.eval([c.state for c in cache])
    turns = [[(9 * j + k) % 2000 + 3 for j in range(20 + 3 * k)] for k in range(3)]

    def run_turns(generator: BatchGenerator) -> tuple[dict[int, list[int]], int]:
        uids = generator.insert(turns, max_tokens=[5] * 3, caches=[copy.deepcopy(cache) for _ in turns],
                                all_tokens=[history] * 3)
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        widest, live = 0, set(uids)
        while live:
            _, responses = generator.next()
            widest = max(widest, len(generator._prompt_batch))
            for response in responses:
                out[response.uid].append(response.token)
                if response.finish_reason is not None:
                    live.discard(response.uid)
        return out, widest

    plain_out, plain_widest = run_turns(BatchGenerator(model, prefill_step_size=64))
    ours = StallFreeBatchGenerator(model, prefill_step_size=64)
    ours_out, ours_widest = run_turns(ours)
    # Each turn is admitted alone and leaves in its one step, handing back its first token (`_lone_prompt_end`).
    assert plain_widest == 3 and ours_widest <= 1 and ours.first_tokens_at_prefill_end == 3
    assert ours_out == plain_out
    unended = StallFreeBatchGenerator(model, prefill_step_size=64, first_token_from_last_chunk=False)
    assert run_turns(unended) == (plain_out, 1)


def test_a_next_turn_is_reported_while_it_waits_or_prefills(model) -> None:
    """`prefilling_turn` (the scheduler then gives it one full-speed step): true for a short prompt after a
    long cached prefix until it streams, false for a fresh prompt of the same length."""
    history = [(5 * j) % 2000 + 3 for j in range(300)]
    cache = make_prompt_cache(model)
    model(mx.array([history]), cache=cache)
    mx.eval([c.state for c in cache])
    turn = [(9 * j) % 2000 + 3 for j in range(40)]
    generator = StallFreeBatchGenerator(model, prefill_step_size=8)
    generator.insert([turn], max_tokens=[3], caches=[copy.deepcopy(cache)], all_tokens=[history])
    assert generator.prefilling_turn()
    generator.next()
    assert generator.prefilling_turn()  # an 8-token chunk taken: the rest still waits
    for _ in range(20):
        if not generator._prompt_batch.uids and not generator._unprocessed_sequences:
            break
        generator.next()
    assert not generator.prefilling_turn()
    fresh = StallFreeBatchGenerator(model, prefill_step_size=8)
    fresh.insert([turn], max_tokens=[3])
    assert not fresh.prefilling_turn()


def test_a_prompt_ending_in_a_fused_step_streams_two_steps_sooner(model) -> None:
    """Its last token rides in the decode pass with the rest of its last chunk; that step hands back its first token."""
    prompts = [[(5 * i + j) % 2000 + 3 for j in range(4 + 2 * i)] for i in range(3)]
    late = [(11 * j) % 2000 + 3 for j in range(70)]
    plain_steps: dict[int, int] = {}
    ended_steps: dict[int, int] = {}
    # Inserted at step 3: at step 2 the first prompts' first tokens are due, and that step prefills nothing.
    plain, _ = run(BatchGenerator(model, prefill_step_size=16), prompts, late, 3, 30, plain_steps)
    ended, generator = run(StallFreeBatchGenerator(model, prefill_step_size=16), prompts, late, 3, 30, ended_steps)
    assert ended == plain  # every token once, max_tokens (8 for the late one) included
    assert generator.first_tokens_at_prefill_end == 1 and generator.deferred_joins == 0
    late_uid = max(plain)
    # mlx-lm: 5 chunks, a step for the last token's own pass, a step to hand its token back; here the 5 chunks.
    assert ended_steps[late_uid] == plain_steps[late_uid] - 2 == -(-(len(late) - 1) // 16)


def test_an_ending_chunk_limit_ends_the_prompt_in_a_step_of_its_own(model) -> None:
    """`ending_chunk` (room for the join): a rest over it is prefilled first, then the last token ends the prompt."""
    prompts = [[(5 * i + j) % 2000 + 3 for j in range(4 + 2 * i)] for i in range(3)]
    late = [(11 * j) % 2000 + 3 for j in range(70)]
    plain_steps: dict[int, int] = {}
    limited_steps: dict[int, int] = {}
    plain, _ = run(BatchGenerator(model, prefill_step_size=16), prompts, late, 3, 30, plain_steps)
    limited = StallFreeBatchGenerator(model, prefill_step_size=16)
    limited.ending_chunk = 2
    ended, generator = run(limited, prompts, late, 3, 30, limited_steps)
    assert ended == plain
    assert generator.first_tokens_at_prefill_end == 1 and generator.deferred_joins == 0
    late_uid = max(plain)
    # 4 chunks of 16, the rest of 5 (over the limit of 2) on its own, then the last token's step hands back its token.
    assert limited_steps[late_uid] == plain_steps[late_uid] - 1 == 6


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_first_token_handed_back_early_counts_once(model, max_tokens: int) -> None:
    """max_tokens 1 ends the request at its early first token (it never joins the decode batch); 2 at the next."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]  # prefilled together: mlx-lm's path
    late = [(3 * j) % 2000 + 3 for j in range(40)]
    plain, _ = run(BatchGenerator(model, prefill_step_size=64), prompts, late, 2, 10, max_tokens=[max_tokens])
    ended, generator = run(StallFreeBatchGenerator(model, prefill_step_size=64), prompts, late, 2, 10,
                           max_tokens=[max_tokens])
    assert ended == plain and len(ended[2]) == max_tokens
    assert generator.first_tokens_at_prefill_end == 1
    assert len(generator._generation_batch) == 0 and not generator._pending


def test_a_first_token_handed_back_early_can_end_on_a_stop_sequence(model) -> None:
    """The matcher that saw the early first token goes on: a stop sequence spanning it still fires."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]  # prefilled together: mlx-lm's path
    late = [(3 * j) % 2000 + 3 for j in range(40)]
    plain, _ = run(BatchGenerator(model, prefill_step_size=64), prompts, late, 2, 20)
    expected = plain[2]
    stops = StopSequences([expected[0:3]])
    ended, generator = run(StallFreeBatchGenerator(model, prefill_step_size=64), prompts, late, 2, 20,
                           stop_sequences=[stops])
    assert generator.first_tokens_at_prefill_end == 1
    matcher, cut = StopSequences([expected[0:3]]).matcher(), []
    for token in expected:
        cut.append(token)
        if matcher.advance(token):
            break
    assert ended[2] == cut and len(cut) == 3


def test_a_lone_prompt_hands_back_its_first_token_from_its_last_chunk(model) -> None:
    """Nothing decoding: the last chunk's own pass gives the logits; the same tokens, two steps sooner."""
    prompt = [(13 * j) % 2000 + 3 for j in range(40)]

    def steps_to_first(generator: BatchGenerator) -> tuple[list[int], int]:
        (uid,) = generator.insert([prompt], max_tokens=[6])
        out, steps = [], 0
        while len(out) < 6:
            steps += 1
            out += [r.token for r in generator.next()[1] if r.uid == uid]
            if out and steps_to_first.first is None:
                steps_to_first.first = steps
        first, steps_to_first.first = steps_to_first.first, None
        return out, first

    steps_to_first.first = None
    plain, plain_first = steps_to_first(BatchGenerator(model, prefill_step_size=16))
    generator = StallFreeBatchGenerator(model, prefill_step_size=16)
    ours, ours_first = steps_to_first(generator)
    assert ours == plain and ours_first == plain_first - 2 == 3
    assert generator.first_tokens_at_prefill_end == 1 and generator.fused_steps == 0


def test_a_prompt_ending_in_a_fused_step_keeps_its_logits_processors(model) -> None:
    """Its logits processors see the whole prompt, last token included, as on mlx-lm's path."""
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    late = [(7 * j) % 500 + 3 for j in range(40)]

    def echo_last(context: mx.array, logits: mx.array) -> mx.array:
        """Picks the context's last token: the prompt's own last token for the first one generated."""
        return logits + 1e4 * (mx.arange(logits.shape[-1]) == context[-1])

    plain, _ = run(BatchGenerator(model, prefill_step_size=16), prompts, late, 2, 20, logits_processors=[[echo_last]])
    ended, generator = run(StallFreeBatchGenerator(model, prefill_step_size=16), prompts, late, 2, 20,
                           logits_processors=[[echo_last]])
    assert generator.first_tokens_at_prefill_end == 1
    assert ended == plain and ended[max(ended)] == [late[-1]] * 8


def test_a_next_turn_of_one_new_token_ends_in_the_decode_pass(model) -> None:
    """A prompt all cached but its last token: that token rides in a decode step instead of a pass of its own."""
    history = [(5 * j) % 2000 + 3 for j in range(120)]
    cache = make_prompt_cache(model)
    model(mx.array([history]), cache=cache)
    mx.eval([c.state for c in cache])
    prompts = [[5, 6, 7], [8, 9, 10, 11]]

    def with_turn(generator: BatchGenerator) -> dict[int, list[int]]:
        return run(generator, prompts, [42], 3, 12, caches=[copy.deepcopy(cache)], all_tokens=[history])[0]

    generator = StallFreeBatchGenerator(model, prefill_step_size=16)
    assert with_turn(generator) == with_turn(BatchGenerator(model, prefill_step_size=16))
    assert generator.first_tokens_at_prefill_end == 1 and generator.fused_steps == 1


def test_a_prompt_handing_back_its_first_token_holds_no_later_prefill(model) -> None:
    """A prompt whose last chunk was exactly the step's chunk ends with its last token alone, in a fused step that
    hands back its first token: the next prompt's prefill is not then held for that token."""
    first, second = [(7 * j) % 2000 + 3 for j in range(17)], [(11 * j) % 2000 + 3 for j in range(30)]

    def run_prompts(generator: BatchGenerator) -> dict[int, list[int]]:
        (stream,) = generator.insert([[5, 6, 7, 8]], max_tokens=[24])
        out: dict[int, list[int]] = {stream: []}
        live, step = {stream}, 0
        while live:
            if step in (3, 5):  # the first: one 16-token chunk, then its last token; the second right after
                (uid,) = generator.insert([first if step == 3 else second], max_tokens=[4])
                out[uid] = []
                live.add(uid)
            for response in generator.next()[1]:
                out[response.uid].append(response.token)
                if response.finish_reason is not None:
                    live.discard(response.uid)
            step += 1
        return out

    ours = StallFreeBatchGenerator(model, prefill_step_size=16)
    assert run_prompts(ours) == run_prompts(BatchGenerator(model, prefill_step_size=16))
    assert ours.first_tokens_at_prefill_end == 3 and ours.held_prefill_steps == 0


@pytest.mark.parametrize("streams", [3, 0])
def test_a_prompt_shared_the_step_it_joined_gives_the_joined_batchs_kv(model, streams: int) -> None:
    """`extract_cache` right after a prompt joined takes its own cache (`own_kv`): the KV mlx-lm's extract gives."""
    generator = StallFreeBatchGenerator(model, prefill_step_size=16)
    prompts = [[(5 * i + j) % 2000 + 3 for j in range(6 + 2 * i)] for i in range(streams)]
    generator.insert(prompts, max_tokens=[40] * streams)
    for _ in range(3):
        generator.next()
    late = [(11 * j) % 2000 + 3 for j in range(70)]
    (late_uid,) = generator.insert([late], max_tokens=[8])
    while not any(response.uid == late_uid for response in generator.next()[1]):
        pass
    assert late_uid in generator._ended  # it joined in this step: its own cache is at hand
    ours = generator.extract_cache([late_uid])[late_uid][0]
    theirs = BatchGenerator.extract_cache(generator, [late_uid])[late_uid][0]
    assert [c.offset for c in ours] == [c.offset for c in theirs] == [len(late)] * len(ours)
    for own, joined in zip(ours, theirs):
        assert mx.array_equal(own.keys, joined.keys).item() and mx.array_equal(own.values, joined.values).item()
    generator.next()
    assert not generator._ended  # only the step it joined in: later its KV holds generated tokens too


@pytest.mark.parametrize("ending", [True, False])
def test_a_prompt_prefilled_beside_streams_joins_into_buffers_made_ahead(model, ending: bool) -> None:
    """Every layer's join buffers were made during the late prompt's fused steps (`JoinReserve`), the same tokens."""
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(5 + 3 * i)] for i in range(3)]
    late = [(13 * j) % 2000 + 3 for j in range(150)]
    plain, _ = run(BatchGenerator(model, prefill_step_size=16), prompts, late, 3, 40)
    generator = StallFreeBatchGenerator(model, prefill_step_size=16, first_token_from_last_chunk=ending)
    taken: list[bool] = []
    take = generator.join_reserve.take

    def spied(*args: Any) -> Any:
        got = take(*args)
        taken.append(got is not None)
        return got

    generator.join_reserve.take = spied
    mx.reset_peak_memory()  # as in a fresh engine: the join is the most memory the process has held
    out, _ = run(generator, prompts, late, 3, 40)
    assert out == plain
    assert taken == [True] * len(model.model.layers)  # one join, every layer written into a reserved buffer
