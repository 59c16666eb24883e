"""The router's pure functions: affinity key precedence, rendezvous order, bounded load, failover order."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from http_frontend.engine.pool import EnginePool
from http_frontend.engine.pool_config import parse_specs, split_endpoints
from http_frontend.engine.routing import Candidate, affinity_key, load_bound, pick, rendezvous_order, stable_hash

ENGINES = ["a", "b"]
CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}


def idle(*ids: str) -> list[Candidate]:
    return [Candidate(engine_id, 0) for engine_id in ids]


def test_key_precedence_headers_first_in_order() -> None:
    headers = {"x-session-affinity": "A", "x-session-id": "B", "session-id": "C", "x-claude-code-session-id": "D"}
    assert affinity_key(headers, previous_response_id="r", prompt_cache_key="k", user="u") == "h:A"
    del headers["x-session-affinity"]
    assert affinity_key(headers) == "h:B"
    del headers["x-session-id"]
    assert affinity_key(headers) == "h:C"
    del headers["session-id"]
    assert affinity_key(headers) == "h:D"


def test_key_precedence_body_hints() -> None:
    assert affinity_key({}, previous_response_id="r", prompt_cache_key="k", user="u", engine_request=CHAT) == "r:r"
    assert affinity_key({}, prompt_cache_key="k", user="u", engine_request=CHAT) == "k:k"
    assert affinity_key({}, user="u", engine_request=CHAT) == "u:u"
    assert affinity_key({"x-session-id": ""}, engine_request=CHAT).startswith("c:")


def test_conversation_key_is_the_same_on_every_turn() -> None:
    later = {**CHAT, "messages": CHAT["messages"] + [{"role": "assistant", "content": "hello"},
                                                     {"role": "user", "content": "more"}]}
    assert affinity_key({}, engine_request=CHAT) == affinity_key({}, engine_request=later)
    other = {**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": "bye"}]}
    assert affinity_key({}, engine_request=CHAT) != affinity_key({}, engine_request=other)
    parts = {**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert affinity_key({}, engine_request=parts) == affinity_key({}, engine_request=CHAT)
    assert affinity_key({}, engine_request={"model": "m", "prompt": "abc"}).startswith("p:")


def test_hash_is_stable_across_processes() -> None:
    """blake2b, never the salted hash(): another interpreter (another worker, host) agrees."""
    code = ("from http_frontend.engine.routing import rendezvous_order, stable_hash;"
            "print(stable_hash('x', 'y'), rendezvous_order('k1', ['a', 'b', 'c']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout.split(maxsplit=1)
    assert int(out[0]) == stable_hash("x", "y")
    assert out[1].strip() == str(rendezvous_order("k1", ["a", "b", "c"]))


def test_rendezvous_spreads_keys_and_moves_only_the_lost_engines_keys() -> None:
    keys = [f"conv-{i}" for i in range(2000)]
    three = {key: pick(key, idle("a", "b", "c")) for key in keys}
    shares = Counter(three.values())
    assert all(600 <= shares[e] <= 730 for e in "abc"), shares
    two = {key: pick(key, idle("a", "b")) for key in keys}
    moved = [key for key in keys if three[key] != two[key]]
    assert all(three[key] == "c" for key in moved)  # only c's keys moved
    assert two == {key: pick(key, idle("b", "a")) for key in keys}  # candidate order does not matter


def test_failover_takes_the_next_engine_in_rendezvous_order() -> None:
    for i in range(200):
        key = f"k{i}"
        order = rendezvous_order(key, ["a", "b", "c"])
        down = [Candidate(e, 0, routable=e != order[0]) for e in "abc"]
        assert pick(key, down) == order[1]
    assert pick("k", [Candidate("a", 0, routable=False)]) is None


def test_bounded_load_skips_an_engine_over_its_bound() -> None:
    assert load_bound(0, 2, 0.25) == 1  # one request on an idle pool stays with the preferred engine
    key = "hot"
    first, second = rendezvous_order(key, ENGINES)
    loads = {"a": 0, "b": 0}
    for _ in range(64):
        chosen = pick(key, [Candidate(e, loads[e]) for e in ENGINES], 0.25)
        loads[chosen] += 1
    assert loads[first] > loads[second] > 0
    assert max(loads.values()) <= 1.25 * (sum(loads.values()) / 2)


def test_small_counts_stay_on_the_preferred_engine() -> None:
    first, _ = rendezvous_order("k", ENGINES)
    assert pick("k", [Candidate(first, 1), Candidate("b" if first == "a" else "a", 0)], 0.25) == first


def test_min_bound_keeps_light_imbalance_on_the_preferred_engine() -> None:
    first, second = rendezvous_order("k", ENGINES)
    loads = [Candidate(first, 6), Candidate(second, 0)]
    assert pick("k", loads, 0.25) == second  # 7 > ceil(1.25 * 7 / 2) = 5
    assert pick("k", loads, 0.25, min_bound=8) == first  # 7 <= 8: the conversation keeps its cache
    assert pick("k", [Candidate(first, 8), Candidate(second, 0)], 0.25, min_bound=8) == second


def test_preferred_engine_and_model_filter() -> None:
    key = "k"
    _, second = rendezvous_order(key, ENGINES)
    assert pick(key, idle(*ENGINES), preferred=second) == second
    assert pick(key, [Candidate("a", 0, serves_model=False), Candidate("b", 0)]) == "b"
    assert pick(key, [Candidate("a", 0, serves_model=False), Candidate("b", 0, serves_model=False)]) in ENGINES


def test_endpoint_specs() -> None:
    specs = parse_specs(["one=ipc:///tmp/a.sock", "tcp://10.0.0.2:5555"])
    assert specs[0].engine_id == "one" and specs[0].endpoint == "ipc:///tmp/a.sock"
    assert specs[1].engine_id.startswith("e") and specs[1].endpoint == "tcp://10.0.0.2:5555"
    assert parse_specs(["tcp://10.0.0.2:5555"])[0].engine_id == specs[1].engine_id  # the same on every host
    assert split_endpoints("ipc:///a, tcp://h:1") == ["ipc:///a", "tcp://h:1"]
    assert split_endpoints(f"a=ipc:///x{os.pathsep}tcp://h:1{os.pathsep}b=tcp://[::1]:2") == \
        ["a=ipc:///x", "tcp://h:1", "b=tcp://[::1]:2"]
    with pytest.raises(ValueError):
        parse_specs(["a=ipc:///x", "a=ipc:///y"])
    with pytest.raises(ValueError):
        parse_specs(["bad_name=ipc:///x"])
    with pytest.raises(ValueError):
        parse_specs(["ipc:///x", "ipc:///y"], ["k1", "k2", "k3"])


class Link:
    """A stand-in engine client with the members the pool reads."""

    def __init__(self, load: int = 0, alive: bool = True, state: str = "ready"):
        self.frontend_id, self.streams, self.load, self.alive, self.engine_state = "f", {}, load, alive, state
        self.model = None

    @property
    def routable(self) -> bool:
        return self.alive and self.engine_state == "ready"


def test_pool_response_ids_name_their_engine() -> None:
    pool = EnginePool({"a": Link(), "b": Link()})
    assert pool.response_id("abc", "b") == "resp_b_abc"
    assert pool.engine_of_response("resp_b_abc") == "b"
    assert pool.engine_of_response("resp_abc") == ""
    single = EnginePool({"a": Link()})
    assert single.response_id("abc", "a") == "resp_abc"


def test_pool_skips_draining_and_dead_engines() -> None:
    links = {"a": Link(), "b": Link()}
    pool = EnginePool(links)
    from http_frontend.engine.pool import RouteHint

    key = "k"
    first, second = rendezvous_order(key, ENGINES)
    assert pool.choose(RouteHint(key)) == first
    links[first].engine_state = "draining"
    assert pool.choose(RouteHint(key)) == second
    links[first].engine_state, links[second].alive = "ready", False
    assert pool.choose(RouteHint(key)) == first


def test_calls_naming_a_model_go_first_to_an_engine_serving_it() -> None:
    """Red team: /v1/tokenize and count_tokens for engine b's model were sent to engine a (primary): 404."""
    import asyncio

    class Answering(Link):
        def __init__(self, name: str, model: str):
            super().__init__()
            self.name, self.model = name, model

        async def call(self, method, args=None, timeout=5.0):  # noqa: ANN001
            return {"engine": self.name}

    pool = EnginePool({"a": Answering("a", "alpha"), "b": Answering("b", "beta")})
    assert asyncio.run(pool.call("tokenize", {"model": "beta"}))["engine"] == "b"
    assert asyncio.run(pool.call("tokenize", {"model": "alpha"}))["engine"] == "a"
    assert asyncio.run(pool.call("tokenize", {"model": "gamma"}))["engine"] == "a"  # none serves it: the primary
    pool.links["b"].alive = False
    assert asyncio.run(pool.call("tokenize", {"model": "beta"}))["engine"] == "a"  # b is down: another answers


def test_a_model_no_engine_serves_goes_to_an_idle_engine() -> None:
    """Red team: a request for a model whose engine was down went to a busy engine, which ran its streams out,
    switched models and switched back (18-37 s for that request)."""
    for key in (f"k{i}" for i in range(20)):
        busy = [Candidate("a", 3, serves_model=False), Candidate("b", 0, serves_model=False),
                Candidate("c", 1, serves_model=False)]
        assert pick(key, busy) == "b"
        assert pick(key, [Candidate("a", 3, serves_model=False), Candidate("c", 1, serves_model=False)]) in "ac"
        serving = [Candidate("a", 3, serves_model=True), Candidate("b", 0, serves_model=False)]
        assert pick(key, serving) == "a"  # an engine that serves it still wins


def test_a_spelling_is_an_engines_model_only_when_that_engine_says_it_runs_on_it() -> None:
    """Several engines: `qwen/` or a name under --model-dir is engine a's `/models/qwen`; an alias of the same
    weights with its own settings (another id), a name an engine does not know, or a silent engine is not."""
    import asyncio

    from http_frontend.engine.client import EngineError, EngineUnavailable
    from http_frontend.engine.model_names import RETRY_SECONDS, ModelSpellings

    class Resolving(Link):
        def __init__(self, model: str, answers: dict):
            super().__init__()
            self.model, self.answers, self.asked = model, answers, []

        async def call(self, method, args=None, timeout=5.0):  # noqa: ANN001
            self.asked.append(args["model"])
            answer = self.answers.get(args["model"])
            if answer is None:
                raise EngineError({"status": 404, "code": "model_not_found", "message": "unknown"})
            if isinstance(answer, Exception):
                raise answer
            return answer

    now = [0.0]
    links = {"a": Resolving("/models/qwen", {"qwen": {"id": "/models/qwen"}, "fast": {"id": "fast"},
                                             "slow": EngineUnavailable("silent")}),
             "b": Resolving("/models/llama", {"qwen": {"id": "qwen"}})}
    spellings = ModelSpellings(clock=lambda: now[0])
    for name in ("qwen", "fast", "slow", "nope"):
        asyncio.run(spellings.learn(name, links, lambda engine_id: True))
    assert spellings.serves("a", "/models/qwen", "qwen") and not spellings.serves("b", "/models/llama", "qwen")
    assert not spellings.serves("a", "/models/qwen", "fast")  # an alias: its own model, never routed as a's
    assert not spellings.serves("a", "/models/qwen", "nope") and not spellings.serves("a", "/models/qwen", "slow")
    assert not spellings.serves("a", "/models/other", "qwen")  # learned for the model a had then, not another
    asyncio.run(spellings.learn("qwen", links, lambda engine_id: True))
    assert links["a"].asked.count("qwen") == 1  # remembered
    now[0] = RETRY_SECONDS + 0.1
    asyncio.run(spellings.learn("slow", links, lambda engine_id: True))
    assert links["a"].asked.count("slow") == 2 and links["a"].asked.count("qwen") == 1  # the silent one is asked again
    asyncio.run(spellings.learn("/models/qwen", links, lambda engine_id: True))
    assert "/models/qwen" not in links["a"].asked  # its own name: never asked


def test_a_learned_spelling_expires_for_routing_but_is_kept_for_an_engine_that_is_down() -> None:
    """Red team: `ModelSpellings.serves` ignored its 60 s expiry (an answer held forever: directories under
    --model-dir come and go); the last answer still names a down engine's model (`answered`)."""
    import asyncio

    from http_frontend.engine.model_names import LEARNED_SECONDS, ModelSpellings

    class Resolving(Link):
        def __init__(self) -> None:
            super().__init__()
            self.model = "/models/qwen"

        async def call(self, method, args=None, timeout=5.0):  # noqa: ANN001
            return {"id": "/models/qwen"}

    now = [0.0]
    spellings = ModelSpellings(clock=lambda: now[0])
    asyncio.run(spellings.learn("qwen", {"a": Resolving()}, lambda engine_id: True))
    assert spellings.serves("a", "/models/qwen", "qwen")
    now[0] = LEARNED_SECONDS + 1
    assert not spellings.serves("a", "/models/qwen", "qwen")  # stale: asked again before it routes
    assert spellings.answered("a", "/models/qwen", "qwen") and not spellings.answered("a", "/models/qwen", "nope")


def test_a_down_engines_catalogue_names_its_model_in_every_worker() -> None:
    """Red team: with engine b down, a request for `tiny-b` (b's model under its --model-dir) got b's 503 from a
    worker that had once resolved that spelling and engine a's 404 from the others. Every worker lists every
    engine's catalogue at start; the last one stays while the engine is down."""
    import asyncio

    class Listing(Link):
        def __init__(self, model: str, ids: list[str]):
            super().__init__()
            self.model, self.ids, self.epoch, self.listed = model, ids, 1, 0

        async def call(self, method, args=None, timeout=5.0):  # noqa: ANN001
            assert method == "list_models"
            self.listed += 1
            return [{"id": model_id} for model_id in self.ids]

    links = {"a": Listing("/m/a/tiny-a", ["/m/a/tiny-a", "tiny-a"]), "b": Listing("bee", ["bee", "tiny-b"])}
    pool = EnginePool(links)
    assert not pool.serves_while_down("tiny-b")  # nothing listed yet

    async def one_round() -> None:
        started = pool.catalogues.refresh()
        await asyncio.wait(started)
        assert not pool.catalogues.refresh()  # listed for this epoch and model: not again before 60 s

    asyncio.run(one_round())
    assert links["a"].listed == links["b"].listed == 1
    assert not pool.serves_while_down("tiny-b")  # b is up: its own refusals are its own
    links["b"].alive = False
    for name in ("bee", "tiny-b", "/srv/models/tiny-b", "/srv/models/tiny-b/", "./tiny-b"):
        assert pool.serves_while_down(name), name
    for name in ("tiny-a", "never-served", "org/tiny-b", "/srv/tiny-b-other", ""):
        assert not pool.serves_while_down(name), name
    assert pool.serves_while_down("tiny-a", down={"a"})  # a passed over by this request counts as down
    links["b"].epoch = 2  # even a restart is not listed before b answers again

    async def nothing_due() -> list:
        return pool.catalogues.refresh()

    assert asyncio.run(nothing_due()) == [] and links["b"].listed == 1  # its last catalogue stays


def test_no_engine_available_says_which_engines_refused_this_front_ends_protocol() -> None:
    links = {"a": Link(alive=False), "b": Link(alive=False)}
    links["b"].refusal = "Engine 'b' speaks protocol version 9, this front-end 1: upgrade one of them"
    pool = EnginePool(links)
    from http_frontend.engine.client import EngineUnavailable

    with pytest.raises(EngineUnavailable, match="Engine 'b' speaks protocol version 9"):
        pool.choose(None)
