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
root's worker replays the queues of its two-way peers (a worker per peer subscription, in
this process), or waits: a takeover may make the node a branch.

Between batches the worker drives the copy state machine (seed 000), owning the states NULL
and wanna-sync:T (copies.py); the copy processes it launches own the others (copy.py):

    NULL -> in-copy -> catching-up -> wanna-sync:T -> do-sync:T -> ok

While a table is in wanna-sync:T the worker never goes past tick T (batches are capped at T);
once at or past T it hands over with do-sync:<its tick>, and it applies nothing while a table
is in do-sync, so the copy process catches up to exactly that tick before setting ok.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time

import psycopg

from pgcascade.capture import logical as walcapture
from pgcascade.capture import tables as set_tables
from pgcascade.core import metrics, pgconn, privileges
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon
from pgcascade.core.daemonlock import DaemonRole
from pgcascade.core.errors import UserError
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import peer_worker
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import (
    APPLY_SETTINGS,
    STAGE_TABLE,
    BatchStats,
    TableApplier,
    apply_staged,
    ensure_stage,
    merge_staged,
    stage_batch,
)
from pgcascade.replica.copies import CopyLauncher
from pgcascade.replica.copy import BulkCopier
from pgcascade.replica.ddl import DdlReplay, PeerBehind, forget_tables_left
from pgcascade.replica.delay import ApplyDelay
from pgcascade.replica.parallel import ParallelApply, ahead_of, left_out
from pgcascade.replica.state import Phase

log = logging.getLogger("pgcascade.replay")


def batch_cap(tables: list[subscriber.SubscriberTable], applied: int | None) -> int | None:
    """The highest tick the next batch may reach: a table in wanna-sync:T holds the worker at T."""
    caps = [t.state.tick for t in tables if t.state.phase is Phase.WANNA_SYNC and t.state.tick is not None]
    return min((c for c in caps if c > (applied or 0)), default=None)


class BatchPhases:
    """Where a batch's time went, for its stats line: seconds per phase, in order."""

    def __init__(self, started: float):
        self.last = started
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = now - self.last
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{k}: {v:.3f}" for k, v in self.seconds.items())


class Worker(Daemon):
    name = "worker"
    lock_role = DaemonRole.WORKER  # its copy processes and peer workers take none

    def __init__(self, cfg: JobConfig, bulk: BulkCopier | None = None):
        super().__init__(cfg)
        if not cfg.queue_name:
            raise UserError(f"{cfg.path}: queue_name is not set")
        if not cfg.db:
            raise UserError(f"{cfg.path}: db is not set")
        self.db = cfg.db
        self.queue = cfg.queue_name
        self.sub: psycopg.Connection | None = None
        self.prov: psycopg.Connection | None = None
        self.appliers: dict[str, TableApplier] = {}
        self.applier_key: tuple = ()
        self.copies = CopyLauncher(cfg, self.queue, bulk)
        self.prov_node: str | None = None  # the provider self.prov is connected to
        self.next_watermark = 0.0
        self.phases = BatchPhases(0.0)
        self.parallel = ParallelApply(
            cfg.db, cfg.worker.apply_connections, cfg.worker.parallel_apply_min_events
        )
        self.peer_workers: dict[str, Worker] = {}  # a master's: peer queue -> its worker
        self.prov_logical = False  # the provider is a two-way peer with logical capture
        self.origin_session: psycopg.Connection | None = None  # runs under the peer's replication origin
        self.peer_state = peer_worker.PeerState()  # a peer subscription's, between its batches
        self.retry_at = 0.0  # a peer's worker after an error: not before then
        self.backoff = self.single_ticks_until = 0.0  # a peer waiting for DDL: a tick per batch until
        self.delay = ApplyDelay()  # a delayed leaf (apply_delay)

    def reload(self) -> None:
        self.copies.cfg = self.cfg
        self.parallel.lanes = self.cfg.worker.apply_connections
        self.parallel.min_events = self.cfg.worker.parallel_apply_min_events
        for queue, w in self.peer_workers.items():
            w.cfg = self.cfg.with_changes(queue_name=queue)
            w.reload()

    # --- connections ---
    def connect(self) -> tuple[psycopg.Connection, psycopg.Connection | None, nodes.Node]:
        """Both connections; the provider's is None while this node is the root (a root's
        worker waits, in case a takeover makes it a branch)."""
        if self.sub is None or self.sub.closed:
            self.sub = pgconn.connect(self.db, autocommit=True, connect_timeout=10)
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
            # what the worker writes on the provider (the open batch, its finish, watermarks)
            # need not wait for a WAL flush: a crash that takes one back is recovered from
            # this node's own durable record (resume_at), so the round trips stay short
            self.prov.execute("set synchronous_commit = off")
            q.listen(self.prov)
            self.prov_node = node.provider_node
            # a two-way peer's capture mode decides which commit time its events carry
            self.prov_logical = node.is_peer and walcapture.is_logical(self.prov, self.queue)
        return self.sub, self.prov, node

    def drop_connections(self) -> None:
        for w in self.peer_workers.values():
            w.drop_connections()
        self.parallel.close()
        for c in (self.sub, self.prov):
            if c is not None:
                c.close()
        self.sub = self.prov = None
        self.prov_node = None

    def sleep(self, seconds: float) -> None:
        """Wait for the provider's next tick (NOTIFY), at most `seconds`; a delayed leaf, until
        its next tick is old enough."""
        if self.delay.due_in is not None:
            try:
                self.delay.sleep(self.prov, seconds, lambda: self.stop_requested or self.reload_requested)
            except psycopg.Error:
                self.drop_connections()
            return
        if self.peer_workers:
            self.sleep_on_peers(seconds)
            return
        if self.prov is not None and not self.prov.closed:
            try:
                for _ in self.prov.notifies(timeout=seconds, stop_after=1):
                    pass
                return
            except psycopg.Error:
                self.drop_connections()
        time.sleep(seconds)

    def sleep_on_peers(self, seconds: float) -> None:
        """A master: wait for the next tick of any peer's queue, at most `seconds`."""
        conns = [w.prov for w in self.peer_workers.values() if w.prov is not None and not w.prov.closed]
        try:
            for c in conns:  # a tick that came in during the last round's statements
                for _ in c.notifies(timeout=0, stop_after=1):
                    return
            with selectors.DefaultSelector() as sel:
                for c in conns:
                    sel.register(c.fileno(), selectors.EVENT_READ)
                if conns:
                    sel.select(seconds)
                    return
        except psycopg.Error:
            self.drop_connections()
        time.sleep(seconds)

    # --- the loop ---
    def work(self) -> bool:
        sub, prov, node = self.connect()
        self.delay.check(self.cfg, sub, node)
        if prov is None:
            return self.work_peers(sub) if node.role.is_root else False
        if node.paused:
            if self.metrics and time.monotonic() >= self.next_watermark:
                self.next_watermark = time.monotonic() + self.cfg.worker.watermark_period
                self.measure_lag(sub, prov, node)  # a paused node's lag grows: show it
            return False
        if node.combined_queue and not self.combined_is_root(sub, node):
            self.follow_combined(prov, node)
            return False
        tables = subscriber.tables(sub, self.queue)
        if self.copies.manage(sub, node, tables):
            # read the states again: a table handed over (do-sync) must not be applied
            # past that tick until the copy process says ok
            tables = subscriber.tables(sub, self.queue)
        if self.metrics:
            self.count_tables(node, tables)
        if any(t.state.phase is Phase.DO_SYNC for t in tables):
            return False  # the copy process is catching up to our tick
        cap = min(
            (c for c in (batch_cap(tables, node.last_tick), ahead_of(tables, node.last_tick)) if c),
            default=None,
        )
        info = q.next_batch(
            prov,
            self.queue,
            node.consumer,
            self.cfg.worker.max_batch_events
            if node.role.may_merge_ticks and node.last_tick_past(self.single_ticks_until)
            else None,
            self.delay.limit(self.cfg, prov, node, cap),
        )
        if info.batch_id is not None:
            self.process_batch(sub, prov, node, tables, info)
        self.report_watermark(sub, prov, node)
        return info.batch_id is not None

    def work_peers(self, sub: psycopg.Connection) -> bool:
        """A master replays each of its peers' queues in turn; one peer's failure (its error is
        in its node row) holds back that peer only."""
        subscribed = {p.queue_name for p in nodes.peers(sub, self.queue)}
        for queue in set(self.peer_workers) - subscribed:
            self.peer_workers.pop(queue).shutdown()
        for queue in sorted(subscribed - set(self.peer_workers)):
            w = Worker(self.cfg.with_changes(queue_name=queue), self.copies.bulk)
            w.metrics = self.metrics
            self.peer_workers[queue] = w
        busy = False
        for queue, w in self.peer_workers.items():
            if time.monotonic() < w.retry_at:
                continue
            try:
                busy = w.work() or busy
                w.backoff = 0.0
            except PeerBehind as e:  # not an error: another master's DDL comes first; tick by tick
                w.retry_at, w.single_ticks_until = time.monotonic() + 0.5, e.batch_end  # (no deadlock)
                log.info("peer queue %s: %s", queue, e)
            except psycopg.OperationalError as e:
                if (e.sqlstate or "").startswith("40"):
                    # a deadlock with a local transaction, or one that changed a row the batch
                    # was judged against: rolled back, applied again at once (still open)
                    log.info(
                        "peer queue %s: %s; applying the batch again", queue, str(e).strip().splitlines()[0]
                    )
                    busy = True
                    continue
                w.drop_connections()
                w.fail(e, queue)
            except Exception as e:  # the peer's batch failed: the others go on
                w.fail(e, queue)
        return busy

    def fail(self, e: Exception, queue: str) -> None:
        self.backoff = min(max(self.backoff * 2, 1.0), 30.0)
        self.retry_at = time.monotonic() + self.backoff
        log.error("peer queue %s: %s (retrying in %.0fs)", queue, str(e).strip(), self.backoff)
        self.report_error(e)

    def process_batch(
        self,
        sub: psycopg.Connection,
        prov: psycopg.Connection,
        node: nodes.Node,
        tables: list[subscriber.SubscriberTable],
        info: BatchInfo,
    ) -> None:
        started = time.monotonic()
        assert info.cur_tick_id is not None
        done = left_out(tables, info.cur_tick_id)  # by a parallel apply cut short
        appliers = {t: a for t, a in self.appliers_for(sub, prov, tables).items() if t not in done}
        self.phases = BatchPhases(started)
        if node.is_peer:
            self.use_peer_origin(sub, node)
            now, stats = peer_worker.apply_batch(
                sub, prov, node, info, appliers, self.prov_logical, self.peer_state
            )
            if stats is None and (now.provider_node != node.provider_node or now.node_type != node.node_type):
                return
            self.phases.mark("apply")
        else:
            with sub.transaction():
                sub.execute(APPLY_SETTINGS)
                lanes = None
                if self.parallel.wanted(node, info):
                    lanes = self.parallel.apply(sub, prov, self.queue, node, info, appliers)
                    self.phases.mark("lanes")
                now = nodes.lock_node(sub, self.queue)
                if now.provider_node != node.provider_node or now.node_type != node.node_type:
                    return  # moved (change-provider, takeover) since this round began: start again
                stats = None
                if now.last_tick is None or now.last_tick == info.prev_tick_id:
                    stats = self.apply_batch(sub, prov, node, tables, info, appliers, rows_applied=lanes)
        if stats is None:
            # the batch does not start where this node's durable record says it is (it was
            # applied and the provider lost its finish_batch in a crash, or cut the batch
            # differently after one): go by our record, never apply anything twice
            assert now.last_tick is not None
            log.info(
                "provider had us at tick %d, we applied up to %d: resuming there",
                info.prev_tick_id,
                now.last_tick,
            )
            q.resume_at(prov, self.queue, node.consumer, now.last_tick)
            return
        assert info.batch_id is not None and info.cur_tick_id is not None
        self.phases.mark("commit")
        q.finish_batch(prov, info.batch_id)
        self.phases.mark("finish")
        if stats.executed:
            self.applier_key = ()  # DDL ran: read the tables' definitions again
        duration = time.monotonic() - started
        log.info(
            "{count: %d, ignored: %d, duration: %.3f, %s%s}",
            stats.count,
            stats.ignored,
            duration,
            self.phases,
            f", conflicts: {stats.conflicts}" if node.is_peer else "",
        )
        if self.metrics:
            labels = (self.queue, node.node_name)
            metrics.BATCHES.labels(*labels).inc()
            metrics.EVENTS.labels(*labels).inc(stats.count)
            metrics.BATCH_SECONDS.labels(*labels).observe(duration)
            metrics.APPLIED_TICK.labels(*labels).set(info.cur_tick_id)

    def apply_batch(
        self,
        sub: psycopg.Connection,
        prov: psycopg.Connection,
        node: nodes.Node,
        tables: list[subscriber.SubscriberTable],
        info: BatchInfo,
        appliers: dict[str, TableApplier],
        rows_applied: BatchStats | None = None,
    ) -> BatchStats:
        """Inside the batch's transaction: stage, carry (a branch), apply, record the tick.
        `rows_applied`: the lanes of a parallel apply did the row events and staged the rest."""
        assert info.batch_id is not None and info.cur_tick_id is not None
        carry = node.role.copies_events or bool(node.combined_queue)
        self.phases.mark("prepare")
        if rows_applied is None:
            stage_batch(prov, sub, info, carry=carry)
            self.phases.mark("stage")
        if node.combined_queue:
            self.drop_partition_truncates(sub)
        elif carry:
            q.carry_events(sub, self.queue, STAGE_TABLE)
        stats = apply_staged(sub, appliers, queue=self.queue, ddl=DdlReplay(node).replay)
        if rows_applied is not None:
            stats.add(rows_applied)
        self.phases.mark("apply")
        if node.combined_queue:
            merge_staged(sub, node.combined_queue, self.queue, info.cur_tick_id, list(appliers))
        if stats.table_list is not None:
            self.drop_tables_left_the_set(sub, prov, stats.table_list)
            if node.role.copies_events:
                set_tables.mirror_set_tables(sub, self.queue, set_tables.set_table_rows(prov, self.queue))
        if node.role.copies_events:
            q.branch_tick(sub, self.queue, info.cur_tick_id, info.cur_tick_time, info.cur_tick_event_seq)
        nodes.record_applied(sub, self.queue, info.cur_tick_id)
        subscriber_seqs.sync_sequences(prov, sub, self.queue)
        self.phases.mark("record")
        return stats

    def use_peer_origin(self, sub: psycopg.Connection, node: nodes.Node) -> None:
        """With logical capture here, a peer's batches are applied under the peer's replication
        origin (for the rest of the session), which is how the capture tells these changes."""
        if self.origin_session is not sub:
            assert node.peer_of is not None and node.provider_node is not None
            if walcapture.is_logical(sub, node.peer_of):
                walcapture.use_origin(sub, walcapture.peer_origin(node.provider_node))
            self.origin_session = sub

    # --- a merge-leaf (combined partitions) ---
    def combined_is_root(self, sub: psycopg.Connection, node: nodes.Node) -> bool:
        assert node.combined_queue is not None
        combined = nodes.get_node(sub, node.combined_queue)
        return combined is not None and combined.role.is_root

    def follow_combined(self, prov: psycopg.Connection, node: nodes.Node) -> None:
        """On a combined-failover node the combined queue brings this partition's changes (its
        markers move node.last_tick): keep the partition's history only from there on, and
        apply nothing until a takeover makes the combined node here the root."""
        pos = q.consumer_tick(prov, self.queue, node.consumer)
        if node.last_tick and pos and pos[0] < node.last_tick:
            q.resume_at(prov, self.queue, node.consumer, node.last_tick)

    @staticmethod
    def drop_partition_truncates(sub: psycopg.Connection) -> None:
        """A partition's TRUNCATE would empty the merged table of every partition: not applied."""
        n = sub.execute(f"delete from {STAGE_TABLE} where ev_type = 'R'").rowcount
        if n:
            log.warning("merge-leaf: %d TRUNCATE events of the partition not applied to the merged tables", n)

    def report_watermark(self, sub: psycopg.Connection, prov: psycopg.Connection, node: nodes.Node) -> None:
        """Tell the provider the lowest tick this node and the nodes below it still need (at
        most every watermark_period): the root keeps its history back to the lowest of all."""
        now = time.monotonic()
        if now < self.next_watermark:
            return
        self.next_watermark = now + self.cfg.worker.watermark_period
        wm = nodes.local_watermark(sub, self.queue)
        if wm is not None:
            nodes.set_subscriber_watermark(prov, self.queue, node.node_name, wm)
        if self.metrics:
            self.measure_lag(sub, prov, node)

    def measure_lag(self, sub: psycopg.Connection, prov: psycopg.Connection, node: nodes.Node) -> None:
        """Lag in time and ticks, read from the provider (its clock, not ours)."""
        applied = nodes.applied_tick(sub, self.queue)
        age = q.tick_age(prov, self.queue, applied)
        newest = q.last_tick_id(prov, self.queue)
        labels = (self.queue, node.node_name)
        if age is not None:
            metrics.LAG_SECONDS.labels(*labels).set(age.total_seconds())
        if newest is not None:
            metrics.LAG_TICKS.labels(*labels).set(max(newest - applied, 0))
        metrics.APPLIED_TICK.labels(*labels).set(applied)

    def count_tables(self, node: nodes.Node, tables: list[subscriber.SubscriberTable]) -> None:
        counts = dict.fromkeys(Phase, 0)
        for t in tables:
            counts[t.state.phase] += 1
        for phase, n in counts.items():
            metrics.TABLES.labels(self.queue, node.node_name, phase.value).set(n)

    def drop_tables_left_the_set(
        self, sub: psycopg.Connection, prov: psycopg.Connection, in_set: list[str]
    ) -> None:
        """The root removed tables from the set (a T event): unregister them here too."""
        gone = forget_tables_left(sub, self.queue, in_set, set(set_tables.set_tables(prov, self.queue)))
        if gone:
            self.applier_key = ()
            log.info("removed from the set by the root: %s", ", ".join(gone))

    def appliers_for(
        self, sub: psycopg.Connection, prov: psycopg.Connection, tables: list[subscriber.SubscriberTable]
    ) -> dict[str, TableApplier]:
        ok = [t for t in tables if t.state.is_ok]
        # a table removed and added again with another filter or columns (--expect-sync) is rebuilt too
        key = tuple((t.table_name, t.dest_table, t.row_filter, str(t.column_list)) for t in ok)
        if key != self.applier_key:
            formats = set_tables.event_formats(prov, self.queue)
            self.appliers = {
                t.table_name: TableApplier.build(sub, prov, t, formats.get(t.table_name, "json")) for t in ok
            }
            self.applier_key = key
        return self.appliers

    def report_error(self, e: Exception) -> None:
        version = self.sub.info.server_version if self.sub is not None and not self.sub.closed else 0
        message = privileges.explain(e, self.db, version)
        with (
            contextlib.suppress(psycopg.Error),
            pgconn.connect(self.db, autocommit=True, connect_timeout=5) as c,
        ):
            nodes.record_error(c, self.queue, message)

    def on_kill(self) -> None:
        self.copies.stop_all()

    def shutdown(self) -> None:
        self.copies.stop_all()
        self.drop_connections()
