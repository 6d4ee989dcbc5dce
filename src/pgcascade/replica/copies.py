"""The worker's side of the copy state machine: starting copy processes and handing over.

The worker owns two states of a table (see state.py): NULL, where it starts a copy process
(at most `parallel_copies` at once) and sets in-copy, and wanna-sync:T, where once it has
applied tick T it sets do-sync:<its tick>.  A copy process is `pgcascade CONF copy TABLE`, a
child of the worker; one started by an earlier worker is recognised by its pid and command line
(pids are reused: a stranger is never signalled).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg

from pgcascade.core import pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import pid_alive
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber
from pgcascade.replica.copy import BulkCopier, copy_consumer_name
from pgcascade.replica.state import Phase, TableState

log = logging.getLogger("pgcascade.replay")


def is_copy_process(pid: int) -> bool:
    """Whether `pid` runs a pgcascade copy (pids are reused: never signal a stranger)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"pgcascade" in args and b"copy" in args


class CopyLauncher:
    """The copy processes of one worker."""

    def __init__(self, cfg: JobConfig, queue: str, bulk: BulkCopier | None):
        self.cfg = cfg
        self.queue = queue
        self.bulk = bulk
        self.copies: dict[str, subprocess.Popen] = {}

    def manage(
        self, sub: psycopg.Connection, node: nodes.Node, tables: list[subscriber.SubscriberTable]
    ) -> bool:
        """Hand tables over and start copies; whether any table's state changed."""
        for name in [n for n, p in self.copies.items() if p.poll() is not None]:
            del self.copies[name]
        changed = False
        for t in tables:
            if t.state.is_ok:
                continue
            if t.state.phase is Phase.WANNA_SYNC:
                changed = self.hand_over(sub, node, t) or changed
            if self.running(t):
                continue
            if t.state.phase is Phase.NEW:
                if len(self.copies) >= self.cfg.worker.parallel_copies:
                    continue
                if self.bulk is not None:
                    self.bulk.forget(sub, self.queue, t.table_name)  # a new copy: an old plan goes
                subscriber.set_state(sub, self.queue, t.table_name, states.IN_COPY)
                log.info("%s: starting initial copy", t.table_name)
                changed = True
            self.launch(t.table_name)
        return changed

    def drop_stale_consumers(
        self, prov: psycopg.Connection, node: nodes.Node, tables: list[subscriber.SubscriberTable]
    ) -> None:
        """Unregister from the provider the copy consumers of tables no copy is at work on (a
        release before this one could leave one behind when the provider went away as a copy
        finished): each holds the provider's ticks and events back."""
        copying = {t.table_name for t in tables if t.state.phase not in (Phase.NEW, Phase.OK)}
        prefix = copy_consumer_name(node.consumer, "")
        for name in q.consumers_named(prov, self.queue, prefix):
            if name[len(prefix) :] not in copying:
                log.info("unregistering %s: no copy of its table is at work", name)
                with contextlib.suppress(psycopg.errors.NoDataFound):
                    q.unregister_consumer(prov, self.queue, name)

    def hand_over(self, sub: psycopg.Connection, node: nodes.Node, t: subscriber.SubscriberTable) -> bool:
        """wanna-sync:T -> do-sync:<our tick> once this worker has applied T."""
        wanted = t.state.tick or 0
        if node.last_tick is None or node.last_tick < wanted:
            return False
        subscriber.set_state(sub, self.queue, t.table_name, TableState.do_sync(node.last_tick))
        log.info("%s: wanna-sync:%d -> do-sync:%d", t.table_name, wanted, node.last_tick)
        return True

    def running(self, t: subscriber.SubscriberTable) -> bool:
        p = self.copies.get(t.table_name)
        if p is not None and p.poll() is None:
            return True
        # a copy started by an earlier worker may still be at work
        return t.copy_pid is not None and pid_alive(t.copy_pid) and is_copy_process(t.copy_pid)

    def launch(self, table: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "pgcascade",
            "-q",
            str(self.cfg.path),
            "copy",
            table,
            "--queue",
            self.queue,
        ]
        self.copies[table] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def stop_all(self) -> None:
        """SIGTERM to every copy process of this node, ours or an earlier worker's (Londiste's -s/-k rule)."""
        pids = {p.pid for p in self.copies.values() if p.poll() is None}
        # a connection of its own: this also runs in the SIGTERM handler, which may have
        # interrupted the main connection's query (its lock is held: using it would hang)
        with (
            contextlib.suppress(psycopg.Error),
            pgconn.connect(self.cfg.db or "", autocommit=True, connect_timeout=5) as conn,
        ):
            pids |= {t.copy_pid for t in subscriber.tables(conn, self.queue) if t.copy_pid}
        for pid in pids:
            if pid_alive(pid) and is_copy_process(pid):
                log.info("stopping copy process %d", pid)
                os.kill(pid, signal.SIGTERM)
        for p in self.copies.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
