"""The worker: replays the provider's batches into this node, exactly once.

Each round reads the node and its tables, drives the copy state machine, and fetches the next
batch in one round trip to the provider (`next_batch_events`: it also finishes the batch
applied last, and ticks the provider's queue when this consumer is caught up and committed
changes wait there, so a change waits for no ticker).  The batch's transaction is batch.py's;
a small one is applied in one round trip (inline.py).  A caught-up worker sleeps on LISTEN: a
provider that makes its own ticks (a branch, a root with logical capture) notifies them; on a
root whose consumers make the ticks, the worker asks again at once after a batch and, after an
empty answer, rings the queue's doorbell before it sleeps, so the capture triggers notify the
commits that follow (05_doorbell.sql).

A branch carries every batch into its own queue (same ids, same tick ids), so every node with a
queue presents identical batches and a subscriber can move to any of them.  After its batches
the worker reports its watermark (the lowest tick it and the nodes below it need, and of a
leaf that commits asynchronously only what its disk holds) to the provider.  A root's worker
replays the queues of its two-way peers (a worker per peer subscription, in this process; their
batches come by `next_batch_events` too, ticked on demand and the peer's doorbell rung as on a
root, and go peer_worker.py's way: peer_loop.py), or waits: a takeover may make the node a
branch.

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
import time

import psycopg

from pgcascade.capture import logical as walcapture
from pgcascade.core import metrics, pgconn, privileges, roundtrip
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon
from pgcascade.core.daemonlock import DaemonRole
from pgcascade.core.errors import UserError
from pgcascade.core.hooks import pause_point
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import ahead, doorbell, inline, pacing, peer_worker, stream
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import REPLICA_SESSION, TableApplier
from pgcascade.replica.batch import Batches, BatchPhases
from pgcascade.replica.between import BetweenTicks
from pgcascade.replica.copies import CopyLauncher
from pgcascade.replica.copy import BulkCopier
from pgcascade.replica.delay import ApplyDelay
from pgcascade.replica.doorbell import LISTEN_AFTER, LISTEN_MAX, LISTEN_MIN, POLL_MAX, POLL_MIN
from pgcascade.replica.parallel import ParallelApply, ahead_of
from pgcascade.replica.peer_loop import PEER_IDLE_POLL, PEER_SPACED_EVENTS, PEER_TICK_SPACING, PeerLoop
from pgcascade.replica.stage import ensure_stage
from pgcascade.replica.state import Phase

log = logging.getLogger("pgcascade.replay")

INLINE_EVENTS = 2000  # a batch of at most this many events comes inline with next_batch_events


def batch_cap(tables: list[subscriber.SubscriberTable], applied: int | None) -> int | None:
    """The highest tick the next batch may reach: a table in wanna-sync:T holds the worker at T."""
    caps = [t.state.tick for t in tables if t.state.phase is Phase.WANNA_SYNC and t.state.tick is not None]
    return min((c for c in caps if c > (applied or 0)), default=None)


class Worker(PeerLoop, Batches, Daemon):
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
        self.streamer = stream.Streamer(cfg.db, self.queue, cfg.worker.stream_chunk_events)
        self.ahead = ahead.Ahead(cfg.db, self.queue, cfg.worker.stream_chunk_events)
        self.fetch: ahead.Fetch | None = None  # the last fetch's, for a fetch ahead (None: none)
        self.ahead_batch: ahead.Staged | None = None  # the batch being applied, if staged ahead
        self.finished_ahead: int | None = None  # a batch the fetch ahead finished on the provider
        self.peer_workers: dict[str, PeerLoop] = {}  # a master's: peer queue -> its worker
        self.prov_logical = False  # the provider is a two-way peer with logical capture
        self.origin_session: psycopg.Connection | None = None  # runs under the peer's replication origin
        self.peer_state = peer_worker.PeerState()  # a peer subscription's, between its batches
        self.retry_at = 0.0  # a peer's worker after an error: not before then
        self.backoff = self.single_ticks_until = 0.0  # a peer waiting for DDL: a tick per batch until
        # (provider, batch): applied here, finished on that provider with the next fetch
        self.unfinished: tuple[str | None, int] | None = None
        self.copies_checked = False  # stale copy consumers looked for on this provider connection
        self.polls = False  # the provider's queue ticks when its consumers ask (trigger capture)
        self.paused = False  # the node was paused at the last round: only a wake ends a sleep
        self.poll_delay = POLL_MIN
        self.listen_wait = LISTEN_MIN
        self.seen_event_seq: int | None = None  # the event sequence at the tick last fetched to
        self.rung: tuple[bool, float] | None = None  # the last fetch rang: (pending, until when)
        self.durability = inline.Durability.new()
        self.between = BetweenTicks(cfg.worker.read_between_ticks)
        self.seqs: list[tuple[str, str]] = []  # followed sequences (name, here), read every watermark_period
        self.fresh: tuple[nodes.Node, list[subscriber.SubscriberTable]] | None = None
        self.fresh_until = 0.0
        self.stats_line: tuple | None = None  # the last batch's, logged with the next fetch
        self.delay = ApplyDelay()  # a delayed leaf (apply_delay)
        self.pacer = pacing.Pacer(cfg.worker)  # a one-way worker's, while its host's CPUs are busy
        self.paced = 0.0  # the wait before the last fetch (pacer)
        # a master's peer worker: when its peer's queue is asked again unless it notifies, whether
        # it notified since the last ask, and when it may be asked for a tick (PEER_TICK_SPACING)
        self.ask_at = self.tick_after = 0.0
        self.peer_ticked = False
        self.peers_until = 0.0  # a master's: its node and peers are read again then

    def reload(self) -> None:
        self.peers_until = 0.0
        self.pacer = pacing.Pacer(self.cfg.worker)
        self.copies.cfg = self.cfg
        self.parallel.lanes = self.cfg.worker.apply_connections
        self.parallel.min_events = self.cfg.worker.parallel_apply_min_events
        self.streamer.chunk_events = self.ahead.chunk_events = self.cfg.worker.stream_chunk_events
        for queue, w in self.peer_workers.items():
            w.cfg = self.cfg.with_changes(queue_name=queue)
            w.reload()

    # --- connections ---
    def connect(
        self, known: nodes.Node | None = None
    ) -> tuple[psycopg.Connection, psycopg.Connection | None, nodes.Node]:
        """Both connections and the node (`known`: read at the end of the last round); the
        provider's is None while this node is the root (a root's worker waits, in case a
        takeover makes it a branch)."""
        if self.sub is None or self.sub.closed:
            self.sub = self.subscriber_session()
            self.ahead.close()  # what it staged was for the session before
            self.ahead.drop_tables(self.sub)  # a crash's
            # what this node recorded before is durable once the WAL written so far is flushed
            self.durability = inline.Durability.new()
            tick, lsn = self.sub.execute(
                "select last_tick, pg_current_wal_insert_lsn()::text from pgcascade.node where queue_name = %s",
                (self.queue,),
            ).fetchone() or (None, None)
            if tick is not None:
                self.durability.committed(tick, lsn)
        node = known or nodes.require_node(self.sub, self.queue)
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
            self.prov.execute("set application_name = 'pgcascade worker'")
            q.listen(self.prov)
            self.copies_checked = False
            self.prov_node = node.provider_node
            # a root with trigger capture ticks when its consumers ask: poll it; other
            # providers tick on their own (the capture daemon, a branch's worker) and notify
            self.polls = q.ticks_on_demand(self.prov, self.queue) and not walcapture.is_logical(
                self.prov, self.queue
            )
            # a two-way peer's capture mode decides which commit time its events carry
            self.prov_logical = node.is_peer and walcapture.is_logical(self.prov, self.queue)
        return self.sub, self.prov, node

    def subscriber_session(self) -> psycopg.Connection:
        """The worker's session on its node, set up whole or closed."""
        sub = pgconn.connect(self.db, autocommit=True, connect_timeout=10)
        # the session's prepared statements are prepared.py's: psycopg's own would make it send
        # DEALLOCATE ALL after any ALTER, DROP or ROLLBACK (a replayed DDL, a failed batch), and
        # the next one-round-trip batch found its statements gone
        sub.prepare_threshold = None
        try:
            sub.execute("set application_name = 'pgcascade worker'")
            try:
                sub.execute(REPLICA_SESSION)
            except psycopg.errors.InsufficientPrivilege:
                # a root applies nothing; a node that applies says which grant it lacks at its
                # first batch (SET LOCAL), and plans its statements at every batch until then
                log.debug("session_replication_role not granted: set at each batch")
            ensure_stage(sub)
        except BaseException:
            sub.close()
            raise
        return sub

    def drop_connections(self) -> None:
        for w in self.peer_workers.values():
            w.drop_connections()
        self.parallel.close()
        self.streamer.close()
        for c in (self.sub, self.prov):
            if c is not None:
                c.close()
        self.ahead.drop_tables()  # once the worker's transaction is gone, which may hold one
        self.sub = self.prov = None
        self.prov_node = None
        self.fresh = None

    def sleep(self, seconds: float) -> None:
        """Wait for the provider's next tick (NOTIFY), at most `seconds` - or, where this worker
        makes the ticks (`polls`), at most its poll delay.  Ticks it made itself do not count.
        A delayed leaf waits until its next tick is old enough."""
        self.flush_stats()
        if self.delay.due_in is not None:
            try:
                self.delay.sleep(self.prov, seconds, lambda: self.stop_requested or self.reload_requested)
            except psycopg.Error:
                self.drop_connections()
            return
        if self.peer_workers:
            for w in self.peer_workers.values():
                w.flush_stats()
            self.sleep_on_peers(seconds)
            return
        if self.prov is not None and not self.prov.closed:
            try:
                if self.paused:  # no poll, no doorbell: a resume wakes it (admin.wake_worker)
                    self.notified(seconds, wakes_only=True)
                elif not self.polls:
                    self.notified(seconds)
                elif not self.rings():  # changes came lately: poll, ring nobody
                    self.notified(min(seconds, self.poll_delay))
                elif not self.notified():
                    self.notified(self.listen(seconds))
                return
            except psycopg.Error:
                self.drop_connections()
        time.sleep(seconds)

    def peer_worker(self, queue: str) -> PeerLoop:
        """A master's worker of its peer's queue `queue` (peer_loop.py)."""
        w = Worker(self.cfg.with_changes(queue_name=queue), self.copies.bulk)
        w.metrics = self.metrics
        return w

    def rings(self, poll_delay: float | None = None) -> bool:
        """Whether this worker's provider ticks on demand and no change came for a while (its
        poll delay, or `poll_delay`, reached LISTEN_AFTER): it rings the queue's doorbell before
        it sleeps."""
        return self.polls and (self.poll_delay if poll_delay is None else poll_delay) >= LISTEN_AFTER

    def ring_if_empty(self, node: nodes.Node) -> float | None:
        """How long the fetch is to ring the doorbell for if it finds nothing, where the worker
        would ring right after it (listen): one round trip less each time it goes idle."""
        if node.is_peer or self.delay.due_in is not None or self.peer_workers:
            return None
        # the poll delay an empty answer leaves (work's end) decides, as it will in sleep
        empty_delay = min(2 * self.poll_delay, POLL_MAX)
        return min(self.loop_delay, self.listen_wait) if self.rings(empty_delay) else None

    def listen(self, seconds: float) -> float:
        """A consumer that makes its provider's ticks: ring the queue's doorbell (unless the
        fetch that found nothing rang it: then until when it rings) and say how long to sleep
        on LISTEN - a while (longer each idle round, at most `seconds`) when no event
        waits, or the poll delay when some were numbered but not committed at the last fetch
        (their producer may have looked at the doorbell before it rang)."""
        assert self.prov is not None
        wait = min(seconds, self.listen_wait)
        rung, self.rung = self.rung, None
        if rung is not None:  # by the fetch that found nothing: it rings until then
            pending, wait = rung[0], max(0.0, rung[1] - time.monotonic())
        else:
            pending = q.consumer_listens(self.prov, self.queue, wait, self.seen_event_seq)
        if pending:
            return min(wait, self.poll_delay)
        self.listen_wait = min(2 * self.listen_wait, LISTEN_MAX)
        return wait

    def notified(self, timeout: float = 0.0, wakes_only: bool = False) -> bool:
        """Whether this queue's provider notified (doorbell.notified) within `timeout`."""
        assert self.prov is not None
        return doorbell.notified(self.prov, self.queue, timeout, wakes_only)

    # --- the loop ---
    def work(self) -> bool:
        if (
            self.peer_workers
            and self.sub is not None
            and not self.sub.closed
            and time.monotonic() < self.peers_until
        ):
            return self.work_peers(self.sub, set(self.peer_workers))
        # the node and its tables as read after the last batch's commit, a moment ago
        fresh = self.fresh if self.fresh is not None and time.monotonic() < self.fresh_until else None
        sub, prov, node = self.connect(fresh[0] if fresh else None)
        self.delay.check(self.cfg, sub, node)
        if prov is None:
            return self.work_peers(sub, None) if node.role.is_root else False
        self.paused = node.paused
        if node.paused:
            if self.metrics and time.monotonic() >= self.next_watermark:
                self.next_watermark = time.monotonic() + self.cfg.worker.watermark_period
                self.measure_lag(sub, prov, node)  # a paused node's lag grows: show it
            return False
        if node.combined_queue and not self.combined_is_root(sub, node):
            self.follow_combined(prov, node)
            return False
        tables = fresh[1] if fresh else subscriber.tables(sub, self.queue)
        if not self.copies_checked:  # once a connection to the provider
            self.copies.drop_stale_consumers(prov, node, tables)
            self.copies_checked = True
        if self.copies.manage(sub, node, tables):
            # read the states again: a table handed over (do-sync) must not be applied
            # past that tick until the copy process says ok
            tables = subscriber.tables(sub, self.queue)
            self.fresh = None
        if self.metrics:
            self.count_tables(node, tables)
        if any(t.state.phase is Phase.DO_SYNC for t in tables):
            return False  # the copy process is catching up to our tick
        if time.monotonic() >= self.next_watermark:
            self.seqs = subscriber_seqs.seqs(sub, self.queue)
        cap = min(
            (c for c in (batch_cap(tables, node.last_tick), ahead_of(tables, node.last_tick)) if c),
            default=None,
        )
        max_events = (
            self.cfg.worker.max_batch_events
            if node.role.may_merge_ticks and node.last_tick_past(self.single_ticks_until)
            else None
        )
        max_tick = self.delay.limit(self.cfg, prov, node, cap)
        ticks = not node.is_peer or time.monotonic() >= self.tick_after
        seqs = None if node.is_peer else [s for s, _ in self.seqs] or None
        to_now = self.between.reads_to_now(node, tables, max_tick, self.commits_async(node))
        self.fetch = (
            None
            if node.is_peer or max_tick is not None
            else ahead.Fetch(self.queue, node.consumer, max_events, INLINE_EVENTS, seqs)
        )
        self.ahead_batch = self.staged_ahead(prov, node, max_tick)
        self.paced = self.pacer.wait() if self.ahead_batch is None else 0.0
        self.rung, ring, fetched_at = None, self.ring_if_empty(node), time.monotonic()
        finish = self.unfinished[1] if self.unfinished and self.unfinished[0] == self.prov_node else None
        if self.ahead_batch is not None:
            info = self.ahead_batch.info  # fetched and staged while the last batch was applied
        elif to_now or node.last_position is not None:  # (a position held lands on a tick first)
            info = self.between.fetch(
                prov, self.queue, node, finish, to_now, INLINE_EVENTS, seqs, self.flush_stats, ring
            )
        else:
            info = q.next_batch_events(
                prov,
                self.queue,
                node.consumer,
                finish=finish,
                max_events=max_events,
                max_tick=max_tick,
                inline_events=INLINE_EVENTS,
                seqs=seqs,
                tick=ticks,
                # a peer's versions are its commit times (a logical peer's events carry them)
                commit_times=node.is_peer and not self.prov_logical,
                # a leaf's batch may come before the fetch's commit is done (process_batch)
                early=self.commits_async(node) and not node.is_peer,
                meanwhile=self.flush_stats,
                listen=ring,
            )
        if ring is not None and info.pending is not None:
            self.rung = (info.pending, fetched_at + ring)
        self.unfinished = None
        self.between.fetched(info)
        if info.batch_id is not None:
            fetched, numbered = time.monotonic(), info.numbered
            try:
                pause_point("fetched", events=numbered)
                applied = self.process_batch(sub, prov, node, tables, info)
            finally:
                roundtrip.settle(prov)
            if not node.is_peer:
                self.pacer.after_batch(applied)
                if self.metrics:
                    metrics.PACE_SECONDS.labels(self.queue, node.node_name).set(self.pacer.pause)
            if node.is_peer and applied > PEER_SPACED_EVENTS:
                self.tick_after = fetched + PEER_TICK_SPACING * (time.monotonic() - fetched)
        self.report_watermark(sub, prov, node)
        # caught up: ask again soon, then less often while nothing comes
        if info.batch_id is not None:
            self.poll_delay, self.listen_wait = POLL_MIN, LISTEN_MIN
        elif ticks:
            self.poll_delay = min(2 * self.poll_delay, POLL_MAX)
        # (a position fetch says where the event sequence was even when it found nothing)
        self.seen_event_seq = (
            info.cur_tick_event_seq if info.cur_tick_event_seq is not None else info.prev_tick_event_seq
        )
        if node.is_peer:  # after a batch: as soon as it may tick; else after its poll delay too
            idle = self.poll_delay if self.polls else PEER_IDLE_POLL
            self.ask_at = max(self.tick_after, time.monotonic() + idle if info.batch_id is None else 0.0)
        return info.batch_id is not None

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

    def report_watermark(self, sub: psycopg.Connection, prov: psycopg.Connection, node: nodes.Node) -> None:
        """Tell the provider the lowest tick this node and the nodes below it still need (at
        most every watermark_period): the root keeps its history back to the lowest of all."""
        now = time.monotonic()
        if now < self.next_watermark:
            return
        self.next_watermark = now + self.cfg.worker.watermark_period
        wm, flushed = sub.execute(
            "select pgcascade.local_watermark(%s), pg_current_wal_flush_lsn()::text", (self.queue,)
        ).fetchone() or (None, None)
        if self.commits_async(node) and wm is not None:
            durable = self.durability.flushed(flushed)  # never a tick a crash here could take back
            wm = None if durable is None else min(wm, durable)
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

    def report_error(self, e: Exception) -> None:
        self.flush_stats()  # the batch before the error was applied
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
        self.flush_stats()
        for w in self.peer_workers.values():  # each finishes the batch it applied last
            w.shutdown()
        self.copies.stop_all()
        if (
            self.unfinished
            and self.prov is not None
            and not self.prov.closed
            and self.unfinished[0] == self.prov_node
        ):
            with contextlib.suppress(psycopg.Error):  # else the next start finds it open, and resumes
                roundtrip.settle(self.prov)  # a fetch a signal cut short may still be pending
                q.finish_batch(self.prov, self.unfinished[1])
        self.drop_connections()
