"""Engine groups' pure parts: the step plan's encoding, the token checksum, settings and refusals."""

from __future__ import annotations

import argparse
import json

import pytest

from engine_daemon.group.checksum import TokenChecksum, mismatched_ranks
from engine_daemon.group.lockstep import agree_seed
from engine_daemon.group.options import add_group_arguments, group_refusal
from engine_daemon.group.plan import AddOp, StepPlan
from engine_daemon.group.settings import default_control, from_environment


def test_a_plan_round_trips_with_its_ops_in_order() -> None:
    plan = StepPlan(7, [("add", AddOp(3, [1, 2, 3], 16, {"temperature": 1.0, "seed": 2**62}, [0, 5])),
                        ("remove", [1, 2]), ("store", [3, 0]), ("evict", [0, 5]),
                        ("add", AddOp(4, [9], 1, {}, [], cached=40, entry=5, entry_len=60))],
                    prefill_step_size=64, step=True, checksum=True)
    again = StepPlan.decode(plan.encode())
    assert again == plan
    assert [kind for kind, _ in again.ops] == ["add", "remove", "store", "evict", "add"]


def test_a_plan_of_another_version_or_op_is_refused() -> None:
    import msgpack

    with pytest.raises(ValueError, match="version"):
        StepPlan.decode(msgpack.packb([99, 0, [], 1, False, False, False, False]))
    with pytest.raises(ValueError, match="unknown"):
        StepPlan.decode(msgpack.packb([3, 0, [["switch", 1]], 1, False, False, False, False]))


def test_an_idle_plan_is_small_enough_for_one_round_trip() -> None:
    from engine_daemon.group.wire import HEADER

    assert len(StepPlan(10**9, [("remove", list(range(20)))], idle=True).encode()) < HEADER - 4


def test_checksums_depend_on_tokens_and_their_owners() -> None:
    a, b, c = TokenChecksum(), TokenChecksum(), TokenChecksum()
    a.observe([(0, 5), (1, 7)])
    b.observe([(1, 7), (0, 5)])  # the same step seen in another order
    c.observe([(0, 7), (1, 5)])  # the tokens swapped between requests
    assert a.value == b.value != c.value
    assert mismatched_ranks([a.value, b.value]) == []
    assert mismatched_ranks([a.value, c.value, a.value]) == [1]


def test_sampled_requests_get_one_seed_for_every_rank() -> None:
    assert "seed" not in agree_seed({"temperature": 0.0})
    assert agree_seed({"temperature": 0.7, "seed": 5})["seed"] == 5
    assert isinstance(agree_seed({"temperature": 0.7})["seed"], int)


def test_the_control_endpoint_defaults_to_rank_0s_ring_address(tmp_path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5001"]]))
    assert default_control(str(hostfile)) == "tcp://10.0.0.1:5100"
    assert default_control(None) is None
    assert default_control(str(tmp_path / "missing")) is None


def test_group_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        from_environment("tp", "tcp://127.0.0.1:1", 0, 1, "ring", 60, 16, 3)
    with pytest.raises(ValueError, match="--group must be"):
        from_environment("dp", "tcp://127.0.0.1:1", 0, 2, "ring", 60, 16, 3)
    settings = from_environment("pp", "tcp://127.0.0.1:1", 1, 2, "ring", 5, -1, 3)
    assert not settings.leader and settings.checksum_every == 0


def test_adapters_draft_models_and_idle_unload_are_refused_in_a_group() -> None:
    parser = argparse.ArgumentParser()
    add_group_arguments(parser)
    args = parser.parse_args(["--group", "tp"])
    base = {"model": "m", "adapter_path": None, "draft_model": None, "idle_unload": None, "kv_bits": None,
            "prompt_cache_dir": None}
    assert group_refusal(argparse.Namespace(**vars(args), **base)) is None
    assert "--model" in group_refusal(argparse.Namespace(**vars(args), **{**base, "model": None}))
    refusal = group_refusal(argparse.Namespace(**vars(args), **{**base, "adapter_path": "a", "draft_model": "d"}))
    assert "--adapter-path" in refusal and "--draft-model" in refusal
    assert "--prompt-cache-dir" in group_refusal(argparse.Namespace(**vars(args), **{**base, "prompt_cache_dir": "d"}))


def _kv(tokens: int) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, tokens, 4)), mx.zeros((1, 2, tokens, 4)))
    return [cache]


def test_rank_0s_prompt_cache_names_every_store_reuse_and_eviction() -> None:
    """What followers replay: a store per kept entry, the entry id and lengths a reuse took, every eviction."""
    from engine_daemon.prefix_cache.planned import PlannedPrefixCache

    ops: list = []
    cache = PlannedPrefixCache(2, 1 << 40, lambda uid, entry: ops.append(("store", uid, entry)),
                               lambda entries: ops.append(("evict", entries)))
    key = ("model", None)
    cache.insert_planned(key, [1, 2, 3, 4, 5, 6], _kv(6), uid=10)
    kv, cached, entry, entry_len = cache.fetch_planned(key, [1, 2, 3, 9, 9])
    assert (cached, entry, entry_len) == (3, 0, 6) and kv[0].offset == 3  # cut back to the shared prefix
    assert cache.fetch_planned(key, [7, 7])[:3] == (None, 0, -1)
    cache.insert_planned(key, [7, 8, 9], _kv(3), uid=11)
    cache.insert_planned(key, [5, 5, 5], _kv(3), uid=12)  # over 2 entries: the least recently used leaves
    assert ops == [("store", 10, 0), ("store", 11, 1), ("store", 12, 2), ("evict", [0])]
    cache.spill_all()  # no disk tier in a group: everything is evicted on every rank
    assert ops[-1] == ("evict", [1, 2])


def test_tensor_parallelism_needs_heads_divisible_by_the_ranks() -> None:
    from engine_daemon.models.sharded import check_heads

    check_heads({"num_attention_heads": 4, "num_key_value_heads": 2}, 2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_heads({"num_attention_heads": 2, "num_key_value_heads": 1}, 2)
