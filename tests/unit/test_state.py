"""The copy state machine's type: the seed's text round-trips, nothing else parses."""

import pytest

from pgcascade.replica import state as states
from pgcascade.replica.state import Owner, Phase, TableState


@pytest.mark.parametrize(
    "text, phase, tick",
    [
        (None, Phase.NEW, None),
        ("in-copy", Phase.IN_COPY, None),
        ("catching-up", Phase.CATCHING_UP, None),
        ("wanna-sync:1234", Phase.WANNA_SYNC, 1234),
        ("do-sync:7", Phase.DO_SYNC, 7),
        ("ok", Phase.OK, None),
    ],
)
def test_stored_text_round_trips(text, phase, tick):
    st = TableState.parse(text)
    assert (st.phase, st.tick) == (phase, tick)
    assert st.stored() == text
    assert str(st) == (text or "NULL")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "NULL",
        "OK",
        "wanna-sync",
        "wanna-sync:",
        "do-sync:x",
        "ok:3",
        "in-copy:5",
        "copying",
        "do-sync:-1",
    ],
)
def test_text_that_is_no_state_is_refused(text):
    with pytest.raises(ValueError, match=r"not a table state|a tick goes with"):
        TableState.parse(text)


def test_a_tick_goes_with_the_hand_over_states_only():
    with pytest.raises(ValueError):
        TableState(Phase.WANNA_SYNC)
    with pytest.raises(ValueError):
        TableState(Phase.OK, 5)
    assert TableState.wanna_sync(5) == TableState.parse("wanna-sync:5")
    assert TableState.do_sync(6).stored() == "do-sync:6"


def test_each_phase_has_the_owner_the_seed_gives_it():
    worker = {
        p
        for p in Phase
        if TableState(p, 1 if p in (Phase.WANNA_SYNC, Phase.DO_SYNC) else None).owner is Owner.WORKER
    }
    assert worker == {Phase.NEW, Phase.WANNA_SYNC, Phase.OK}
    assert states.OK.is_ok and not states.NEW.is_ok
    assert states.IN_COPY.owner is Owner.COPY and states.CATCHING_UP.owner is Owner.COPY
