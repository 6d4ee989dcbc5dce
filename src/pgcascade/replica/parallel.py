"""A large batch applied on several connections at once: a leaf catching up uses more than one
core of the subscriber.

A batch of at least `parallel_apply_min_events` events on a leaf with `apply_connections` > 1,
holding no TRUNCATE or EXECUTE (those go serially, in order), is split by table: tables that a
foreign key joins stay together, and the groups are spread over the lanes by their event
counts.  Each lane streams its tables' events from the provider into its own staging table and
applies them set-based (apply.py), in one transaction per lane that also sets those tables'
`applied_tick` to the batch's tick.  When every lane has committed, the worker's own
transaction applies the batch's other events, moves `node.last_tick` and finishes the batch
as usual.

Exactly once without two-phase commit: a lane commits only while the node is still at the
batch's first tick (it holds the node row FOR SHARE), and a table whose `applied_tick` has
reached a batch's last tick is left out of that batch, by lanes and by the serial path alike.
After a crash between the lanes' commits and the worker's, the worker never cuts a batch past
the lowest `applied_tick` above `last_tick` (`ahead_of`), so every table's events up to it are
applied once, by the lane or by the retry.  What parallel apply gives up: readers of the
subscriber may see one table group a batch ahead of another for the moment between the lanes'
commits and the worker's (each table's own changes stay whole and in order).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import psycopg

from pgcascade.core import catalog, pgconn
from pgcascade.core.hooks import pause_point
from pgcascade.pgq import node as nodes
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import APPLY_SETTINGS, BatchStats, TableApplier, apply_staged
from pgcascade.replica.stage import clear_stage, ensure_stage, stage_batch, staged_barriers

log = logging.getLogger("pgcascade.replay")


def ahead_of(tables: list[subscriber.SubscriberTable], last_tick: int | None) -> int | None:
    """The lowest tick a lane committed some table up to beyond the node's last tick: the
    next batch must end there (or before), never past it."""
    marks = [t.applied_tick for t in tables if t.state.is_ok and t.applied_tick is not None]
    return min((m for m in marks if m > (last_tick or 0)), default=None)


def left_out(tables: list[subscriber.SubscriberTable], cur_tick: int) -> set[str]:
    """Tables a lane already applied this batch's events of."""
    return {t.table_name for t in tables if t.applied_tick is not None and t.applied_tick >= cur_tick}


def table_groups(links: list[tuple[str, str]], names: list[str]) -> list[list[str]]:
    """`names` split into groups no link crosses (connected components)."""
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in links:
        if a in parent and b in parent:
            parent[root(a)] = root(b)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)
    return list(groups.values())


def spread(groups: list[list[str]], weight: dict[str, float], lanes: int) -> list[list[str]]:
    """Groups onto at most `lanes` lanes, heaviest first onto the lightest lane."""
    loads = [0.0] * min(lanes, len(groups))
    plan: list[list[str]] = [[] for _ in loads]
    for g in sorted(groups, key=lambda g: -sum(weight.get(t, 0) for t in g)):
        i = loads.index(min(loads))
        loads[i] += sum(weight.get(t, 0) for t in g)
        plan[i] += g
    return [tables for tables in plan if tables]


class Moved(Exception):
    """The node is no longer where the batch starts (applied meanwhile, moved provider)."""


@dataclass
class Lane:
    """One connection pair of a parallel apply, kept from batch to batch."""

    db: str
    sub: psycopg.Connection | None = None
    prov: psycopg.Connection | None = None
    provider: str = ""

    def connect(self, provider_location: str) -> None:
        if self.prov is not None and (self.prov.closed or self.provider != provider_location):
            self.close()
        if self.sub is None or self.sub.closed:
            self.sub = pgconn.connect(self.db, autocommit=True, connect_timeout=10)
            self.sub.execute("set application_name = 'pgcascade worker lane'")
            ensure_stage(self.sub)
        if self.prov is None or self.prov.closed:
            self.prov = pgconn.connect(provider_location, autocommit=True, connect_timeout=10)
            self.provider = provider_location

    def close(self) -> None:
        for c in (self.sub, self.prov):
            if c is not None:
                c.close()
        self.sub = self.prov = None

    def apply(
        self, queue: str, node: nodes.Node, info: BatchInfo, appliers: dict[str, TableApplier]
    ) -> BatchStats:
        """This lane's tables of the batch, in one transaction that marks them applied."""
        assert self.sub is not None and self.prov is not None
        assert info.batch_id is not None and info.cur_tick_id is not None
        sub = self.sub
        try:
            with sub.transaction():
                sub.execute(APPLY_SETTINGS)
                now = nodes.lock_node(sub, queue, share=True)
                if now.provider_node != node.provider_node or now.last_tick not in (None, info.prev_tick_id):
                    raise Moved
                done = subscriber.lock_applied_ticks(sub, queue, list(appliers))
                todo = [t for t in appliers if (done.get(t) or 0) < info.cur_tick_id]
                if not todo:
                    return BatchStats()
                started = time.monotonic()
                stage_batch(self.prov, sub, info, only_tables=todo)  # their row events
                staged = time.monotonic()
                stats = apply_staged(sub, {t: appliers[t] for t in todo})
                subscriber.mark_applied(sub, queue, todo, info.cur_tick_id)
                applied = time.monotonic()
            log.info(
                "lane %s: {count: %d, stage: %.3f, apply: %.3f, commit: %.3f}",
                ",".join(todo),
                stats.count,
                staged - started,
                applied - staged,
                time.monotonic() - applied,
            )
            return stats
        except BaseException:
            self.close()  # a connection left mid-COPY or mid-transaction is not reused
            raise


@dataclass
class ParallelApply:
    db: str
    lanes: int
    min_events: int
    pool: ThreadPoolExecutor | None = None
    pool_size: int = 0
    idle: list[Lane] = field(default_factory=list)
    groups_key: tuple = ()
    groups: list[list[str]] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)  # events per batch, by table, smoothed

    def wanted(self, node: nodes.Node, info: BatchInfo) -> bool:
        """A leaf's batch big enough to be worth the lanes (the tick sequence counts events);
        never one read between ticks (batch id 0: it comes inline, and nothing of it is open on
        the provider for the lanes to read)."""
        if self.lanes < 2 or node.role.copies_events or node.combined_queue or not info.batch_id:
            return False
        return info.numbered >= self.min_events

    def apply(
        self,
        sub: psycopg.Connection,
        prov: psycopg.Connection,
        queue: str,
        node: nodes.Node,
        info: BatchInfo,
        appliers: dict[str, TableApplier],
    ) -> BatchStats | None:
        """Inside the worker's batch transaction, before it locks the node: stage the batch's
        other events, then have the lanes apply and commit the row events.  None (nothing
        staged) where the batch must go serially: it holds TRUNCATE or EXECUTE, or the node
        moved."""
        assert info.batch_id is not None
        stage_batch(prov, sub, info, row_events=False)
        if staged_barriers(sub):
            clear_stage(sub)
            return None
        plan = spread(self.table_groups(sub, appliers), self.weight(sub, appliers), self.lanes)
        if not plan:  # every table left out (lanes applied them before a crash): the rest is ours
            return BatchStats()
        location = nodes.provider_location(sub, node)
        lanes = [self.idle.pop() if self.idle else Lane(self.db) for _ in plan]
        try:
            for lane in lanes:
                lane.connect(location)
            if self.pool is None or self.pool_size < len(plan):  # lanes may grow on reload
                if self.pool is not None:
                    self.pool.shutdown(wait=True)
                self.pool, self.pool_size = (
                    ThreadPoolExecutor(len(plan), thread_name_prefix="lane"),
                    len(plan),
                )
            futures = [
                self.pool.submit(lane.apply, queue, node, info, {t: appliers[t] for t in tables})
                for lane, tables in zip(lanes, plan, strict=True)
            ]
            wait(futures)  # every lane has ended before an error goes up or a lane is reused
            results = [f.result() for f in futures]
        except Moved:
            clear_stage(sub)
            return None
        finally:
            self.idle.extend(lanes)
        stats = BatchStats()
        for r in results:
            stats.add(r)
        pause_point("lanes-committed", events=stats.count)
        for t in appliers:  # what each table brought, to spread the next batch
            self.weights[t] = 0.5 * self.weights.get(t, 0.0) + 0.5 * stats.per_table.get(t, 0)
        return stats

    def weight(self, sub: psycopg.Connection, appliers: dict[str, TableApplier]) -> dict[str, float]:
        """Events each table brought to the last batches; before the first, its size."""
        if all(t in self.weights for t in appliers):
            return self.weights
        return {t: float(catalog.estimated_rows(sub, a.dest) or 0) for t, a in appliers.items()}

    def table_groups(self, sub: psycopg.Connection, appliers: dict[str, TableApplier]) -> list[list[str]]:
        """The tables grouped so that tables a foreign key joins (at the destination) commit
        together; the links are read again when the set of tables changes."""
        key = tuple(sorted((t, a.dest) for t, a in appliers.items()))
        if key != self.groups_key:
            by_dest = {a.dest: t for t, a in appliers.items()}
            links = catalog.foreign_key_links(sub, list(by_dest))
            same_dest = [(t, by_dest[a.dest]) for t, a in appliers.items()]
            self.groups = table_groups(
                [(by_dest[a], by_dest[b]) for a, b in links] + same_dest, list(appliers)
            )
            self.groups_key = key
        return self.groups

    def close(self) -> None:
        for lane in self.idle:
            lane.close()
        self.idle.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
