"""A two-way master's apply of one batch of a peer's queue, in few round trips.

The same transaction as any batch (worker.py): the node row locked, the batch's events staged,
applied, the tick recorded - with what only a peer's batch has (the origin and whether to pass
the changes on, `pgcascade.peer_apply_begin`; the conflict policies; the peer's markers and this
master's own, `pgcascade.peer_batch_done`).

A small batch (at most SMALL_BATCH events of the peer's own, only row changes and markers - the
common case when changes trickle in) is read from the peer into memory and applied in ONE round
trip, one message of the simple query protocol as a one-way batch (inline.py): BEGIN, the
batch's events as JSON arrays in settings of the transaction (each table's in its own, the
markers in another: peer_apply.peer_events), the checks the step-by-step way makes by looking
(`pgcascade.peer_batch_begin` refuses the batch when the node is not where the batch starts,
or the policies changed), each table's two statements (peer_apply.py; or one that needs no
judging, peer_fast.py) PREPAREd (prepared.py: values as literals, the tick as their one
parameter), the markers and the tick applied (`pgcascade.peer_batch_end`; its peer_batch_done
reads the same setting) and COMMIT.  Nothing is staged: a transaction that touches the
temporary stage pays for its truncation at commit, more than the rest of a small batch.  Such a
batch never holds a TRUNCATE (FAST_TYPES), which reads the stage (94_two_way_truncate.sql).  Any
other batch, or one refused or failing so, goes step by step: BEGIN, one pipeline, the COPY of
the events, the barriers' look-up, one pipeline of the tables' statements, one of the
bookkeeping, and COMMIT.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from psycopg import sql

from pgcascade.core import roundtrip
from pgcascade.core.errors import RuntimeFailure, db_error_line
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import inline, peer_apply, peer_fast, prepared
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import BatchStats, TableApplier, apply_staged
from pgcascade.replica.conflicts import DEFAULT_POLICY
from pgcascade.replica.ddl import DdlReplay, await_origins
from pgcascade.replica.inline import Fresh
from pgcascade.replica.peer_apply import PEER_SEEN, PEER_SELECT, PEER_TIME, PeerBatch
from pgcascade.replica.stage import stage_batch

log = logging.getLogger("pgcascade.replay")

# in one statement (a pipeline takes one statement per call): the apply's role, and a commit that
# does not wait for its WAL flush, as a leaf's (batch.commits_async: a crash that takes batches
# back makes the worker apply them again from this node's record; its peer keeps them)
SETTINGS = "select set_config('session_replication_role', 'replica', true), set_config('synchronous_commit', 'off', true)"
# and for a batch in one round trip, generic plans: a statement is PREPAREd again every second
# (prepared.py), and the plan cache made its first five executions custom plans, each planned
# anew (the apply statement's planning was 6% of the worker's backend CPU at 200 tps a master)
ONE_TRIP_SETTINGS = SETTINGS + ", set_config('plan_cache_mode', 'force_generic_plan', true)"
SMALL_BATCH = 2000  # events of a batch applied in one round trip, from memory,
SMALL_EVENT = 16384  # each of at most this many bytes of data (memory stays bounded)
# the peer's own events and the DDL it passed on (worker.py waits for its origin), a larger
# event's type left out (null: the batch goes step by step)
SMALL_SELECT = (
    "select ev_id, ev_txid, case when coalesce(octet_length(ev_data), 0) <= {size} then ev_type end,"
    " case when coalesce(octet_length(ev_data), 0) <= {size} then ev_data end,"
    " ev_extra1, ev_time, ev_extra2, ev_extra3, ev_extra4"
    " from (select {peer} from ({batch}) b where ev_extra4 is null or ev_type = 'EXECUTE')"
    " e (ev_id, ev_txid, ev_type, ev_data, ev_extra1, ev_time, ev_extra2, ev_extra3, ev_extra4) limit {limit}"
)
REFUSED = ("PCB01", "PCB02")  # pgcascade.peer_batch_begin: go step by step
FAST_TYPES = frozenset({"I", "U", "D", PEER_SEEN})
# a table whose statement without judging found a reason to judge is tried so again at its next
# batch (the judged batch may have made its rows the peer's: rows both masters start with), then
# after 1, 2, 4 ... seconds while it goes on finding one, at most UNJUDGED_PAUSE (rows both
# masters write: one failed try a minute)
UNJUDGED_PAUSE = 60.0
BATCH_DONE = "select pgcascade.peer_batch_done(%s, %s, %s, %s, %s)"
BATCH_END = "select pgcascade.peer_batch_end(%s, %s, %s, %s, %s)"  # and the tick applied, the sequences


@dataclass
class PeerState:
    """What a peer subscription's worker keeps between batches: the policies its statements
    were composed by (checked in each one-round-trip batch), as the last step-by-step one read."""

    policy: str = DEFAULT_POLICY
    policies: dict[str, str] | None = None
    policies_hash: str | None = None
    # per table: how many times in a row its statement without judging found a reason to judge,
    # and when it may be tried again (UNJUDGED_PAUSE)
    unjudged_failures: dict[str, int] = field(default_factory=dict)
    unjudged_after: dict[str, float] = field(default_factory=dict)

    def judging_found(self, table: str) -> None:
        """The table's statement without judging found a reason to judge: when to try it again."""
        n = self.unjudged_failures[table] = self.unjudged_failures.get(table, 0) + 1
        self.unjudged_after[table] = time.monotonic() + (
            0.0 if n == 1 else min(UNJUDGED_PAUSE, 2.0 ** (n - 2))
        )

    def unjudged_applied(self, tables: Iterable[str]) -> None:
        """These tables' statements without judging wrote their rows."""
        for t in tables:
            self.unjudged_failures.pop(t, None)

    def batch(self, node: nodes.Node, tick: int) -> PeerBatch:
        """The peer's batch at `tick`, applied by these policies."""
        assert self.policies is not None
        return PeerBatch.of(node, tick, self.policy, self.policies)


def apply_batch(
    sub: psycopg.Connection,
    prov: psycopg.Connection,
    node: nodes.Node,
    info: BatchInfo,
    appliers: dict[str, TableApplier],
    prov_logical: bool,
    state: PeerState,
    known: Fresh | None = None,
) -> tuple[nodes.Node, BatchStats | None, Fresh | None, str | None]:
    """Apply the peer's batch `info` in one transaction; returns the node row as locked, and the
    stats, or None when the batch does not start where this node's record says it is, or the
    node changed since the round began (nothing applied then); after a batch applied in one
    round trip, the node and its tables for the next round (read after its commit, or `known`:
    inline.fresh_after); and the WAL position after the commit (None if nothing was applied)."""
    assert info.cur_tick_id is not None and node.peer_of is not None and node.provider_node is not None
    # what this master's marker tells its peers: the tick's snapshot (next_batch reads it
    # with its statement's snapshot, which a tick committed in the meantime is not in)
    snapshot = info.cur_tick_snapshot or q.tick_snapshot(prov, node.queue_name, info.cur_tick_id)
    if snapshot is None:
        raise RuntimeFailure(f"tick {info.cur_tick_id} of {node.queue_name} is gone from the queue")
    if state.policies is not None:
        events = small_batch(prov, info, prov_logical)
        if events is not None:
            try:
                return node, *apply_in_one(sub, prov, node, info, appliers, state, events, snapshot, known)
            except psycopg.Error as e:
                if e.sqlstate not in REFUSED:
                    for a in appliers.values():  # composed again: a table's columns may have changed
                        a.peer_sql.clear()
                    if isinstance(e, psycopg.OperationalError):
                        raise  # applied again at once (40001, a deadlock), or the connection is gone
                    # step by step, which says which table failed and why (a policy 'error', DDL)
                    log.info("peer batch %s: step by step after: %s", info.cur_tick_id, db_error_line(e))
    now, stats = apply_step_by_step(sub, prov, node, info, appliers, prov_logical, state, snapshot)
    lsn = None if stats is None else str(scalar(sub, inline.WAL_AFTER_COMMIT))
    return now, stats, None, lsn


def small_batch(prov: psycopg.Connection, info: BatchInfo, prov_logical: bool) -> list[tuple] | None:
    """The peer's own events of the batch (inline, when the fetch brought them, else read by
    query), when there are at most SMALL_BATCH, each of at most SMALL_EVENT bytes, and only row
    changes and markers among them; else None."""
    assert info.batch_id is not None
    if info.events is not None:  # inline (next_batch_events), with the peer's commit times
        rows = [own_event(e) for e in json.loads(info.events) if e[8] is None or e[2] == "EXECUTE"]
        return small_or_none(rows)
    batch_sql = info.event_sql or q.batch_event_sql(prov, info.batch_id)
    rows = prov.execute(
        sql.SQL(SMALL_SELECT).format(
            peer=sql.SQL(PEER_SELECT.format(PEER_TIME[prov_logical])),
            batch=sql.SQL(batch_sql),  # composed by the provider's own function, with quoted literals
            size=sql.Literal(SMALL_EVENT),
            limit=sql.Literal(SMALL_BATCH + 1),
        )
    ).fetchall()
    return small_or_none(rows)


def small_or_none(rows: list[tuple]) -> list[tuple] | None:
    """The batch's own events, when they make a small batch; else None."""
    if len(rows) > SMALL_BATCH or any(r[2] not in FAST_TYPES for r in rows):
        return None
    return rows


def own_event(e: list) -> tuple:
    """An inline event as SMALL_SELECT reads it: the type left out (null) past SMALL_EVENT bytes."""
    data = e[3]
    if data is not None and len(data) > SMALL_EVENT // 4 and len(data.encode()) > SMALL_EVENT:
        return (e[0], e[1], None, None, *e[4:])
    return tuple(e)


def one_kind(events: list[tuple]) -> dict[str, str]:
    """The tables whose row events in `events` are all inserts or all updates, and that kind."""
    kinds: dict[str, set[str]] = {}
    for e in events:
        if e[2] != PEER_SEEN:
            kinds.setdefault(e[4], set()).add(e[2])
    return {t: k.pop() for t, k in kinds.items() if k in ({peer_fast.INSERT}, {peer_fast.UPDATE})}


def apply_in_one(
    sub: psycopg.Connection,
    prov: psycopg.Connection,
    node: nodes.Node,
    info: BatchInfo,
    appliers: dict[str, TableApplier],
    state: PeerState,
    events: list[tuple],
    snapshot: str,
    known: Fresh | None,
    unjudged: bool = True,
) -> tuple[BatchStats, Fresh, str]:
    """The small batch `events` in one round trip (the module's docstring), the node and its
    tables for the next round (inline.fresh_after), and the WAL position after it.  With
    `unjudged`, a table whose events are all inserts or all updates is applied by a statement
    that needs no judging (peer_fast.py) unless paused; if one finds a reason to judge, the
    message is sent again with every table's judging statements (PeerState.judging_found says
    when that table's statement is tried again)."""
    assert info.cur_tick_id is not None and node.peer_of is not None and node.provider_node is not None
    assert state.policies is not None
    peer = state.batch(node, info.cur_tick_id)
    stats = BatchStats(count=len(events))
    rows = Counter(e[4] for e in events if e[2] != PEER_SEEN)
    kinds = one_kind(events) if unjudged else {}
    now = time.monotonic()
    todo: list[tuple[str, tuple[bytes, ...]]] = []  # each table's statements, the last its conflicts
    without_judging: list[str] = []  # the tables given a statement of peer_fast.py
    for table, n in sorted(rows.items()):
        stats.per_table[table] = n
        a = appliers.get(table)
        # (each table's statements composed before the message: composing reads the catalog)
        fast = peer_fast.statement(sub, a, peer, kinds[table]) if a and table in kinds else None
        if a is None:
            stats.ignored += n
        elif fast is not None and state.unjudged_after.get(table, 0.0) <= now:
            todo.append((table, (fast,)))
            without_judging.append(table)
        else:
            todo.append((table, peer_apply.inline_statement(sub, a, peer)))
    reads = inline.read_statements(sub, node.queue_name, known)
    prepared.ensure(sub, [*(body for _t, bodies in todo for body in bodies), *reads])
    bind = functools.partial(roundtrip.compose, sub)
    settings = [
        (peer_apply.SEEN_SETTING, as_json(e for e in events if e[2] == PEER_SEEN)),
        (peer_apply.CHANGES_SETTING, "on" if rows else "off"),
        *(
            (
                peer_apply.events_setting(table),
                as_json(e for e in events if e[4] == table and e[2] != PEER_SEEN),
            )
            for table, _ in todo
        ),
    ]
    tick = str(info.cur_tick_id).encode()
    applies = [
        prepared.execute(body, tick if body is bodies[-1] else b"") for _t, bodies in todo for body in bodies
    ]
    statements = [
        b"begin",
        bind(
            ONE_TRIP_SETTINGS + ", set_config(%s, %s, true)" * len(settings),
            [v for pair in settings for v in pair],
        ),
        bind(
            "select pgcascade.peer_batch_begin(%s, %s, %s, %s, %s)",
            (node.peer_of, node.queue_name, node.provider_node, info.prev_tick_id, state.policies_hash),
        ),
        *applies,
        bind(BATCH_END, (peer.own_queue, node.queue_name, peer.peer, info.cur_tick_id, snapshot)),
        b"commit",
        inline.WAL_AFTER_COMMIT,
        *(prepared.execute(body) for body in reads),
    ]
    # one message, as inline.py; a result per statement: the apply statements' conflicts (each
    # table's last), the sequences, the WAL position after the commit, the node and its tables
    try:
        results = prepared.run(sub, statements)
    except psycopg.Error as e:
        if e.sqlstate != "PCROW" or not without_judging:
            raise
        log.info(
            "peer batch %s: %s; applying it with the judging statements", info.cur_tick_id, db_error_line(e)
        )
        failed = e.diag.message_detail
        for table in [failed] if failed in without_judging else without_judging:
            state.judging_found(table)
        return apply_in_one(sub, prov, node, info, appliers, state, events, snapshot, known, unjudged=False)
    state.unjudged_applied(without_judging)
    ends = itertools.accumulate(len(bodies) for _t, bodies in todo)
    stats.conflicts = sum(int(roundtrip.load_rows(sub, results[2 + end])[0][0]) for end in ends)
    seqs, _commit, lsn = results[len(results) - len(reads) - 3 : len(results) - len(reads)]
    if roundtrip.load_rows(sub, seqs)[0][0]:
        # as a rule none: they only ever move up, so after the commit is as good
        subscriber_seqs.sync_sequences(prov, sub, node.queue_name)
    fresh = inline.fresh_after(sub, results, known, info.cur_tick_id, None)
    return stats, fresh, lsn.get_value(0, 0).decode()  # type: ignore[union-attr]


def as_json(events: Iterable[tuple]) -> str:
    """Events as the small batch's settings hold them (peer_apply.peer_events), times to the
    microsecond."""
    return json.dumps([e[:7] for e in events], default=datetime.isoformat, ensure_ascii=False)


def apply_step_by_step(
    sub: psycopg.Connection,
    prov: psycopg.Connection,
    node: nodes.Node,
    info: BatchInfo,
    appliers: dict[str, TableApplier],
    prov_logical: bool,
    state: PeerState,
    snapshot: str,
) -> tuple[nodes.Node, BatchStats | None]:
    """Any batch, looking at each step's answer before the next (the module's docstring)."""
    assert info.cur_tick_id is not None and node.peer_of is not None and node.provider_node is not None
    with sub.transaction():
        with sub.pipeline():
            sub.execute(SETTINGS)
            locked = nodes.locking_node(sub, node.queue_name)
            sub.execute("select pgcascade.peer_apply_begin(%s, %s)", (node.peer_of, node.provider_node))
            policies = sub.execute(subscriber.PEER_POLICIES, (node.queue_name,))
            policies_hash = sub.execute("select pgcascade.peer_policies_hash(%s)", (node.queue_name,))
            seqs = sub.execute(subscriber_seqs.SEQS, (node.queue_name,))
        now = locked.fetchone()
        if now is None:
            raise psycopg.errors.NoDataFound(f"node row of {node.queue_name} is gone")
        if now.provider_node != node.provider_node or now.node_type != node.node_type:
            return now, None  # moved since this round began: start again
        if now.last_tick is not None and now.last_tick != info.prev_tick_id:
            return now, None
        state.policy, state.policies = now.conflict_policy or DEFAULT_POLICY, dict(policies.fetchall())
        state.policies_hash = (policies_hash.fetchone() or (None,))[0]
        peer = state.batch(node, info.cur_tick_id)
        stage_batch(prov, sub, info, peer=True, peer_logical=prov_logical)
        await_origins(sub, node, info.cur_tick_id)
        stats = apply_staged(sub, appliers, queue=node.queue_name, peer=peer, ddl=DdlReplay(node).replay)
        with sub.pipeline():
            bookkeeping(sub, node, peer, info.cur_tick_id, snapshot)
        if seqs.fetchall():  # a peer's sequences are spread, not followed: none, as a rule
            subscriber_seqs.sync_sequences(prov, sub, node.queue_name)
    return now, stats


def bookkeeping(sub: psycopg.Connection, node: nodes.Node, peer: PeerBatch, tick: int, snapshot: str) -> None:
    """In the batch's transaction: the peer's markers, this master's own, the tick applied."""
    sub.execute(BATCH_DONE, (peer.own_queue, node.queue_name, peer.peer, tick, snapshot))
    nodes.record_applied(sub, node.queue_name, tick)
