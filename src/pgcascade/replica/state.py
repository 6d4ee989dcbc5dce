"""The copy state machine of a subscriber's table (seed 000), as a type.

    NULL -> in-copy -> catching-up -> wanna-sync:T -> do-sync:T -> ok

`subscriber_table.state` stores it as the seed's text (NULL, 'in-copy', ..., 'wanna-sync:1234');
this module is the only place that reads or writes that text.  Each phase has one owner, the
only process that moves a table out of it:

| phase        | owner  | what happens                                                        |
|--------------|--------|---------------------------------------------------------------------|
| NULL (new)   | worker | starts a copy process and sets in-copy                              |
| in-copy      | copy   | copies the rows under a snapshot, sets catching-up                  |
| catching-up  | copy   | replays the table's events since the snapshot, sets wanna-sync:T    |
| wanna-sync:T | worker | goes no further than tick T; once there, sets do-sync:<its tick>    |
| do-sync:T    | copy   | catches up to exactly T (the worker waits), sets ok                 |
| ok           | worker | applies the table's events with every other table                   |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    NEW = "NULL"
    IN_COPY = "in-copy"
    CATCHING_UP = "catching-up"
    WANNA_SYNC = "wanna-sync"
    DO_SYNC = "do-sync"
    OK = "ok"


class Owner(enum.Enum):
    WORKER = "worker"
    COPY = "copy process"


OWNERS = {
    Phase.NEW: Owner.WORKER,
    Phase.IN_COPY: Owner.COPY,
    Phase.CATCHING_UP: Owner.COPY,
    Phase.WANNA_SYNC: Owner.WORKER,
    Phase.DO_SYNC: Owner.COPY,
    Phase.OK: Owner.WORKER,
}
WITH_TICK = (Phase.WANNA_SYNC, Phase.DO_SYNC)


@dataclass(frozen=True)
class TableState:
    phase: Phase
    tick: int | None = None  # wanna-sync and do-sync only: the tick of the hand-over

    def __post_init__(self) -> None:
        if (self.phase in WITH_TICK) != (self.tick is not None):
            raise ValueError(f"{self.phase.value}: a tick goes with wanna-sync and do-sync only")

    @classmethod
    def parse(cls, text: str | None) -> TableState:
        """The stored text -> a state; ValueError for text that is no state."""
        if text is None:
            return NEW
        name, sep, tick = text.partition(":")
        try:
            phase = Phase(name)
        except ValueError:
            raise ValueError(f"not a table state: {text!r}") from None
        if phase is Phase.NEW:
            raise ValueError(f"not a table state: {text!r}")
        if not sep:
            return cls(phase)
        if not tick.isdigit():
            raise ValueError(f"not a table state: {text!r}")
        return cls(phase, int(tick))

    def stored(self) -> str | None:
        """The text kept in subscriber_table.state (None for NULL)."""
        if self.phase is Phase.NEW:
            return None
        return self.phase.value if self.tick is None else f"{self.phase.value}:{self.tick}"

    def __str__(self) -> str:
        return self.stored() or "NULL"

    @property
    def owner(self) -> Owner:
        return OWNERS[self.phase]

    @property
    def is_ok(self) -> bool:
        return self.phase is Phase.OK

    @staticmethod
    def wanna_sync(tick: int) -> TableState:
        return TableState(Phase.WANNA_SYNC, tick)

    @staticmethod
    def do_sync(tick: int) -> TableState:
        return TableState(Phase.DO_SYNC, tick)


NEW = TableState(Phase.NEW)
IN_COPY = TableState(Phase.IN_COPY)
CATCHING_UP = TableState(Phase.CATCHING_UP)
OK = TableState(Phase.OK)
