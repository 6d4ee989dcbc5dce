"""The worker: replays the provider's batches into this node, exactly once.

Per batch, one subscriber transaction (session_replication_role = replica) holds:
the check that the batch is not applied yet (node.last_tick), the staged events, their
set-based apply for the tables in state `ok`, the new last_tick, and the sequences.  Only
then is the batch finished on the provider.  Dying anywhere leaves either the batch applied
and recorded (then finished on restart without applying it again) or nothing.

A branch also carries the batch: the same transaction inserts every event into its own queue
(same ids) and makes the provider's tick with the same id, so every node with a queue presents
identical batches and a subscriber can move to any of them.  After its batches the worker
reports its watermark (the lowest tick it and the nodes below it need) to the provider.  A
root's worker waits: a takeover may make the node a branch.

Between batches the worker drives the copy state machine (seed 000), owning the states NULL
and wanna-sync:T; the copy processes it launches own the others (see copy.py):

    NULL -> in-copy -> catching-up -> wanna-sync:T -> do-sync:T -> ok

While a table is in wanna-sync:T the worker never goes past tick T (batches are capped at T);
once at or past T it hands over with do-sync:<its tick>, and it applies nothing while a table
is in do-sync, so the copy process catches up to exactly that tick before setting ok.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from pgcascade.core import pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon, pid_alive
from pgcascade.core.errors import UserError, db_error_line
from pgcascade.pgq import node as nodes
from pgcascade.pgq.queue import TICK_CHANNEL, BatchInfo
from pgcascade.pipeline.copy import forget_plan
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import (
    APPLY_SETTINGS,
    ApplyError,
    TableApplier,
    apply_staged,
    carry_staged,
    ensure_stage,
    merge_staged,
    stage_batch,
)

log = logging.getLogger("pgcascade.replay")

COPY_OWNED = ("in-copy", "catching-up", "do-sync")


def next_batch(
    prov: psycopg.Connection, queue: str, consumer: str, max_events: int | None, max_tick: int | None
) -> BatchInfo:
    with prov.cursor(row_factory=psycopg.rows.class_row(BatchInfo)) as cur:
        return cur.execute(
            "select * from pgcascade.next_batch_custom(%s, %s, %s, %s)",
            (queue, consumer, max_events, max_tick),
        ).fetchone()


def resume_at(prov: psycopg.Connection, queue: str, consumer: str, tick: int) -> None:
    """Put our consumer on the provider at `tick`, the last tick we applied durably."""
    prov.execute("select pgcascade.set_consumer_position(%s, %s, %s)", (queue, consumer, tick))


def state_tick(state: str | None) -> int | None:
    """wanna-sync:T / do-sync:T -> T."""
    if state and ":" in state:
        return int(state.split(":", 1)[1])
    return None


def provider_formats(prov: psycopg.Connection, queue: str) -> dict[str, str]:
    return dict(
        prov.execute(
            "select table_name, event_format from pgcascade.set_table where queue_name = %s", (queue,)
        )
    )


def provider_set_tables(prov: psycopg.Connection, queue: str) -> list[tuple]:
    return prov.execute(
        "select table_name, key_columns, event_format from pgcascade.set_table where queue_name = %s",
        (queue,),
    ).fetchall()


def sync_sequences(prov: psycopg.Connection, sub: psycopg.Connection, queue: str) -> None:
    """Move each followed sequence up to the provider's value (never down)."""
    seqs = subscriber.seqs(sub, queue)
    if not seqs:
        return
    values = dict(
        prov.execute(
            "select s, pg_sequence_last_value(s::regclass) from unnest(%s::text[]) s", ([s for s, _ in seqs],)
        ).fetchall()
    )
    for seq, dest in seqs:
        v = values.get(seq)
        if v is not None:
            sub.execute(
                "select setval(%s::regclass, %s) where %s > coalesce(pg_sequence_last_value(%s::regclass), 0)",
                (dest, v, v, dest),
            )


class Worker(Daemon):
    name = "worker"

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        if not cfg.queue_name:
            raise UserError(f"{cfg.path}: queue_name is not set")
        if not cfg.db:
            raise UserError(f"{cfg.path}: db is not set")
        self.queue = cfg.queue_name
        self.sub: psycopg.Connection | None = None
        self.prov: psycopg.Connection | None = None
        self.appliers: dict[str, TableApplier] = {}
        self.applier_key: tuple = ()
        self.copies: dict[str, subprocess.Popen] = {}
        self.prov_node: str | None = None  # the provider self.prov is connected to
        self.next_watermark = 0.0
        self.reload()

    def reload(self) -> None:
        raw = self.cfg.raw
        self.parallel_copies = int(raw.get("parallel_copies", 2))
        self.max_batch_events = int(raw.get("max_batch_events", 200000))
        self.loop_delay = float(raw.get("loop_delay", 1.0))
        self.watermark_period = float(raw.get("watermark_period", 1.0))

    # --- connections ---
    def connect(self) -> tuple[psycopg.Connection, psycopg.Connection | None, nodes.Node]:
        """Both connections; the provider's is None while this node is the root (a root's
        worker waits, in case a takeover makes it a branch)."""
        if self.sub is None or self.sub.closed:
            self.sub = pgconn.connect(self.cfg.db, autocommit=True, connect_timeout=10)
            self.sub.execute("set application_name = 'pgcascade worker'")
            ensure_stage(self.sub)
        node = nodes.require_node(self.sub, self.queue)
        if node.provider_node != self.prov_node and self.prov is not None:
            log.info("provider is now %s (was %s)", node.provider_node, self.prov_node)
            self.prov.close()
            self.prov = None
        if not node.role.reads_provider_queue:
            return self.sub, None, node
        if self.prov is None or self.prov.closed:
            self.prov = pgconn.connect(
                nodes.provider_location(self.sub, node), autocommit=True, connect_timeout=10
            )
            self.prov.execute(f"listen {TICK_CHANNEL}")
            self.prov_node = node.provider_node
        return self.sub, self.prov, node

    def drop_connections(self) -> None:
        for c in (self.sub, self.prov):
            if c is not None:
                c.close()
        self.sub = self.prov = None
        self.prov_node = None

    def sleep(self, seconds: float) -> None:
        """Wait for the provider's next tick (NOTIFY), at most `seconds`."""
        if self.prov is not None and not self.prov.closed:
            try:
                for _ in self.prov.notifies(timeout=seconds, stop_after=1):
                    pass
                return
            except psycopg.Error:
                self.drop_connections()
        time.sleep(seconds)

    # --- the loop ---
    def work(self) -> bool:
        try:
            sub, prov, node = self.connect()
            if prov is None or node.paused:
                return False
            if node.combined_queue and not self.combined_is_root(sub, node):
                self.follow_combined(prov, node)
                return False
            tables = subscriber.tables(sub, self.queue)
            if self.manage_copies(sub, node, tables):
                # read the states again: a table handed over (do-sync) must not be applied
                # past that tick until the copy process says ok
                tables = subscriber.tables(sub, self.queue)
            if any((t.state or "").startswith("do-sync") for t in tables):
                return False  # the copy process is catching up to our tick
            caps = [state_tick(t.state) for t in tables if (t.state or "").startswith("wanna-sync")]
            max_tick = min((c for c in caps if c is not None and c > (node.last_tick or 0)), default=None)
            info = next_batch(
                prov,
                self.queue,
                node.worker_name,
                self.max_batch_events if node.role.may_merge_ticks else None,
                max_tick,
            )
            if info.batch_id is None:
                self.report_watermark(sub, prov, node)
                return False
            self.process_batch(sub, prov, node, tables, info)
            self.report_watermark(sub, prov, node)
            return True
        except psycopg.OperationalError:
            self.drop_connections()
            raise

    def process_batch(
        self,
        sub: psycopg.Connection,
        prov: psycopg.Connection,
        node: nodes.Node,
        tables: list[subscriber.SubscriberTable],
        info: BatchInfo,
    ) -> None:
        started = time.monotonic()
        appliers = self.appliers_for(sub, prov, tables)
        carry = node.role.copies_events or bool(node.combined_queue)
        with sub.transaction():
            sub.execute(APPLY_SETTINGS)
            last, provider, node_type = sub.execute(
                "select last_tick, provider_node, node_type from pgcascade.node where queue_name = %s for update",
                (self.queue,),
            ).fetchone()
            if provider != node.provider_node or node_type != node.node_type:
                return  # moved (change-provider, takeover) since this round began: start again
            if last is not None and last != info.prev_tick_id:
                stats = None
            else:
                stage_batch(prov, sub, info.batch_id, carry=carry)
                if node.combined_queue:
                    self.drop_partition_truncates(sub)
                elif carry:
                    carry_staged(sub, self.queue)
                stats = apply_staged(sub, appliers, queue=self.queue)
                if node.combined_queue:
                    merge_staged(sub, node.combined_queue, self.queue, info.cur_tick_id, list(appliers))
                if stats.table_list is not None:
                    self.drop_tables_left_the_set(sub, prov, tables, stats.table_list)
                    if node.role.copies_events:
                        nodes.mirror_set_tables(sub, self.queue, provider_set_tables(prov, self.queue))
                if node.role.copies_events:
                    sub.execute(
                        "select pgcascade.branch_tick(%s, %s, %s, %s)",
                        (self.queue, info.cur_tick_id, info.cur_tick_time, info.cur_tick_event_seq),
                    )
                sub.execute(
                    "update pgcascade.node set last_tick = %s, last_error = null, last_error_time = null"
                    " where queue_name = %s",
                    (info.cur_tick_id, self.queue),
                )
                sync_sequences(prov, sub, self.queue)
        if stats is None:
            # the batch does not start where this node's durable record says it is (it was
            # applied and the provider lost its finish_batch in a crash, or cut the batch
            # differently after one): go by our record, never apply anything twice
            log.info(
                "provider had us at tick %d, we applied up to %d: resuming there", info.prev_tick_id, last
            )
            resume_at(prov, self.queue, node.worker_name, last)
            return
        prov.execute("select pgcascade.finish_batch(%s)", (info.batch_id,))
        if stats.executed:
            self.applier_key = ()  # DDL ran: read the tables' definitions again
        log.info(
            "{count: %d, ignored: %d, duration: %.3f}", stats.count, stats.ignored, time.monotonic() - started
        )

    # --- a merge-leaf (combined partitions) ---
    def combined_is_root(self, sub: psycopg.Connection, node: nodes.Node) -> bool:
        combined = nodes.get_node(sub, node.combined_queue)
        return combined is not None and combined.node_type == "root"

    def follow_combined(self, prov: psycopg.Connection, node: nodes.Node) -> None:
        """On a combined-failover node the combined queue brings this partition's changes (its
        markers move node.last_tick): keep the partition's history only from there on, and
        apply nothing until a takeover makes the combined node here the root."""
        pos = prov.execute(
            "select tick_id from pgcascade.consumer_tick(%s, %s)", (self.queue, node.worker_name)
        ).fetchone()
        if node.last_tick and pos and pos[0] < node.last_tick:
            resume_at(prov, self.queue, node.worker_name, node.last_tick)

    @staticmethod
    def drop_partition_truncates(sub: psycopg.Connection) -> None:
        """A partition's TRUNCATE would empty the merged table of every partition: not applied."""
        n = sub.execute("delete from pg_temp.pgcascade_stage where ev_type = 'R'").rowcount
        if n:
            log.warning("merge-leaf: %d TRUNCATE events of the partition not applied to the merged tables", n)

    def report_watermark(self, sub: psycopg.Connection, prov: psycopg.Connection, node: nodes.Node) -> None:
        """Tell the provider the lowest tick this node and the nodes below it still need (at
        most every watermark_period): the root keeps its history back to the lowest of all."""
        now = time.monotonic()
        if now < self.next_watermark:
            return
        self.next_watermark = now + self.watermark_period
        wm = sub.execute("select pgcascade.local_watermark(%s)", (self.queue,)).fetchone()[0]
        if wm is not None:
            prov.execute(
                "select pgcascade.set_subscriber_watermark(%s, %s, %s)", (self.queue, node.node_name, wm)
            )

    def drop_tables_left_the_set(
        self,
        sub: psycopg.Connection,
        prov: psycopg.Connection,
        tables: list[subscriber.SubscriberTable],
        in_set: list[str],
    ) -> None:
        """The root removed tables from the set (a T event): unregister them here too (the seed's
        rule) - those the provider does not have now either, so an old T event never removes a
        table that was added back since."""
        now_in_set = set(provider_formats(prov, self.queue))
        gone = [t.table_name for t in tables if t.table_name not in in_set and t.table_name not in now_in_set]
        if gone:
            subscriber.remove_tables(sub, self.queue, gone)
            self.applier_key = ()
            log.info("removed from the set by the root: %s", ", ".join(gone))

    def appliers_for(
        self, sub: psycopg.Connection, prov: psycopg.Connection, tables: list[subscriber.SubscriberTable]
    ) -> dict[str, TableApplier]:
        ok = [t for t in tables if t.state == "ok"]
        key = tuple((t.table_name, t.dest_table) for t in ok)
        if key != self.applier_key:
            formats = provider_formats(prov, self.queue)
            self.appliers = {
                t.table_name: TableApplier.build(sub, prov, t, formats.get(t.table_name, "json")) for t in ok
            }
            self.applier_key = key
        return self.appliers

    def report_error(self, e: Exception) -> None:
        message = db_error_line(e) if isinstance(e, psycopg.Error) else str(e)
        with (
            contextlib.suppress(psycopg.Error),
            pgconn.connect(self.cfg.db, autocommit=True, connect_timeout=5) as c,
        ):
            nodes.record_error(c, self.queue, message)

    # --- copy processes ---
    def manage_copies(
        self, sub: psycopg.Connection, node: nodes.Node, tables: list[subscriber.SubscriberTable]
    ) -> bool:
        """Hand tables over and start copies; whether any table's state changed."""
        for name in [n for n, p in self.copies.items() if p.poll() is not None]:
            del self.copies[name]
        changed = False
        for t in tables:
            if t.state == "ok":
                continue
            if (t.state or "").startswith("wanna-sync"):
                wanted = state_tick(t.state) or 0
                if (node.last_tick or 0) >= wanted:
                    subscriber.set_state(sub, self.queue, t.table_name, f"do-sync:{node.last_tick}")
                    log.info("%s: wanna-sync:%d -> do-sync:%d", t.table_name, wanted, node.last_tick)
                    changed = True
            if self.copy_running(t):
                continue
            if t.state is None:
                if len(self.copies) >= self.parallel_copies:
                    continue
                forget_plan(sub, self.queue, t.table_name)  # a new copy: an old Spark copy plan goes
                subscriber.set_state(sub, self.queue, t.table_name, "in-copy")
                log.info("%s: starting initial copy", t.table_name)
                changed = True
            self.launch_copy(t.table_name)
        return changed

    def copy_running(self, t: subscriber.SubscriberTable) -> bool:
        p = self.copies.get(t.table_name)
        if p is not None and p.poll() is None:
            return True
        # a copy started by an earlier worker may still be at work
        return bool(t.copy_pid) and pid_alive(t.copy_pid) and is_copy_process(t.copy_pid)

    def launch_copy(self, table: str) -> None:
        cmd = [sys.executable, "-m", "pgcascade", "-q", str(self.cfg.path), "copy", table]
        self.copies[table] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def stop_copies(self) -> None:
        """SIGTERM to every copy process of this node, ours or an earlier worker's (Londiste's -s/-k rule)."""
        pids = {p.pid for p in self.copies.values() if p.poll() is None}
        # a connection of its own: this also runs in the SIGTERM handler, which may have
        # interrupted the main connection's query (its lock is held: using it would hang)
        with (
            contextlib.suppress(psycopg.Error),
            pgconn.connect(self.cfg.db, autocommit=True, connect_timeout=5) as conn,
        ):
            pids |= {t.copy_pid for t in subscriber.tables(conn, self.queue) if t.copy_pid}
        for pid in pids:
            if pid_alive(pid) and is_copy_process(pid):
                log.info("stopping copy process %d", pid)
                os.kill(pid, signal.SIGTERM)
        for p in self.copies.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def on_kill(self) -> None:
        self.stop_copies()

    def shutdown(self) -> None:
        self.stop_copies()
        self.drop_connections()


def is_copy_process(pid: int) -> bool:
    """Whether `pid` runs a pgcascade copy (pids are reused: never signal a stranger)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"pgcascade" in args and b"copy" in args


__all__ = ["ApplyError", "Worker"]
