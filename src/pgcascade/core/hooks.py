"""The one test hook in production code: a named point where a process can be made to wait.

Failure tests must SIGKILL a daemon at an exact step of a protocol (copied but not recorded,
written but not committed, ...).  With PGCASCADE_PAUSE_AT=NAME in its environment a process
logs "pause point NAME (pid N)" when it reaches that point and sleeps there
(PGCASCADE_PAUSE_SECONDS, default 60).  PGCASCADE_PAUSE_TABLE narrows it to one table and
PGCASCADE_PAUSE_MIN_EVENTS to a round with at least that many events.  Unset, it costs one
dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("pgcascade")


def pause_point(name: str, table: str | None = None, events: int | None = None) -> None:
    env = os.environ
    if env.get("PGCASCADE_PAUSE_AT") != name:
        return
    if table is not None and env.get("PGCASCADE_PAUSE_TABLE") not in (None, table):
        return
    if events is not None and events < int(env.get("PGCASCADE_PAUSE_MIN_EVENTS", "1")):
        return
    log.info("pause point %s (pid %d)", name, os.getpid())
    time.sleep(float(env.get("PGCASCADE_PAUSE_SECONDS", "60")))
