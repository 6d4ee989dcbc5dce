"""The set-based statement that applies one table's staged events (apply.py runs it).

It reduces the table's row events of a segment (`lo <= ev_id < hi`) in the staging table to the
last one per key - `net`, each event's row built once, typed as the destination's row - and
applies that, in one statement:

- A DELETE of the keys whose last event is D, an UPDATE ... FROM of the keys the destination
  holds, and an INSERT of the others (NOT EXISTS under the statement's snapshot, which the
  DELETE and UPDATE do not change).  An UPDATE costs less than INSERT ... ON CONFLICT DO UPDATE
  of a row that exists (which probes the index for the conflict, then locks the row with a WAL
  record of its own, then updates it): 5,000,000 updated rows took 78 s against 97 s.
- Where the destination has a unique index on the key, by the key's last event: one last
  inserted on the provider (I) is upserted, ON CONFLICT DO UPDATE, as before (a copy may hold
  it already; an insert pays for one probe); one last updated (U) is updated, and inserted if
  it is missing here - which the counts tell (one row per key at most): when the UPDATE matched
  every such key the INSERT is skipped outright, so a batch of updates pays for no NOT EXISTS
  probes.  ON CONFLICT stays on both INSERTs (a row another session inserted meanwhile).
- Without one - a partitioned destination can have a unique index only if it holds the
  partition key, so a table partitioned by another column than the provider's key has none -
  the key must be unique on the provider; every key not deleted is updated, and inserted where
  NOT EXISTS finds none.
- **with a row filter** (add-table --where): a key whose last row fails the
  filter is deleted like a D - an UPDATE that moved the row out of the filter removes it - and
  one that passes is upserted - an UPDATE that moved it in inserts it.  The filter is evaluated
  on the net row only, in a scalar subquery whose FROM is that row's columns, so its names bind
  to the row's columns and nothing else.

A column list (add-table --columns) is simply the columns written.

On PostgreSQL 15+ a segment without inserts of the table is applied by merge_sql instead: the
same net rows and the same outcome per key, in one MERGE (apply.py TableApplier.statement).
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from pgcascade.replica import filters


@dataclass(frozen=True)
class Shape:
    """What the statement of one table depends on."""

    dest: str  # canonical name
    keys: list[str]
    cols: list[str]  # the columns written (the key among them)
    identity: bool  # a written column is an identity column: OVERRIDING SYSTEM VALUE
    json_nulls: bool  # rows through pgcascade.event_row (restores JSON nulls)
    on_conflict: bool  # upsert (a unique index on the key) or update, then insert
    row_filter: str | None = None


def _row_col(c: str) -> sql.Composed:
    return sql.SQL("(net.pgcascade_row).{}").format(sql.Identifier(c))


# where the events come from: the staging table, or (a batch applied in one message,
# inline.py) the batch's JSON array of events, set in the transaction as INLINE_SETTING -
# every table's statement reads it, so it travels once, and nothing is written to stage it
STAGE = sql.SQL("pg_temp.pgcascade_stage")
INLINE_SETTING = "pgcascade.inline_events"
INLINE_EVENTS = sql.SQL(
    "(select (e->>0)::int8 as ev_id, (e->>1)::int8 as ev_txid, e->>2 as ev_type, e->>3 as ev_data,"
    " e->>4 as ev_extra1 from json_array_elements(current_setting({})::json) e)"
).format(sql.Literal(INLINE_SETTING))


# a segment's row events of the table (parameters t, lo, hi; skip: a copy's snapshot, whose
# events are in the copied rows)
SEGMENT_EVENTS = sql.SQL(
    "s.ev_extra1 = %(t)s and s.ev_id >= %(lo)s and s.ev_id < %(hi)s and s.ev_type in {}"
    " and (%(skip)s::text is null or not txid_visible_in_snapshot(s.ev_txid, %(skip)s::text::txid_snapshot))"
)


def decoded(
    s: Shape, source: sql.Composable, kinds: str = "('I', 'U', 'D')", alias: str = "s"
) -> sql.Composed:
    """The segment's events of the table of kinds `kinds`, each with its row (`pgcascade_row`),
    as subquery `alias` (ev_type, ev_id, pgcascade_row).  The row is decoded in the subquery's select
    list, which OFFSET 0 keeps from being pulled up (and the call copied into every reference):
    called in FROM (cross join lateral) it ran as a function scan, which stores each result in a
    tuplestore of its own: a 100,000-row MERGE took 1.34 s of CPU that way, 1.13 s this way."""
    return sql.SQL("(select s.ev_type, s.ev_id, {} as pgcascade_row from {} s where {} offset 0) {}").format(
        populate(s), source, SEGMENT_EVENTS.format(sql.SQL(kinds)), sql.Identifier(alias)
    )


def _net_cte(s: Shape, source: sql.Composable) -> sql.Composed:
    """The segment's events of the table reduced to the last one per key (`net`): each key's
    event type and its row, typed as the destination's row."""
    # keys compare with the types' equality (as the unique index does), and typed rows sort
    # cheaper than their JSON text
    key_exprs = sql.SQL(", ").join(sql.SQL("(pgcascade_row).{}").format(sql.Identifier(k)) for k in s.keys)
    return sql.SQL(
        " select distinct on ({keys}) s.ev_type, s.pgcascade_row from {rows} order by {keys}, s.ev_id desc"
    ).format(keys=key_exprs, rows=decoded(s, source))


def insert_sql(s: Shape, source: sql.Composable = STAGE) -> sql.Composed | None:
    """A segment whose events of the table are all inserts, as one plain INSERT - no reduction
    to the last event per key, no ON CONFLICT (its probe of the index before each row and the
    speculative insertion's extra WAL record): 100,000 rows 1.37 -> 0.70 s of CPU.  Each key is
    inserted once (a second insert of a key on the provider needs a delete between, unless the
    key is unique on neither side: then the destination's unique index refuses it), and was
    absent at the segment's start; a row here all the same (a stray one, a copy's) is a unique
    violation, and the caller applies the segment with set_based_sql.  None where that cannot
    be relied on: no unique index here, a row filter."""
    if not s.on_conflict or s.row_filter is not None:
        return None
    return _insert_net(s) + sql.SQL(" from ") + decoded(s, source, "('I')", alias="net")


def _insert_net(s: Shape) -> sql.Composed:
    """INSERT of the written columns from the rows of `net` (the FROM follows)."""
    return sql.SQL("insert into {dest} ({cols}){overriding} select {rcols}").format(
        dest=sql.SQL(s.dest),
        cols=sql.SQL(", ").join(map(sql.Identifier, s.cols)),
        overriding=sql.SQL(" overriding system value" if s.identity else ""),
        rcols=sql.SQL(", ").join(_row_col(c) for c in s.cols),
    )


def populate(s: Shape) -> sql.Composed:
    """The row of event `s` (its ev_data), typed as the destination's row."""
    # json_populate_record, not jsonb's: jsonb would turn float -0 into 0 and rewrite the text
    # of json columns; with json/jsonb columns event_row, which also restores their JSON nulls
    return sql.SQL(
        "pgcascade.event_row(null::{}, s.ev_data)"
        if s.json_nulls
        else "json_populate_record(null::{}, s.ev_data::json)"
    ).format(sql.SQL(s.dest))


def _kept(s: Shape) -> sql.Composable:
    """Whether the net row stays (its key's last event is not D and the row passes the filter)."""
    if s.row_filter is None:
        return sql.SQL("net.ev_type <> 'D'")
    return sql.SQL(
        "net.ev_type <> 'D' and coalesce((select {} from (select (net.pgcascade_row).*) pgcascade_f), false)"
    ).format(filters.embedded(s.row_filter, with_params=True))


def _key_match(s: Shape) -> sql.Composed:
    return sql.SQL(" and ").join(sql.SQL("t.{} = {}").format(sql.Identifier(k), _row_col(k)) for k in s.keys)


def merge_sql(s: Shape, source: sql.Composable = STAGE, net: sql.Composable | None = None) -> sql.Composed:
    """set_based_sql's work as one MERGE (PostgreSQL 15+): the net rows joined once to the
    destination - a matched key is deleted (not kept) or updated, one not matched and kept is
    inserted.  No CTE read four times: 5,000,000 updated rows 35 -> 31 s (docs/design.md).  A
    row another session inserts meanwhile is a unique violation: the caller goes row by row."""
    non_keys = [c for c in s.cols if c not in s.keys]
    keep = sql.SQL("({})").format(_kept(s))
    clauses = [sql.SQL("when matched and not {} then delete").format(keep)]
    if non_keys:
        sets = sql.SQL(", ").join(sql.SQL("{} = {}").format(sql.Identifier(c), _row_col(c)) for c in non_keys)
        clauses.append(sql.SQL("when matched then update set {}").format(sets))
    clauses.append(
        sql.SQL("when not matched and {} then insert ({}){} values ({})").format(
            keep,
            sql.SQL(", ").join(map(sql.Identifier, s.cols)),
            sql.SQL(" overriding system value" if s.identity else ""),
            sql.SQL(", ").join(_row_col(c) for c in s.cols),
        )
    )
    return sql.SQL("merge into {} t using ({}) net on {} {}").format(
        sql.SQL(s.dest), net or _net_cte(s, source), _key_match(s), sql.SQL(" ").join(clauses)
    )


def set_based_sql(
    s: Shape, source: sql.Composable = STAGE, net: sql.Composable | None = None
) -> sql.Composed:
    """The statement, with parameters t (the table as in ev_extra1), lo, hi and skip (a copy's
    snapshot: events visible in it are in the copied rows); the events are read from
    `source` (STAGE or INLINE_EVENTS), or `net` is the net rows already (replica/stream.py)."""
    dest = sql.SQL(s.dest)  # canonical name, quoted by the server
    key_match = _key_match(s)
    non_keys = [c for c in s.cols if c not in s.keys]
    ctes = [sql.SQL("net as ({})").format(net or _net_cte(s, source))]
    src, gone, stays = sql.SQL("net"), sql.SQL("net.ev_type = 'D'"), sql.SQL("net.ev_type <> 'D'")
    if s.row_filter is not None:
        ctes.append(
            sql.SQL("kept as (select net.pgcascade_row, net.ev_type, {} as pgcascade_keep from net)").format(
                _kept(s)
            )
        )
        src, gone, stays = sql.SQL("kept"), sql.SQL("not net.pgcascade_keep"), sql.SQL("net.pgcascade_keep")
    ctes.append(
        sql.SQL("del as (delete from {} t using {} net where {} and {})").format(dest, src, gone, key_match)
    )
    absent = sql.SQL(" and not exists (select 1 from {} t where {})").format(dest, key_match)
    on_conflict: sql.Composable = sql.SQL("")
    if s.on_conflict:  # a row another session inserted since the statement began
        on_conflict = sql.SQL(" on conflict ({}) {}").format(
            sql.SQL(", ").join(map(sql.Identifier, s.keys)),
            sql.SQL("do update set {}").format(
                sql.SQL(", ").join(sql.SQL("{0} = excluded.{0}").format(sql.Identifier(c)) for c in non_keys)
            )
            if non_keys
            else sql.SQL("do nothing"),
        )
    insert = _insert_net(s) + sql.SQL(" from {} net where {}").format(src, stays)
    main = insert + absent + on_conflict
    if non_keys:
        sets = sql.SQL(", ").join(sql.SQL("{} = {}").format(sql.Identifier(c), _row_col(c)) for c in non_keys)
        updated: sql.Composable = stays
        if s.on_conflict:
            # keys last inserted on the provider are upserted (a copy may hold them already),
            # keys last updated there are updated; one missing here is inserted, unless the
            # UPDATE matched every such key (one row per key at most: the counts tell)
            updated = stays + sql.SQL(" and net.ev_type = 'U'")
            ctes.append(
                sql.SQL("ins as ({})").format(insert + sql.SQL(" and net.ev_type <> 'U'") + on_conflict)
            )
            main = (
                insert
                + sql.SQL(
                    " and net.ev_type = 'U' and (select count(*) from upd) < (select count(*) from {} net where {})"
                ).format(src, updated)
                + absent
                + on_conflict
            )
        ctes.append(
            sql.SQL("upd as (update {} t set {} from {} net where {} and {} returning 1)").format(
                dest, sets, src, updated, key_match
            )
        )
    return sql.SQL("with {ctes} {main}").format(ctes=sql.SQL(", ").join(ctes), main=main)


# the kinds of row event a statement of one_kind_sql applies
ONE_KIND = ("I", "U", "D")


def one_kind_sql(s: Shape, kind: str) -> sql.Composed | None:
    """The statement of a table whose events in a small batch are all of one `kind` (I, U or
    D), over their rows as one JSON array in event order (parameter $1; $2: how many) - none of
    set_based_sql's staging, choice of write by each key's last event or fallbacks, which cost a
    small batch more than its writes (docs/design.md).  An upsert for I (as set_based_sql's;
    a key inserted twice is an error), a delete for D, and for U an update by each key's last
    row that must find every key: pgcascade.expect_rows raises PCROW otherwise (a row missing
    here) and the batch is applied with set_based_sql.  None where the table needs more: no
    unique index here, a row filter, JSON columns (their nulls), an update of the key alone."""
    non_keys = [c for c in s.cols if c not in s.keys]
    if not s.on_conflict or s.row_filter is not None or s.json_nulls or (kind == "U" and not non_keys):
        return None
    dest = sql.SQL(s.dest)
    # LIMIT tells the planner the rows are few (a set-returning function counts as 100, a LIMIT
    # of a parameter as a tenth of that in the generic plan the worker asks for): a join of 100
    # rows planned against a table of some thousands is a hash join over a scan of it
    rows = sql.SQL("(select * from json_populate_recordset(null::{}, $1::json) limit $2) r").format(dest)
    match = sql.SQL(" and ").join(sql.SQL("t.{0} = r.{0}").format(sql.Identifier(k)) for k in s.keys)
    if kind == "D":
        return sql.SQL("delete from {} t using {} where {}").format(dest, rows, match)
    if kind == "U":  # a key updated twice in the batch: by its last row
        sets = sql.SQL(", ").join(sql.SQL("{0} = r.{0}").format(sql.Identifier(c)) for c in non_keys)
        keys = sql.SQL(", ").join(map(sql.Identifier, s.keys))
        return sql.SQL(
            "with r as (select distinct on ({keys}) * from json_populate_recordset(null::{dest}, $1::json)"
            " with ordinality order by {keys}, ordinality desc limit $2),"
            " upd as (update {dest} t set {sets} from r where {match} returning 1)"
            " select pgcascade.expect_rows(count(*), (select count(*) from r)) from upd"
        ).format(keys=keys, dest=dest, sets=sets, match=match)
    upsert = (
        sql.SQL("do update set {}").format(
            sql.SQL(", ").join(sql.SQL("{0} = excluded.{0}").format(sql.Identifier(c)) for c in non_keys)
        )
        if non_keys
        else sql.SQL("do nothing")
    )
    return sql.SQL("insert into {} ({}){} select {} from {} on conflict ({}) {}").format(
        dest,
        sql.SQL(", ").join(map(sql.Identifier, s.cols)),
        sql.SQL(" overriding system value" if s.identity else ""),
        sql.SQL(", ").join(sql.SQL("r.{}").format(sql.Identifier(c)) for c in s.cols),
        rows,
        sql.SQL(", ").join(map(sql.Identifier, s.keys)),
        upsert,
    )
