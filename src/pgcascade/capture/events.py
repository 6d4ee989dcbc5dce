"""The statements the capture daemon writes its queue with (daemon.py sends them)."""

from __future__ import annotations

import json
from typing import Any, cast

import psycopg
from psycopg import sql

from pgcascade.capture.pgoutput import Relation
from pgcascade.core import roundtrip

# the end of what a commit group holds (its last source transaction), in its transaction
CONFIRM = (
    "update pgcascade.walcapture set confirmed_lsn = %s::pg_lsn, last_commit = coalesce(%s, last_commit),"
    " last_capture = now(), last_error = null, last_error_time = null where queue_name = %s"
)

# an event of the stream's own (TRUNCATE, a message): its type, data, extra1-3, the master it
# is tagged with (origin, as ev_extra4) and the queue, by name
INSERT_EVENT = (
    "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1, ev_rare)"
    " select nextval(q.queue_event_seq), now(), q.queue_id * 16 + q.queue_cur_table, %(type)s, %(data)s, %(extra1)s,"
    " case when coalesce(%(extra2)s::text, %(extra3)s::text, %(origin)s::text) is not null"
    " then row(%(extra2)s, %(extra3)s, %(origin)s, null, null)::pgcascade.event_rare end"
    " from pgcascade.queue q where q.queue_name = %(queue)s"
)


def insert_rows_sql(rel: Relation, queue: str) -> sql.Composed:
    """The insert of a batch of `rel`'s rows into `queue`; parameters: origin, origin, the rows
    as JSON."""
    # each row arrives as [op, [text values]]; the cast makes each value the column's type
    # again (its input function: the exact inverse of the output pgoutput used), and
    # the image is the capture trigger's (row_to_json, JSON nulls of json columns marked)
    cols = sql.SQL(", ").join(
        sql.SQL("(x.v->>{})::{} as {}").format(sql.Literal(i), sql.SQL(cast), sql.Identifier(name))
        for i, (name, cast) in enumerate(zip(rel.names, rel.casts, strict=True))
    )
    return sql.SQL(
        "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1, ev_rare)"
        " select nextval(q.queue_event_seq), x.t, q.queue_id * 16 + q.queue_cur_table, x.op,"
        " {image}, {table}, o.rare"
        " from pgcascade.queue q,"
        " (select case when %s::text is not null"
        "         then row(null, null, %s, null, null)::pgcascade.event_rare end as rare) o,"
        " (select e->>0 as op, e->1 as v, (e->>2)::timestamptz as t, n"
        "  from jsonb_array_elements(%s::jsonb) with ordinality a(e, n)) x,"
        " lateral (select {cols}) r"
        " where q.queue_name = {queue} order by x.n"
    ).format(
        image=sql.SQL(rel.image),
        table=sql.Literal(rel.canonical),
        cols=cols,
        queue=sql.Literal(queue),
    )


def insert_images_sql(rel: Relation, queue: str) -> sql.Composed:
    """The insert of a batch of `rel`'s rows whose images the daemon wrote (capture/images.py);
    parameters: origin, origin, the images (one a line: JSON has no raw line break), their event
    types (one letter each), their times (comma-separated)."""
    return sql.SQL(
        "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1, ev_rare)"
        " select nextval(q.queue_event_seq), x.t, q.queue_id * 16 + q.queue_cur_table, x.op, x.img, {table}, o.rare"
        " from pgcascade.queue q,"
        " (select case when %s::text is not null"
        "         then row(null, null, %s, null, null)::pgcascade.event_rare end as rare) o,"
        " unnest(string_to_array(%s::text, E'\\n'), string_to_array(%s::text, null),"
        "        string_to_array(%s::text, ',')::timestamptz[]) with ordinality x(img, op, t, n)"
        " where q.queue_name = {queue} order by x.n"
    ).format(table=sql.Literal(rel.canonical), queue=sql.Literal(queue))


def rows_statement(
    conn: psycopg.Connection, rel: Relation, queue: str, rows: list[list[Any]], origin: str | None
) -> str:
    """The statement, its values bound, that writes `rows` ([event type, values, time]) of `rel`
    into `queue`: with the images the daemon wrote when it could write every row's, else with
    images the server makes (the same text either way)."""
    bind = roundtrip.binder(conn).mogrify  # the connection's one cursor: not one a table and flush
    if rel.render is not None:
        images = [rel.render(vals) for _, vals, _ in rows]
        if None not in images:
            if rel.images_sql is None:
                rel.images_sql = insert_images_sql(rel, queue).as_bytes(conn)
            text = "\n".join(cast(list[str], images))
            ops, times = "".join(r[0] for r in rows), ",".join(r[2] for r in rows)
            return bind(rel.images_sql, (origin, origin, text, ops, times))
    if rel.insert_sql is None:
        rel.insert_sql = insert_rows_sql(rel, queue).as_bytes(conn)
    return bind(rel.insert_sql, (origin, origin, json.dumps(rows, ensure_ascii=False)))
