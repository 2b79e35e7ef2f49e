from appliance.engine.stops import StopMatcher


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


def test_no_stops_passes_text_through():
    assert feed_all(StopMatcher(()), ["a", "b"]) == "ab"


def test_stop_inside_one_piece_cuts_before_it():
    m = StopMatcher(("END",))
    assert m.feed("hello END world") == "hello "
    assert m.stopped
    assert m.feed("more") == "" and m.flush() == ""


def test_stop_spanning_pieces_is_never_emitted():
    m = StopMatcher(("\n\nUser:",))
    emitted = [m.feed(p) for p in ["Hi", " there\n", "\nUs", "er:", " next"]]
    assert "".join(emitted) == "Hi there"
    assert m.stopped


def test_partial_match_that_fails_is_released():
    m = StopMatcher(("STOP",))
    assert m.feed("a ST") == "a "
    assert m.feed("ART") == "START"
    assert not m.stopped


def test_held_text_is_flushed_at_the_end():
    m = StopMatcher(("STOP",))
    assert m.feed("xx STO") == "xx "
    assert m.flush() == "STO"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(("b", "abc"))
    assert m.feed("xabc") == "x"


def test_empty_stop_strings_are_ignored():
    assert feed_all(StopMatcher(("",)), ["abc"]) == "abc"
