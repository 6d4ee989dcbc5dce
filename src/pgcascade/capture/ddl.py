"""Automatic DDL on the root (or a two-way master): `pgcascade CONF auto-ddl on|off`.

Three event triggers of the database call the functions of `sql/capture/96_auto_ddl.sql`:
they queue the DDL that changes the set's tables as EXECUTE events inside the DDL's own
transaction (in order with its row changes), add the tables created in the set's schemas
(`--add-new-tables`), and refuse the DDL that cannot be replicated safely.  Creating an event
trigger needs a superuser (on a managed service, its admin role, e.g. rds_superuser); once they
exist, auto-ddl is switched per queue by a row of `pgcascade.auto_ddl`, which pgcascade's own
role writes.  This module is the only one that reads or writes `auto_ddl` and the triggers.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from pgcascade.core.errors import UserError, db_error_line
from pgcascade.core.pgconn import scalar

# name -> (event, function); ddl_command_start fires only for the tags it needs
EVENT_TRIGGERS = {
    "pgcascade_ddl_start": ("ddl_command_start", "ddl_trigger_start"),
    "pgcascade_ddl_end": ("ddl_command_end", "ddl_trigger_end"),
    "pgcascade_ddl_drop": ("sql_drop", "ddl_trigger_drop"),
}

NEEDS = (
    "creating the event triggers of auto-ddl needs a superuser (on a managed service its admin role,"
    " e.g. rds_superuser on RDS/Aurora): run `auto-ddl on` once as such a role; until then send DDL"
    " with `execute`"
)


@dataclass(frozen=True)
class AutoDdl:
    """A queue's auto-ddl setting, and whether the database's event triggers are there to do it."""

    add_new_tables: bool
    triggers_ok: bool

    def describe(self) -> str:
        new = ", new tables in the set's schemas added" if self.add_new_tables else ""
        missing = "" if self.triggers_ok else " - but its event triggers are missing or disabled"
        return f"on{new}{missing}"


def setting(conn: psycopg.Connection, queue: str) -> AutoDdl | None:
    """The queue's auto-ddl, or None when it is off (or this schema predates it)."""
    if scalar(conn, "select to_regclass('pgcascade.auto_ddl') is null"):
        return None
    row = conn.execute(
        "select add_new_tables from pgcascade.auto_ddl where queue_name = %s", (queue,)
    ).fetchone()
    return None if row is None else AutoDdl(bool(row[0]), triggers_ok(conn))


def triggers_ok(conn: psycopg.Connection) -> bool:
    """Whether the three event triggers exist, enabled, and call pgcascade's functions."""
    n = scalar(
        conn,
        "select count(*) from pg_event_trigger e join pg_proc p on p.oid = e.evtfoid"
        " join pg_namespace s on s.oid = p.pronamespace"
        " where e.evtname = any(%s) and e.evtenabled <> 'D' and s.nspname = 'pgcascade'",
        (list(EVENT_TRIGGERS),),
    )
    return int(n) == len(EVENT_TRIGGERS)


def install_triggers(conn: psycopg.Connection) -> None:
    """Create the event triggers that are missing (a superuser's right)."""
    existing = {
        r[0]
        for r in conn.execute(
            "select evtname from pg_event_trigger where evtname = any(%s)", (list(EVENT_TRIGGERS),)
        )
    }
    for name, (event, function) in EVENT_TRIGGERS.items():
        if name in existing:
            continue
        tags = scalar(conn, "select pgcascade.ddl_trigger_tags(%s)", (event,))
        when = (
            sql.SQL(" when tag in ({})").format(sql.SQL(", ").join(map(sql.Literal, tags)))
            if tags
            else sql.SQL("")
        )
        stmt = sql.SQL("create event trigger {} on {}{} execute function pgcascade.{}()").format(
            sql.Identifier(name), sql.SQL(event), when, sql.Identifier(function)
        )
        try:
            with conn.transaction():
                conn.execute(stmt)
        except psycopg.errors.InsufficientPrivilege:
            raise UserError(NEEDS) from None


def enable(conn: psycopg.Connection, queue: str, add_new_tables: bool) -> None:
    """auto-ddl on for the queue this node is the root of."""
    with conn.transaction():
        if not triggers_ok(conn):
            install_triggers(conn)
            if not triggers_ok(conn):
                raise UserError(
                    "an event trigger named pgcascade_ddl_* is disabled or calls another function:"
                    " drop it (a superuser) and run auto-ddl on again"
                )
        conn.execute(
            "insert into pgcascade.auto_ddl (queue_name, add_new_tables) values (%s, %s)"
            " on conflict (queue_name) do update set add_new_tables = excluded.add_new_tables",
            (queue, add_new_tables),
        )


def disable(conn: psycopg.Connection, queue: str) -> str | None:
    """auto-ddl off for the queue; the event triggers go with the last queue that used them.
    Returns a note when they cannot go (only a superuser drops an event trigger)."""
    with conn.transaction():
        conn.execute("delete from pgcascade.auto_ddl where queue_name = %s", (queue,))
        if scalar(conn, "select exists (select 1 from pgcascade.auto_ddl)"):
            return None
        names = [
            r[0]
            for r in conn.execute(
                "select evtname from pg_event_trigger where evtname = any(%s)", (list(EVENT_TRIGGERS),)
            )
        ]
        try:
            with conn.transaction():
                for name in names:
                    conn.execute(sql.SQL("drop event trigger {}").format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege as e:
            drops = "; ".join(f"drop event trigger {n}" for n in names)
            return f"the event triggers stay ({db_error_line(e)}); they do nothing now, and a superuser can drop them: {drops}"
    return None
