"""The worker's batch transaction: one provider batch applied on this node, exactly once.

A small, plain batch of a leaf goes in one round trip (inline.py).  Every other batch goes the
general way, in one subscriber transaction (session_replication_role = replica) that holds:
the check that the batch is not applied yet (node.last_tick), the staged events, their
set-based apply for the tables in state `ok`, the new last_tick, and the sequences.  A branch
also carries the batch: the same transaction inserts every event into its own queue (same
ids) and makes the provider's tick with the same id.  Dying anywhere leaves either the batch
applied and recorded or nothing; the provider learns that it is done with the worker's next
fetch (a worker that dies before gets the same batch back, sees it recorded, and moves on).

`Batches` is the worker's part that does it (a mixin of `worker.Worker`, which owns the
connections and the loop).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from contextlib import suppress

import psycopg

from pgcascade.capture import logical as walcapture
from pgcascade.capture import tables as set_tables
from pgcascade.core import metrics, roundtrip
from pgcascade.core.config import JobConfig
from pgcascade.core.errors import db_error_line
from pgcascade.core.hooks import pause_point
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import inline, peer_worker, stream
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber
from pgcascade.replica.ahead import AHEAD_MIN_EVENTS, Ahead, Fetch, Staged
from pgcascade.replica.apply import APPLY_SETTINGS, BatchStats, TableApplier, apply_staged
from pgcascade.replica.ddl import DdlReplay, forget_tables_left
from pgcascade.replica.parallel import ParallelApply, left_out
from pgcascade.replica.stage import STAGE_TABLE, stage_batch

log = logging.getLogger("pgcascade.replay")

# the node and its tables read after a batch's commit serve the rounds of this long after it:
# each round after an empty fetch read them again (two round trips to the subscriber, ~0.6 ms
# of a loaded worker's 1 ms poll), and a change committed meanwhile waited for them
FRESH_SECONDS = 0.05
# ...and a batch's one message reads them again only once those its round started from are
# this old: read after every batch, they were two statements and the parsing of their rows at
# each of the hundreds of batches a second a busy leaf applies, where the one change a batch
# makes to them is the node's record (its tick; apply_begin still checks provider and record)
REREAD_SECONDS = FRESH_SECONDS / 2
# a leaf's: the commit need not wait for the WAL flush (docs/replication.md, "Exactly once")
APPLY_SETTINGS_ASYNC = "set local session_replication_role = replica; set local synchronous_commit = off"


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


class Batches:
    """A worker's batch transaction (see the module docstring); the worker provides these."""

    cfg: JobConfig
    queue: str
    metrics: bool
    prov_node: str | None
    prov_logical: bool
    origin_session: psycopg.Connection | None
    parallel: ParallelApply
    phases: BatchPhases
    appliers: dict[str, TableApplier]
    applier_key: tuple
    durability: inline.Durability
    unfinished: tuple[str | None, int] | None
    seqs: list[tuple[str, str]]
    fresh: tuple[nodes.Node, list[subscriber.SubscriberTable]] | None
    fresh_until: float
    stats_line: tuple | None  # the last batch's, until flush_stats logs it
    paced: float  # seconds waited before the batch's fetch (pacing.py)
    peer_state: peer_worker.PeerState
    streamer: stream.Streamer
    ahead: Ahead
    fetch: Fetch | None
    ahead_batch: Staged | None
    finished_ahead: int | None

    def process_batch(
        self,
        sub: psycopg.Connection,
        prov: psycopg.Connection,
        node: nodes.Node,
        tables: list[subscriber.SubscriberTable],
        info: BatchInfo,
    ) -> int:
        """Apply the batch in one round trip when it is small and plain (inline.py), else the
        general way; the provider learns it is done with the next fetch.  The events applied
        (0: none, the batch is to be fetched again)."""
        started = time.monotonic()
        assert info.batch_id is not None and info.cur_tick_id is not None
        self.flush_stats()
        # the round's node and tables, read a moment ago, serve the next round too
        known = (
            (node, tables)
            if self.fresh is not None and time.monotonic() < self.fresh_until - REREAD_SECONDS
            else None
        )
        self.fresh = None  # read again after this batch
        done = left_out(tables, info.cur_tick_id)  # by a parallel apply cut short
        appliers = {t: a for t, a in self.appliers_for(sub, prov, tables).items() if t not in done}
        self.phases = BatchPhases(started)
        durable = not self.commits_async(node)
        stats, lsn = None, None
        if node.is_peer:
            roundtrip.settle(prov)
            self.use_peer_origin(sub, node)
            now, stats, fresh, lsn = peer_worker.apply_batch(
                sub, prov, node, info, appliers, self.prov_logical, self.peer_state, known
            )
            if fresh is not None:
                self.keep_fresh(fresh, read=known is None)
            if stats is None:
                if now.provider_node == node.provider_node and now.node_type == node.node_type:
                    assert now.last_tick is not None
                    self.resume(prov, node, info, now.last_tick)
                return 0  # (or moved since this round began: start again)
            self.phases.mark("apply")
        elif self.applies_inline(node, info, appliers):
            try:
                # the fetch's commit (its tick's WAL flush) may still be under way on the
                # provider: the batch is applied meanwhile and committed here after it
                settle = None if roundtrip.committed(prov) else functools.partial(roundtrip.settle, prov)
                one = inline.apply_batch(
                    sub, self.queue, node, info, appliers, self.seqs, durable, settle, known
                )
                stats, lsn = one.stats, one.lsn
                self.keep_fresh(one.fresh, read=known is None)
                self.phases.mark("inline")
            except inline.NotAtRecord as e:
                self.resume(prov, node, info, e.last_tick)
                return 0
            except inline.Moved:
                return 0  # moved (change-provider, takeover) since this round began: start again
            except psycopg.OperationalError:
                raise
            except psycopg.Error as e:  # a unique violation, say: the general path resolves it
                log.info("batch %d: %s; applying it the general way", info.batch_id, db_error_line(e))
        if stats is None:
            roundtrip.settle(prov)
            general = functools.partial(self.general_batch, sub, prov, node, tables, info, appliers, durable)
            stats = self.general_or_whole(sub, info, general)
            if stats is None:
                return 0
            if not durable:
                lsn = str(scalar(sub, inline.WAL_AFTER_COMMIT))
        if lsn is not None:
            self.durability.committed(info.cur_tick_id, lsn)
        pause_point("applied", events=stats.count)  # committed here, not finished on the provider
        if durable and not node.is_peer:
            # a node others read (a branch, a merge-leaf): nothing of its consumer stays open on
            # a provider it may stop reading (a takeover moves it).  A master's peer subscription
            # never moves: its batch is finished with the next fetch, one round trip less
            q.finish_batch(prov, info.batch_id)
            self.phases.mark("finish")
        elif self.finished_ahead != info.batch_id:
            self.unfinished = (self.prov_node, info.batch_id)  # finished with the next fetch
        if stats.executed:
            self.applier_key = ()  # DDL ran: read the tables' definitions again
        duration = time.monotonic() - started
        # logged while the provider runs the next fetch (flush_stats): writing it took ~0.1 ms
        # of a loaded worker's round, between a batch's commit and the next fetch
        self.stats_line = (
            "{count: %d, ignored: %d, duration: %.3f, %s%s%s}",
            stats.count,
            stats.ignored,
            duration,
            str(self.phases),
            f", conflicts: {stats.conflicts}" if node.is_peer else "",
            f", paced: {self.paced:.3f}" if self.paced else "",
        )
        if self.metrics:
            labels = (self.queue, node.node_name)
            metrics.BATCHES.labels(*labels).inc()
            metrics.EVENTS.labels(*labels).inc(stats.count)
            metrics.BATCH_SECONDS.labels(*labels).observe(duration)
            metrics.APPLIED_TICK.labels(*labels).set(info.cur_tick_id)
        return stats.count

    def flush_stats(self) -> None:
        """Log the last batch's stats line, if it is not yet."""
        if self.stats_line is not None:
            line, self.stats_line = self.stats_line, None
            log.info(*line)

    def keep_fresh(self, fresh: inline.Fresh, read: bool) -> None:
        """The node and its tables after a batch's commit: the rounds of the next FRESH_SECONDS
        (from when they were `read`, else from the read before) start from them instead of
        reading them again."""
        self.fresh = fresh
        if read:
            self.fresh_until = time.monotonic() + FRESH_SECONDS

    @staticmethod
    def commits_async(node: nodes.Node) -> bool:
        """A leaf and a two-way master's peer subscription commit their batches without waiting
        for the WAL flush, as native logical replication's and pglogical's apply do: a crash that
        takes commits back makes the worker apply them again (its provider keeps them: see
        inline.Durability).  Nodes that repeat their provider's ticks (branches, merge-leaves)
        commit durably: a node below may read a tick of theirs before its flush."""
        return not (node.role.copies_events or node.combined_queue)

    def fetches_ahead(self, node: nodes.Node, info: BatchInfo, plain: bool) -> bool:
        """Whether the next batch is fetched and staged while this one is applied (ahead.py):
        a large, plain batch of a leaf (`plain`: staged whole here, neither lanes nor chunks)."""
        return (
            plain
            and self.commits_async(node)
            and not node.is_peer
            and info.events is None
            and info.numbered >= AHEAD_MIN_EVENTS
        )

    def staged_ahead(self, prov: psycopg.Connection, node: nodes.Node, max_tick: int | None) -> Staged | None:
        """The batch the last one fetched ahead (ahead.py), if this round may apply it; one it
        may not (a tick cap came meanwhile, or it moved) puts the provider back at our record."""
        staged = self.ahead.take()
        if staged is None:
            return None
        fits = max_tick is None or (staged.info.cur_tick_id or 0) <= max_tick
        if staged.provider == self.prov_node and not node.is_peer and fits:
            return staged
        if staged.provider == self.prov_node and node.last_tick is not None:
            q.resume_at(prov, self.queue, node.consumer, node.last_tick)
        return None

    def applies_inline(self, node: nodes.Node, info: BatchInfo, appliers: dict[str, TableApplier]) -> bool:
        return (
            self.commits_async(node) and inline.takes(info, appliers) and not self.parallel.wanted(node, info)
        )

    def resume(self, prov: psycopg.Connection, node: nodes.Node, info: BatchInfo, last_tick: int) -> None:
        """The batch does not start where this node's record says it is (it was applied and the
        provider lost its finish in a crash, or this node lost commits in one): go by our
        record, never apply anything twice."""
        log.info(
            "provider had us at tick %d, we applied up to %d: resuming there", info.prev_tick_id, last_tick
        )
        roundtrip.settle(prov)
        q.resume_at(prov, self.queue, node.consumer, last_tick)

    def general_or_whole(
        self, sub: psycopg.Connection, info: BatchInfo, general: Callable[[], BatchStats | None]
    ) -> BatchStats | None:
        """The batch the general way; one that cannot be applied in chunks (stream.py) is
        applied again whole."""
        try:
            return general()
        except stream.NotStreamed as e:
            log.info("batch %d: %s; applying it whole", info.batch_id, e)
            self.streamer.whole = info.batch_id
            return general()
        finally:
            if self.streamer.dirty:  # after a streamed batch, and once after a start (a crash's)
                with suppress(psycopg.Error):  # or after the next streamed batch
                    self.streamer.drop_chunks(sub)
                self.streamer.close()  # the second session is for large batches only

    def general_batch(
        self,
        sub: psycopg.Connection,
        prov: psycopg.Connection,
        node: nodes.Node,
        tables: list[subscriber.SubscriberTable],
        info: BatchInfo,
        appliers: dict[str, TableApplier],
        durable: bool,
    ) -> BatchStats | None:
        """Stage, carry, apply and record in one transaction; None when nothing was applied."""
        with sub.transaction():
            sub.execute(APPLY_SETTINGS if durable else APPLY_SETTINGS_ASYNC)
            lanes = None
            if self.parallel.wanted(node, info):
                lanes = self.parallel.apply(sub, prov, self.queue, node, info, appliers)
                self.phases.mark("lanes")
            now = nodes.lock_node(sub, self.queue)
            if now.provider_node != node.provider_node or now.node_type != node.node_type:
                return None  # moved (change-provider, takeover) since this round began: start again
            stats = None
            if now.last_tick is None or (now.last_tick, now.last_position) == (
                info.prev_tick_id,
                info.prev_position,
            ):
                stats = self.apply_batch(sub, prov, node, tables, info, appliers, rows_applied=lanes)
        if stats is None:
            assert now.last_tick is not None
            self.resume(prov, node, info, now.last_tick)
            return None
        self.phases.mark("commit")
        return stats

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
        streamed = None
        staged = self.ahead_batch if rows_applied is None and self.ahead_batch else None
        staged = staged if staged and staged.info.batch_id == info.batch_id else None
        decoded = staged is not None and self.ahead.decoded(staged, appliers)
        if rows_applied is None and info.events is not None:
            inline.stage_inline(sub, info.events)
            self.phases.mark("stage")
        elif decoded:
            self.phases.mark("ahead")  # its rows decoded while the batch before was applied
        elif staged is not None and staged.table is not None:
            self.ahead.unload(sub, staged)
            self.phases.mark("ahead")
        elif rows_applied is None and not carry and not node.combined_queue:
            streamed = stream.stage(self.streamer, prov, sub, info, appliers, self.queue)  # or in chunks
            self.phases.mark("stage" if streamed is None else "stream")
        elif rows_applied is None:
            stage_batch(prov, sub, info, carry=carry)
            self.phases.mark("stage")
        if node.combined_queue:
            self.drop_partition_truncates(sub)
        elif carry:
            q.carry_events(sub, self.queue, STAGE_TABLE)
        if self.fetch is not None and self.fetches_ahead(
            node, info, rows_applied is None and streamed is None
        ):
            reading = staged.table if staged is not None else None
            provider = functools.partial(nodes.provider_location, sub, node)
            self.ahead.start(provider, self.prov_node, self.fetch, info.batch_id, reading, appliers)
        try:
            if staged is not None and decoded:
                stats = self.ahead.apply_decoded(sub, staged, self.queue)
            else:
                stats = streamed or apply_staged(sub, appliers, queue=self.queue, ddl=DdlReplay(node).replay)
        finally:
            if self.ahead.join():
                self.finished_ahead = info.batch_id
        if rows_applied is not None:
            stats.add(rows_applied)
        pause_point("applied-not-recorded", events=stats.count)  # written, the tick not recorded
        self.phases.mark("apply")
        if node.combined_queue:
            merge_staged(sub, node.combined_queue, self.queue, info.cur_tick_id, list(appliers))
        if stats.table_list is not None:
            self.drop_tables_left_the_set(sub, prov, stats.table_list)
            if node.role.copies_events:
                set_tables.mirror_set_tables(sub, self.queue, set_tables.set_table_rows(prov, self.queue))
        if node.role.copies_events:
            q.branch_tick(sub, self.queue, info.cur_tick_id, info.cur_tick_time, info.cur_tick_event_seq)
        nodes.record_applied(sub, self.queue, info.cur_tick_id, info.cur_position)
        subscriber_seqs.set_values(sub, self.queue, self.seqs, info.seq_values)
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

    @staticmethod
    def drop_partition_truncates(sub: psycopg.Connection) -> None:
        """A partition's TRUNCATE would empty the merged table of every partition: not applied."""
        n = sub.execute(f"delete from {STAGE_TABLE} where ev_type = 'R'").rowcount
        if n:
            log.warning("merge-leaf: %d TRUNCATE events of the partition not applied to the merged tables", n)

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
            roundtrip.settle(prov)
            formats = set_tables.event_formats(prov, self.queue)
            self.appliers = {
                t.table_name: TableApplier.build(sub, prov, t, formats.get(t.table_name, "json")) for t in ok
            }
            self.applier_key = key
        return self.appliers


def merge_staged(sub: psycopg.Connection, combined: str, part: str, tick: int, tables: list[str]) -> int:
    """A merge-leaf: insert the staged row events of `tables` into this database's combined
    queue, with new ids in the same order, and a marker saying which tick of `part` they go to
    (a combined-failover node follows the partition's position by it)."""
    n = q.insert_staged(sub, combined, STAGE_TABLE, tables)
    q.insert_event(sub, combined, "pgcascade.part-tick", str(tick), part)
    return n
