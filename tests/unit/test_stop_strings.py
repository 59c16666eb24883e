"""Stop strings with hold-back: a partial stop string is never released."""

from engine_daemon.output.stop_strings import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    out = [matcher.feed(p) for p in pieces]
    return out


def test_stop_split_across_tokens_is_never_partially_sent() -> None:
    m = StopStringMatcher(["END"])
    assert feed_all(m, ["hello E", "N", "D more"]) == ["hello ", "", ""]
    assert m.matched == "END"


def test_false_alarm_is_released_later() -> None:
    m = StopStringMatcher(["END"])
    assert feed_all(m, ["a E", "Nx", "y"]) == ["a ", "ENx", "y"]
    assert m.matched is None
    assert m.flush() == ""


def test_held_text_is_flushed_at_the_end() -> None:
    m = StopStringMatcher(["</s>"])
    assert m.feed("abc</") == "abc"
    assert m.flush() == "</"


def test_earliest_of_several_stops_wins() -> None:
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"
    assert m.matched == "lo w"


def test_no_stops_passes_everything_through() -> None:
    m = StopStringMatcher(None)
    assert m.feed("abc") == "abc" and m.flush() == ""
