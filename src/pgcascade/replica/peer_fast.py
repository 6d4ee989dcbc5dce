"""The statements of a small peer batch that need no judging (peer_worker.apply_in_one).

A table whose events in the batch are all of one kind is written by one statement when nothing
here could make any of them a conflict; else the statement fails with SQLSTATE PCROW, having
written nothing, and the worker sends the batch again with every table's judging statements
(peer_apply.py), and that table's next batches go so for a while:

- all inserts (a table of appended rows): none of the keys is here or has a version (a
  tombstone), no key comes twice, the table was never truncated; else an insert of a key here
  is an insert/insert conflict, over a tombstone or a TRUNCATE one the peer may not have seen.
- all updates (rows each master keeps to itself, the common two-way case): every key's row is
  here and its version is the same peer's (`row_version` names the peer and the transaction
  that wrote the row as it is): the peer made the change over its own last one, which it had
  seen, so it is no conflict whatever this master applied since.  A local change of such a row,
  even one committed while the statement waits for its lock, makes a row version the
  statement does not update (PostgreSQL checks the condition again on the row as it is then).

Each is PREPAREd as peer_apply.inline_statement's, the tick its one parameter, and reads the
table's events from the batch's settings.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from pgcascade.replica.peer_apply import (
    TICK_PARAM,
    PeerBatch,
    PeerTable,
    TableParts,
    events_setting,
    params,
    peer_events,
)

INSERT, UPDATE = "I", "U"  # the kinds of event a table's batch may be all of


def statement(sub: psycopg.Connection, t: PeerTable, peer: PeerBatch, kind: str) -> bytes | None:
    """The table's statement for a batch whose events of it are all of `kind` (the module's
    docstring), or None when there is none (an update of a table of keys alone)."""
    key = (peer.peer, peer.me, f"all-{kind}", True)
    found = t.peer_sql.get(key)
    if found is None:
        parts = TableParts.of(sub, t)
        non_keys = [c.name for c in parts.cols if c.name not in t.keys]
        if kind == UPDATE and not non_keys:
            t.peer_sql[key] = (b"", b"")  # (kept: composing reads the catalog)
            return None
        body = sql.SQL(INSERTS if kind == INSERT else UPDATES).format(
            rkeys=parts.rkeys,
            populate=parts.populate,
            source=peer_events(events_setting(t.table)),
            ins=parts.insert("ins", sql.SQL("ev d where not (select b from blocked)")),
            dest=sql.SQL(t.dest),
            sets=sql.SQL(", ").join(sql.SQL("{0} = (ev.r).{0}").format(sql.Identifier(c)) for c in non_keys),
            match=sql.SQL(" and ").join(
                sql.SQL("t.{0} = (ev.r).{0}").format(sql.Identifier(k)) for k in t.keys
            ),
            peer=sql.Literal(peer.peer),
            tick=TICK_PARAM,
            dest_name=sql.Literal(t.dest),
            signature=sql.Literal(parts.signature),
        )
        values = params(t, 0, 2**63 - 1, peer)
        found = t.peer_sql[key] = (
            b"",
            psycopg.ClientCursor(sub).mogrify(body.as_bytes(sub), values).encode(),
        )
    return found[1] or None


INSERTS = (
    "with ev as materialized ("
    "  select s.ev_time as remote_time, jsonb_build_array({rkeys}) as row_key, r"
    "    from {source} s cross join lateral {populate} r where s.ev_type = 'I'),"
    " blocked as (select exists (select 1 from pgcascade.table_truncate where table_name = %(t)s)"
    "                 or exists (select 1 from ev join pgcascade.row_version v"
    "                             on v.table_name = %(t)s and v.row_key = ev.row_key)"
    "                 or (select count(distinct row_key) <> count(*) from ev) as b),"
    " {ins},"
    " rv as (insert into pgcascade.row_version as v (table_name, row_key, origin, origin_tick, origin_time,"
    "        xid, deleted)"
    "   select %(t)s, row_key, {peer}, {tick}, remote_time, pg_current_xact_id(), false"
    "     from ev where not (select b from blocked)"
    "   on conflict (table_name, row_key) do update set origin = excluded.origin,"
    "      origin_tick = excluded.origin_tick, origin_time = excluded.origin_time, xid = excluded.xid,"
    "      deleted = excluded.deleted)"
    # every row inserted, or nothing stands (PCROW: -1 when blocked); no conflict (0)
    " select case when pgcascade.peer_expect_rows((select count(*) from ins),"
    "                 case when (select b from blocked) then -1 else (select count(*) from ev) end, %(t)s) then 0 end"
    "   + pgcascade.peer_columns_check({dest_name}::regclass, {signature})"
)

UPDATES = (
    # a key updated twice in the batch: its last row
    "with ev as materialized ("
    "  select distinct on ({rkeys}) s.ev_time as remote_time, jsonb_build_array({rkeys}) as row_key, r"
    "    from {source} s cross join lateral {populate} r where s.ev_type = 'U'"
    "   order by {rkeys}, s.ev_id desc),"
    # the row's xmin as a full transaction id, as peer_apply's statement reads it
    " ref as (select pg_snapshot_xmax(pg_current_snapshot())::text::int8 as x8),"
    " upd as (update {dest} t set {sets}"
    "           from ev join pgcascade.row_version v on v.table_name = %(t)s and v.row_key = ev.row_key, ref r8"
    "          where {match} and v.origin = {peer} and not v.deleted"
    "            and v.xid::text::int8 = r8.x8 + ((t.xmin::text::int8 - r8.x8 %% 4294967296"
    "                                              + 6442450944) %% 4294967296 - 2147483648)"
    "          returning ev.row_key, ev.remote_time),"
    " rv as (update pgcascade.row_version v"
    "           set origin_tick = {tick}, origin_time = upd.remote_time, xid = pg_current_xact_id()"
    "          from upd where v.table_name = %(t)s and v.row_key = upd.row_key)"
    # every key's row written, or nothing stands (PCROW); no conflict (0)
    " select case when pgcascade.peer_expect_rows((select count(*) from upd), (select count(*) from ev), %(t)s)"
    "        then 0 end"
    "   + pgcascade.peer_columns_check({dest_name}::regclass, {signature})"
)
