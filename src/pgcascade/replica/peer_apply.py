"""The apply of a two-way peer's batch: one set-based statement per table, conflicts included.

For each table with row events in the batch (staged, or for a small batch held in settings of
the transaction: peer_worker.py), one statement (composed here once per table and policy, all
tables of a batch sent together, each after the statement that locks its rows) does what the
docs (docs/two-way.md, "Conflicts") describe:

1. the net change per key (the last event wins; the first says how the peer's change began);
2. the local row and its version: `row_version` for rows a peer's apply wrote and for
   tombstones, `peer_copy` for rows of a first copy, else this master's own commit time of the
   row's `xmin`;
3. whether the peer had seen that version (the batch's `pgcascade.peer-seen` markers, else what
   was last known in `peer_seen`), the conflict kind, and the winner by the table's policy
   (conflicts.winner_sql);
4. the conflict log, the writes (DELETE and UPDATE by the judged rows' ctid, INSERT ... ON
   CONFLICT DO NOTHING for new keys) and the versions of the rows written.

Before it, a statement of its own locks the local rows of the batch's keys (FOR UPDATE, in key
order: a local transaction changing one is waited for).  The apply statement's snapshot, taken
after, sees their last versions, and nothing changes them until the batch commits, so a local
write is never overwritten unjudged - and under contention on hot rows the batch is not judged
in vain (judging first and checking the rows after made it start again for as long as a local
transaction kept changing one of its rows: 15 times in a row in bench/two_way_bench.py).
What the lock cannot hold is a key absent then that a local transaction inserts meanwhile: the
INSERT then writes fewer rows than judged, and the batch is applied again (SQLSTATE 40001).
Versions in `row_version` are read under the same snapshot: nothing but this worker writes
them for a row that exists, and a tombstone of a local DELETE committed before the lock is in
it.  The statements run without a savepoint, so the rows written carry the apply's own
transaction id (row_version.xid).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import psycopg
from psycopg import sql

from pgcascade.core import catalog
from pgcascade.pgq import node as nodes
from pgcascade.replica.conflicts import DEFAULT_POLICY, ConflictPolicy, winner_sql
from pgcascade.replica.tables import peer_policies

# a two-way peer's batch: the peer's own changes only (those its apply wrote for another master
# carry that master in ev_extra4: that master sends them itself), and as ev_time each change's
# commit time on the peer, which conflicts are resolved by (logical capture writes it as the
# event's ev_time; a trigger's event has the commit time of its ev_txid)
PEER_SEEN = "pgcascade.peer-seen"  # a master's marker: how far it had applied each other master
PEER_SELECT = "ev_id, ev_txid, ev_type, ev_data, ev_extra1, {}, ev_extra2, ev_extra3, ev_extra4"
PEER_TIME = {False: "coalesce(pgcascade.commit_time(ev_txid::text::xid8), ev_time)", True: "ev_time"}

# where the statements read the batch's events from: the staging table (a batch applied step by
# step), or (a small batch applied in one round trip, peer_worker.py) JSON arrays of [ev_id,
# ev_txid, ev_type, ev_data, ev_extra1, ev_time, ev_extra2] set in the transaction: each
# table's events in a setting of its own (events_setting), the peer's markers in SEEN_SETTING.
# Nothing is written to a temporary table then (its rows and its truncation at commit cost more
# than the rest of a small batch), and each statement parses only the events it reads: jsonb,
# whose elements' fields are read without parsing them again (as json's are)
STAGE = sql.SQL("pg_temp.pgcascade_stage")
SEEN_SETTING = "pgcascade.peer_markers"
CHANGES_SETTING = "pgcascade.peer_changes"  # 'on': the batch has changes (pgcascade.peer_batch_done)


def events_setting(table: str) -> str:
    """The setting that holds a small batch's events of `table`."""
    return "pgcascade.peer_events_" + hashlib.sha1(table.encode()).hexdigest()[:16]


def peer_events(setting: str) -> sql.Composed:
    """The events a small batch's transaction holds in `setting`, as the stage's columns."""
    return sql.SQL(
        "(select (e->>0)::int8 as ev_id, e->>2 as ev_type, e->>3 as ev_data, e->>4 as ev_extra1,"
        " (e->>5)::timestamptz as ev_time, e->>6 as ev_extra2 from jsonb_array_elements(current_setting({})::jsonb) e)"
    ).format(sql.Literal(setting))


# the batch's tick, in the statements over the settings: the one parameter of the prepared statement
# (it only names the versions written, so the generic plan is the custom one)
TICK_PARAM = sql.SQL("$1::int8")


@dataclass(frozen=True)
class PeerBatch:
    """A two-way peer's batch being applied here: whose, which tick, with which policies."""

    queue: str  # the peer's queue
    peer: str  # the peer master's node name
    me: str  # this master's node name
    own_queue: str  # the queue this master is the root of
    tick: int  # the batch's tick on the peer's queue
    policy: str
    policies: dict[str, str]  # per-table policies

    @classmethod
    def of(cls, node: nodes.Node, tick: int, policy: str, policies: dict[str, str]) -> PeerBatch:
        """The batch at `tick` of the peer subscription `node`."""
        assert node.provider_node is not None and node.peer_of is not None
        return cls(node.queue_name, node.provider_node, node.node_name, node.peer_of, tick, policy, policies)


def peer_batch(sub: psycopg.Connection, node: nodes.Node, tick: int) -> PeerBatch | None:
    """In the transaction of a batch of `node`'s queue: a two-way peer's batch is written as the
    peer's, passed on to the subscribers under this master if there are any
    (`pgcascade.peer_apply_begin`), and applied with conflicts resolved by the policies; None
    for any other node."""
    if not node.is_peer:
        return None
    assert node.provider_node is not None and node.peer_of is not None
    sub.execute("select pgcascade.peer_apply_begin(%s, %s)", (node.peer_of, node.provider_node))
    return PeerBatch.of(
        node, tick, node.conflict_policy or DEFAULT_POLICY, peer_policies(sub, node.queue_name)
    )


class PeerTable(Protocol):
    """What the statement is composed for (a replica.apply.TableApplier)."""

    table: str
    dest: str
    keys: list[str]
    json_nulls: bool
    peer_sql: dict[tuple[str, str, str, bool], tuple[bytes, bytes]]


def statement(sub: psycopg.Connection, t: PeerTable, peer: PeerBatch) -> tuple[bytes, bytes]:
    """The table's statements over the staged batch for this peer and policy, the lock and the
    apply, run in this order with the same parameters (composed once, then reused until the
    table's columns change: the apply checks that, and the batch is applied again)."""
    policy = peer.policies.get(t.table, peer.policy)
    key = (peer.peer, peer.me, policy, False)
    found = t.peer_sql.get(key)
    if found is None:
        apply = compose(sub, t, peer.peer, peer.me, ConflictPolicy.parse(policy))
        found = t.peer_sql[key] = (lock(sub, t).as_bytes(sub), apply.as_bytes(sub))
    return found


def inline_statement(sub: psycopg.Connection, t: PeerTable, peer: PeerBatch) -> tuple[bytes, bytes]:
    """The same two over the settings of a small batch, their values as literals but the
    tick ($1), to be PREPAREd (replica/prepared.py)."""
    policy = peer.policies.get(t.table, peer.policy)
    key = (peer.peer, peer.me, policy, True)
    found = t.peer_sql.get(key)
    if found is None:
        source = peer_events(events_setting(t.table))
        apply = compose(
            sub, t, peer.peer, peer.me, ConflictPolicy.parse(policy), source, peer_events(SEEN_SETTING)
        )
        values = params(t, 0, 2**63 - 1, peer)  # every event of the batch
        bind = psycopg.ClientCursor(sub).mogrify
        found = t.peer_sql[key] = (
            bind(lock(sub, t, source).as_bytes(sub), values).encode(),
            bind(apply.as_bytes(sub), values).encode(),
        )
    return found


def lock(sub: psycopg.Connection, t: PeerTable, source: sql.Composable = STAGE) -> sql.Composed:
    """The statement that locks the local rows of the keys the batch changes, in key order,
    before the apply statement reads them (see the module's docstring); the events are read
    from `source` (STAGE or peer_events)."""
    parts = TableParts.of(sub, t)
    return sql.SQL(LOCK).format(
        rkeys=parts.rkeys,
        tkeys=sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(k)) for k in t.keys),
        match=sql.SQL(" and ").join(sql.SQL("t.{0} = n.{0}").format(sql.Identifier(k)) for k in t.keys),
        populate=parts.populate,
        dest=sql.SQL(t.dest),
        source=source,
    )


def params(t: PeerTable, lo: int, hi: int, peer: PeerBatch) -> dict:
    return {"t": t.table, "lo": lo, "hi": hi, "tick": peer.tick, "queue": peer.queue}


@dataclass(frozen=True)
class TableParts:
    """What the statements of a table are composed from, as its columns are here now."""

    dest: str
    keys: list[str]
    cols: list[catalog.Column]  # every column but the generated ones
    signature: str  # pgcascade.columns_signature: the apply checks it is still the same
    # the row of an event (s.ev_data), with the values of old rows for the columns it lacks
    populate: sql.Composed
    rkeys: sql.Composed  # r.key, ...

    @classmethod
    def of(cls, sub: psycopg.Connection, t: PeerTable) -> TableParts:
        """The table's parts, read from the catalog."""
        cols = [c for c in catalog.columns(sub, t.dest) if not c.generated]
        base, signature = sub.execute(
            "select pgcascade.missing_row_expr(%s::regclass), pgcascade.columns_signature(%s::regclass)",
            (t.dest, t.dest),
        ).fetchone() or ("", "")
        populate = sql.SQL(
            "pgcascade.event_row({}, s.ev_data)"
            if t.json_nulls
            else "json_populate_record({}, s.ev_data::json)"
        ).format(sql.SQL(base))
        rkeys = sql.SQL(", ").join(sql.SQL("r.{}").format(sql.Identifier(k)) for k in t.keys)
        return cls(t.dest, t.keys, cols, signature, populate, rkeys)

    def insert(self, name: str, source: sql.Composable) -> sql.Composed:
        """The CTE `name` that inserts the rows `r` of `source` (aliased d) whose keys are absent."""
        return sql.SQL(
            "{name} as (insert into {dest} ({cols}){overriding} select {rcols} from {source}"
            " on conflict ({keys}) do nothing returning 1)"
        ).format(
            name=sql.Identifier(name),
            dest=sql.SQL(self.dest),
            cols=sql.SQL(", ").join(sql.Identifier(c.name) for c in self.cols),
            overriding=sql.SQL(" overriding system value" if any(c.identity for c in self.cols) else ""),
            rcols=sql.SQL(", ").join(sql.SQL("(d.r).{}").format(sql.Identifier(c.name)) for c in self.cols),
            source=source,
            keys=sql.SQL(", ").join(map(sql.Identifier, self.keys)),
        )


def compose(
    sub: psycopg.Connection,
    t: PeerTable,
    peer: str,
    me: str,
    policy: ConflictPolicy,
    source: sql.Composable = STAGE,
    markers: sql.Composable = STAGE,
) -> sql.Composed:
    """The one statement that applies a table's events of a peer's batch, read from `source`
    and the batch's markers from `markers` (STAGE, or peer_events with the tick as $1); it
    returns the conflicts it logged (see the module's docstring for what it does, in order).
    It writes every column the table has here now (DDL on either master may have changed them
    since the worker read them): one the peer's image lacks gets the value of old rows
    (missing_row_expr), one only the peer has is left out."""
    dest = sql.SQL(t.dest)  # canonical name, quoted by the server
    parts = TableParts.of(sub, t)
    cols, signature, populate, rkeys = parts.cols, parts.signature, parts.populate, parts.rkeys
    match = sql.SQL(" and ").join(sql.SQL("t.{0} = (n.r).{0}").format(sql.Identifier(k)) for k in t.keys)
    non_keys = [c.name for c in cols if c.name not in t.keys]
    # each write names the rows it must touch; a row that changed since the statement's snapshot
    # is not touched (its ctid is another one now), and the counts say so
    writes = {
        "del": sql.SQL(
            "del as (delete from {dest} t using dec d"
            " where t.ctid = d.local_ctid and d.winner = 'remote' and d.ev_type = 'D' returning 1)"
        ).format(dest=dest),
        "ins": parts.insert(
            "ins", sql.SQL("dec d where not d.local_exists and d.winner = 'remote' and d.ev_type <> 'D'")
        ),
    }
    expected = {
        "del": "d.winner = 'remote' and d.ev_type = 'D' and d.local_exists",
        "ins": "d.winner = 'remote' and d.ev_type <> 'D' and not d.local_exists",
    }
    if non_keys:
        writes["upd"] = sql.SQL(
            "upd as (update {dest} t set {sets} from dec d"
            " where t.ctid = d.local_ctid and d.winner = 'remote' and d.ev_type <> 'D' returning 1)"
        ).format(
            dest=dest,
            sets=sql.SQL(", ").join(sql.SQL("{0} = (d.r).{0}").format(sql.Identifier(c)) for c in non_keys),
        )
        expected["upd"] = "d.winner = 'remote' and d.ev_type <> 'D' and d.local_exists"
    raced = sql.SQL(" or ").join(
        sql.SQL("(select count(*) from {}) <> (select count(*) from dec d where {})").format(
            sql.Identifier(w), sql.SQL(expected[w])
        )
        for w in writes
    )
    lit_peer, lit_me, lit_policy = sql.Literal(peer), sql.Literal(me), sql.Literal(str(policy))
    return sql.SQL(STATEMENT).format(
        rkeys=rkeys,
        populate=populate,
        dest=dest,
        match=match,
        me=lit_me,
        peer=lit_peer,
        policy=lit_policy,
        winner=winner_sql(policy, lit_peer, sql.Literal(t.table)),
        writes=sql.SQL(", ").join(writes.values()),
        raced=raced,
        signature=sql.Literal(signature),
        dest_name=sql.Literal(t.dest),
        source=source,
        markers=markers,
        tick=sql.SQL("%(tick)s") if source is STAGE else TICK_PARAM,
    )


LOCK = (
    "select count(*) from (select 1 from (select distinct {rkeys}"
    "   from {source} s cross join lateral {populate} r"
    "  where s.ev_extra1 = %(t)s and s.ev_id >= %(lo)s and s.ev_id < %(hi)s and s.ev_type in ('I', 'U', 'D')) n"
    " join {dest} t on {match} order by {tkeys} for update of t) l"
)

STATEMENT = (
    # the net change per key: the last event, and the first (how the peer's change began)
    "with net as materialized ("
    "  select distinct on ({rkeys}) s.ev_id, s.ev_type, s.ev_data, s.ev_time as remote_time,"
    "         last_value(s.ev_id) over w as first_ev, last_value(s.ev_type) over w as first_type,"
    "         jsonb_build_array({rkeys}) as row_key, r"
    "    from {source} s cross join lateral {populate} r"
    "   where s.ev_extra1 = %(t)s and s.ev_id >= %(lo)s and s.ev_id < %(hi)s"
    "     and s.ev_type in ('I', 'U', 'D')"
    "  window w as (partition by {rkeys} order by s.ev_id desc"
    "               rows between unbounded preceding and unbounded following)"
    "   order by {rkeys}, s.ev_id desc),"
    # the local row and its version: row_version (a peer's apply wrote it, or a tombstone),
    # peer_copy (a first copy wrote it), the table's last TRUNCATE (a key absent since one newer
    # than its own tombstone: 94_two_way_truncate.sql), else this master's own change.  A row's
    # xmin as a full transaction id: the nearest to the snapshot's xmax (as pgcascade.xid8_of,
    # inline).  (Materialized, and OFFSET 0: each expression computed once per row, not per use.)
    " ref as (select pg_snapshot_xmax(pg_current_snapshot())::text::int8 as x8),"
    " copy as (select xid::text::int8 as x8, origin from pgcascade.peer_copy where table_name = %(t)s),"
    " tr as (select origin, origin_tick, origin_time, xid::text::int8 as x8"
    "          from pgcascade.truncate_version(%(t)s, {me})),"
    " loc as materialized ("
    "  select n.*, l.ctid as local_ctid, l.xmin as local_xmin, l.ctid is not null as local_exists,"
    "         l.x8 as row_x8, coalesce(u.by_tr, false) or coalesce(v.xid::text::int8 = tr.x8, false) as truncated,"
    "         case when u.by_tr then nullif(tr.origin, {me}) else v.origin end as rv_origin,"
    "         case when u.by_tr then tr.origin_tick else v.origin_tick end as rv_tick,"
    "         case when u.by_tr then tr.origin_time else v.origin_time end as rv_time,"
    "         case when u.by_tr then tr.x8 else v.xid::text::int8 end as rv_x8,"
    "         case when u.by_tr then true else v.deleted end as rv_deleted"
    "    from net n"
    "    left join lateral (select t.ctid, t.xmin, r8.x8 + ((t.xmin::text::int8 - r8.x8 %% 4294967296"
    "                       + 6442450944) %% 4294967296 - 2147483648) as x8"
    "                         from {dest} t, ref r8 where {match} offset 0) l on true"
    "    left join pgcascade.row_version v on v.table_name = %(t)s and v.row_key = n.row_key"
    "    left join tr on l.ctid is null"
    "    left join lateral (select v.xid is null or (tr.origin_time, tr.origin)"
    "                              > (coalesce(v.origin_time, pgcascade.commit_time(v.xid), '-infinity'),"
    "                                 coalesce(v.origin, {me})) as by_tr offset 0) u on tr.x8 is not null),"
    " ver as ("
    "  select loc.*, by_rv, by_copy,"
    "         case when by_rv then rv_origin when by_copy then (select origin from copy)"
    "              when local_exists then {me} when rv_deleted then coalesce(rv_origin, {me}) end"
    "           as local_origin,"
    "         case when by_rv then rv_tick when by_copy then 0"
    "              when not local_exists and rv_deleted then rv_tick end as local_tick,"
    "         case when local_exists then row_x8 else rv_x8 end as local_x8"
    "    from loc cross join lateral (select local_exists and rv_x8 = row_x8 and not rv_deleted as by_rv,"
    "                                        local_exists and row_x8 = (select x8 from copy) as by_copy) b),"
    # had the peer applied that version when it made its change?  What it had applied of each
    # master as of each of its events: the last of its markers in this batch before it, else
    # what the last batch applied here said (peer_seen) - each such state as an ev_id range
    " m as materialized ("
    "  select origin, from_ev, lead(from_ev, 1, 9223372036854775807) over (partition by origin order by from_ev)"
    "         as to_ev, tick, snap"
    "    from (select s.ev_extra1 as origin, s.ev_id as from_ev, s.ev_data::int8 as tick,"
    "                 s.ev_extra2::pg_snapshot as snap"
    "            from {markers} s where s.ev_type = 'pgcascade.peer-seen'"
    "          union all"
    "          select origin, -1, seen_tick, seen_snapshot from pgcascade.peer_seen where queue_name = %(queue)s) mk),"
    " judged as materialized ("
    "  select ver.*, case"
    "         when local_origin is null or local_origin = {peer} then true"
    "         when local_origin = {me} then coalesce(pg_visible_in_snapshot(local_x8::text::xid8, m.snap), false)"
    "         else coalesce(local_tick <= m.tick, false) end as seen"
    "    from ver left join m on m.origin = ver.local_origin and m.from_ev < ver.first_ev"
    "                            and ver.first_ev < m.to_ev),"
    " kind as ("
    "  select judged.*, case"
    "         when first_type = 'I' and local_exists then 'insert/insert'"
    "         when ev_type = 'D' and not local_exists and first_type <> 'I' then 'delete/delete'"
    "         when seen then null"
    "         when local_exists and ev_type = 'D' then 'update/delete'"
    "         when local_exists then 'update/update'"
    "         when truncated then 'update/truncate'"
    "         else 'update/delete' end as conflict"
    "    from judged),"
    # the local row and its commit time are wanted only where there is a conflict
    " dec as ("
    "  select kind.*, local_t, local_time,"
    "         case when conflict is null or conflict = 'delete/delete' then 'remote' else {winner} end as winner"
    "    from kind"
    "    left join lateral (select t as local_t from {dest} t"
    "                        where t.ctid = kind.local_ctid and kind.conflict is not null) lt on true"
    "    cross join lateral (select case when conflict is null then null"
    "         when by_rv then rv_time when by_copy then '-infinity'"
    "         when local_exists then pg_xact_commit_timestamp(local_xmin)"
    "         when rv_deleted and rv_origin is null then pgcascade.commit_time(rv_x8::text::xid8)"
    "         when rv_deleted then rv_time end as local_time) tm),"
    " conf as (insert into pgcascade.conflict (queue_name, table_name, conflict_type, row_key, local_row,"
    "          remote_row, local_origin, remote_origin, local_time, remote_time, policy, winner, tick_id)"
    "   select %(queue)s, %(t)s, conflict, row_key, to_jsonb(local_t),"
    "          case when ev_type <> 'D' then ev_data::jsonb end, local_origin, {peer}, local_time, remote_time,"
    "          {policy}, winner, {tick}"
    "     from dec where conflict is not null and winner in ('local', 'remote') returning 1),"
    " {writes},"
    " rv as (insert into pgcascade.row_version as v (table_name, row_key, origin, origin_tick, origin_time,"
    "        xid, deleted)"
    "   select %(t)s, row_key, {peer}, {tick}, remote_time, pg_current_xact_id(), ev_type = 'D'"
    "     from dec where winner = 'remote'"
    "   on conflict (table_name, row_key) do update set origin = excluded.origin,"
    "      origin_tick = excluded.origin_tick, origin_time = excluded.origin_time, xid = excluded.xid,"
    "      deleted = excluded.deleted)"
    # the checks last: any of them undoes everything the statement did
    " select (select count(*) from conf)"
    "   + coalesce((select pgcascade.peer_conflict_stop(conflict, %(t)s, row_key, {peer}, {policy}) from dec"
    "                where winner is null or winner not in ('local', 'remote') limit 1), 0)"
    "   + coalesce((select pgcascade.peer_apply_raced(%(t)s, {peer}) where {raced}), 0)"
    "   + pgcascade.peer_columns_check({dest_name}::regclass, {signature})"
)
