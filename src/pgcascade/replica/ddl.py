"""Replaying the DDL of the queue (EXECUTE events) on a subscriber or a two-way master.

`execute FILE` scripts run everywhere, as they always did.  The DDL that auto-ddl captured on
the root (sql/capture/96_auto_ddl.sql) carries a description in ev_extra1 - the search_path it
ran under, the set tables it changes, the tables it creates or drops - so each node runs what
concerns it, at the same point of the stream:

- a subscriber runs the statements that change tables it replicates whole under their own names
  (not into another table, not a column list of it), and
  the CREATE TABLE of a new set table when it took the set's tables with `add-table --all`
  (the table is then replicated here in state ok: it is empty on both sides at this point; one
  that was here already is copied); a DROP TABLE drops the set tables it holds and forgets them;
- a two-way master runs every statement, and a table a peer created or dropped joins or leaves
  its own set, as it did on the peer (`ddl_table_created`, `ddl_table_dropped`); the statement
  goes on to the leaves under it, tagged with the peer (its other peers have it from the peer).

Everything happens in the batch's transaction, under session_replication_role = replica, where
the event triggers do not fire: what is replayed is never captured again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from pgcascade.core import catalog
from pgcascade.core.errors import RuntimeFailure, db_error_line
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import ApplyError, PeerBatch, TableApplier

log = logging.getLogger("pgcascade.apply")


@dataclass(frozen=True)
class CapturedDdl:
    """ev_extra1 of an EXECUTE event that auto-ddl wrote (docs/ddl.md, "The event")."""

    command: str
    search_path: list[str]
    tables: list[str]  # set tables it changes
    created: dict[str, list[str]] = field(default_factory=dict)  # new set table -> key columns
    dropped: list[str] = field(default_factory=list)
    cascade: bool = False

    @classmethod
    def parse(cls, extra1: str | None) -> CapturedDdl | None:
        """The description, or None for a script of `execute` (its file name is there)."""
        if not extra1 or not extra1.startswith("{"):
            return None
        try:
            meta = json.loads(extra1)
        except ValueError:
            return None
        if not isinstance(meta, dict) or "auto-ddl" not in meta:
            return None
        return cls(
            str(meta.get("command", "")),
            list(meta.get("search_path") or []),
            list(meta.get("tables") or []),
            dict(meta.get("created") or {}),
            list(meta.get("dropped") or []),
            bool(meta.get("cascade")),
        )

    def label(self) -> str:
        return f"auto-ddl {self.command} {', '.join(self.tables or list(self.created) or self.dropped)}"


class DdlReplay:
    """How the worker of `node` runs the EXECUTE events of its provider's queue."""

    def __init__(self, node: nodes.Node):
        self.node = node

    def replay(
        self,
        sub: psycopg.Connection,
        ev_id: int,
        statement: str,
        extra1: str | None,
        appliers: dict[str, TableApplier],
        peer: PeerBatch | None,
    ) -> bool:
        """Run the event's DDL here if it concerns this node (`appliers` follow it); whether it ran."""
        ddl = CapturedDdl.parse(extra1)
        label = ddl.label() if ddl else (extra1 or "script")
        held = {t.table_name: t for t in subscriber.tables(sub, self.node.queue_name)}
        if ddl is not None and peer is None:
            mine = self.for_subscriber(ddl, statement, held)
            if mine is None:
                log.info("%s (event %d): not replicated here, skipped", label, ev_id)
                return False
            statement = mine
        existed = {t: catalog.table_exists(sub, t) for t in ddl.created} if ddl else {}
        dropped_oids = {t: table_oid(sub, t) for t in ddl.dropped} if ddl and peer else {}
        log.info("executing %s from the queue", label)
        run(sub, ev_id, label, statement, ddl.search_path if ddl else None)
        for a in appliers.values():  # the batch's later rows carry the new definition
            a.after_ddl(sub)
        if peer is not None:  # on to the leaves under this master, tagged: not to its peers
            sub.execute(
                "select pgcascade.emit_event(%s, 'EXECUTE', %s, %s, %s, %s)",
                (peer.own_queue, statement, extra1, peer.peer, peer.tick),
            )
        if ddl is None:
            return True
        for table, keys in ddl.created.items():
            self.created(sub, table, keys, existed[table], appliers, peer)
        for table in ddl.dropped:
            appliers.pop(table, None)
            if peer is not None:
                sub.execute(
                    "select pgcascade.ddl_table_dropped(%s, %s, %s)",
                    (peer.own_queue, table, dropped_oids[table]),
                )
            elif table in held:
                subscriber.remove_tables(sub, self.node.queue_name, [table])
        return True

    def for_subscriber(
        self, ddl: CapturedDdl, statement: str, held: dict[str, subscriber.SubscriberTable]
    ) -> str | None:
        """The statement as this subscriber runs it, or None: the tables it changes are not
        replicated here under their own names (or, for a new table, this node does not take
        the set's new tables)."""
        # a table applied into another, or a column list of it only: this node's own shape of it
        own_shape = {t for t, st in held.items() if st.dest_table != t or st.column_list is not None}
        for t in own_shape.intersection(ddl.tables + ddl.dropped):
            log.warning(
                "%s: %s is replicated here as %s: DDL of the root not run", ddl.label(), t, held[t].dest_table
            )
        if ddl.dropped:
            mine = [t for t in ddl.dropped if t in held and t not in own_shape]
            if not mine:
                return None
            return f"drop table {', '.join(mine)}{' cascade' if ddl.cascade else ''}"
        if any(t in held and t not in own_shape for t in ddl.tables):
            return statement
        return statement if ddl.created and self.node.all_tables else None

    def created(
        self,
        sub: psycopg.Connection,
        table: str,
        keys: list[str],
        existed: bool,
        appliers: dict[str, TableApplier],
        peer: PeerBatch | None,
    ) -> None:
        """A new set table, made here by the statement just run (or here before it)."""
        if not catalog.table_exists(sub, table):
            raise ApplyError(
                f"auto-ddl: the CREATE TABLE of {table} made no table of that name here (its search_path?)"
            )
        if peer is not None:
            if existed:
                raise ApplyError(
                    f"auto-ddl: {table}, which master {peer.peer} created, was here already: drop or rename"
                    " it here, and the worker goes on from this batch"
                )
            sub.execute(
                "select pgcascade.ddl_table_created(%s, %s::regclass, %s)", (peer.own_queue, table, keys)
            )
        else:
            # empty on both sides at this point of the stream; a table that was here is copied
            subscriber.adopt_table(
                sub, self.node.queue_name, table, table, keys, states.NEW if existed else states.OK
            )
            if existed:
                return
        st = subscriber.get_table(sub, self.node.queue_name, table)
        assert st is not None
        appliers[table] = TableApplier.build(sub, None, st, "json")


def run(
    sub: psycopg.Connection, ev_id: int, label: str, statement: str, search_path: list[str] | None
) -> None:
    """The statement, under the root's search_path when it was captured (and this session's
    after it)."""
    try:
        before = None
        if search_path is not None:
            before = scalar(sub, "select current_setting('search_path')")
            sub.execute(
                "select set_config('search_path', coalesce((select string_agg(quote_ident(s), ', ' order by o)"
                " from unnest(%s::text[]) with ordinality u(s, o)), ''), true)",
                (search_path,),
            )
        sub.execute(statement.encode())
        if before is not None:
            sub.execute("select set_config('search_path', %s, true)", (before,))
    except psycopg.OperationalError:
        raise
    except psycopg.Error as e:
        raise ApplyError(f"EXECUTE {label} (event {ev_id}): {db_error_line(e)}") from e


def table_oid(sub: psycopg.Connection, table: str) -> int | None:
    return scalar(sub, sql.SQL("select to_regclass({})::oid").format(sql.Literal(table)))


class PeerBehind(RuntimeFailure):
    """A peer's batch waits until this master applied DDL of another master that it holds."""

    def __init__(self, message: str, batch_end: int):
        super().__init__(message)
        self.batch_end = batch_end  # until past it, the peer's batches go a tick at a time


def await_origins(sub: psycopg.Connection, node: nodes.Node, batch_end: int) -> None:
    """A two-way peer's staged batch: the DDL the peer ran from other masters (passed on in its
    queue, tagged, with the tick of the other master's queue that carried it) must have been run
    here from that master first - the peer's changes after it may need it (rows of a table it
    made, a column it added).  Else PeerBehind: the batch is rolled back and taken again soon.
    Those events then leave the stage: this master runs each master's DDL from that master.

    Until past the batch that waited, the peer's batches take a tick each (no merged catch-up):
    two merged batches could each hold a DDL the other waits for (DDL on two masters while this
    one was away), where single ticks cannot - a master passes a DDL on only after it applied
    the ticks before it, so the tick one waits for always comes before the other's DDL."""
    staged = sub.execute(
        "select ev_extra4, max(case when ev_extra3 ~ '^[0-9]+$' then ev_extra3::int8 end)"
        " from pg_temp.pgcascade_stage where ev_type = 'EXECUTE' and ev_extra4 is not null group by 1"
    ).fetchall()
    for origin, tick in staged:
        row = sub.execute(
            "select coalesce(last_tick, 0) from pgcascade.node where peer_of = %s and provider_node = %s",
            (node.peer_of, origin),
        ).fetchone()
        if tick is not None and row is not None and row[0] < tick:
            raise PeerBehind(
                f"waiting: its batch follows DDL of master {origin} (tick {tick}) not applied here yet"
                f" (tick {row[0]})",
                batch_end,
            )
    sub.execute("delete from pg_temp.pgcascade_stage where ev_type = 'EXECUTE' and ev_extra4 is not null")


def forget_tables_left(
    conn: psycopg.Connection, queue: str, in_set: list[str], now_in_set: set[str]
) -> list[str]:
    """The tables the root removed from the set (a T event's list) stop being replicated here too
    (the seed's rule) - those the provider does not have now either, so an old T event never
    removes a table added back since; read as the batch left them (a DROP TABLE replayed)."""
    gone = [
        t.table_name
        for t in subscriber.tables(conn, queue)
        if t.table_name not in in_set and t.table_name not in now_in_set
    ]
    if gone:
        subscriber.remove_tables(conn, queue, gone)
    return gone
