"""Repair: the compare's differences as SQL that makes the subscriber equal to the provider.

`--output FILE` writes one transaction: the protection trigger of each table is disabled for
its duration (ALTER TABLE ... DISABLE TRIGGER is transactional), then DELETE the extra rows,
UPDATE the different ones, INSERT the missing ones, with the values the compare saw at its sync
point.  Such a file is exact for that moment: apply it with the worker stopped, or use --apply.

`--apply` does not trust the values of the compare's moment: the worker kept applying since.
It takes a new sync point (provider tables locked, subscriber caught up), and for every key that
differed it replaces the subscriber's row with the provider's row as it is now (or deletes it),
in one subscriber transaction under the lock, so a row changed since the compare is never put
back to an old value.

On a branch the fix goes through the queue instead, so that the nodes below get it too: a
branch has no capture of its own, and it may not put events of its own into the queue it
carries (every node that has the queue presents the root's batches, tick for tick).  The root,
under a SHARE lock of the tables, writes its rows of the differing keys (or their absence) as
`pgcascade.repair` events (sql/capture/96_repair.sql); every node applies them at their place
in the stream, the branch and everything below it included, and this command waits until the
branch has.  Elsewhere in the set they rewrite rows that are already the root's.  A leaf's
repair, and a two-way master's (its own capture sends the fix on), stay local.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psycopg
from psycopg import sql

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade.survey import find_root
from pgcascade.cascade.waits import wait_applied as wait_node_applied
from pgcascade.core import pgconn
from pgcascade.core.errors import RuntimeFailure, db_error_line
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pipeline import segments as sg
from pgcascade.pipeline.compare import TableResult
from pgcascade.pipeline.consistency import LOCK_TIMEOUT, target_tick, wait_applied

log = logging.getLogger("pgcascade.pipeline")

PROTECT_TRIGGER = "_pgcascade_protect"
APPLY_CHUNK = 1000
CASCADE_WAIT = 60.0  # seconds a branch's repair waits for the branch to apply the root's events


def _typed(value: str | None, type_: str) -> sql.Composable:
    if value is None:
        return sql.SQL("NULL")
    return sql.SQL("{}::{}").format(sql.Literal(value), sql.SQL(type_))


def key_match(spec: sg.TableSpec, key: list[str]) -> sql.Composed:
    return sql.SQL(" and ").join(
        sql.SQL("{} = {}").format(sql.Identifier(k), _typed(v, t))
        for k, v, t in zip(spec.keys, key, spec.key_types, strict=True)
    )


def statement(spec: sg.TableSpec, row: dict) -> sql.Composed:
    """The statement that fixes one differing row (row: kind, key, vals as fetch_rows gives them)."""
    dest = sql.SQL(spec.dest)
    if row["kind"] == "extra":
        return sql.SQL("delete from {} where {};").format(dest, key_match(spec, row["key"]))
    vals = [_typed(v, t) for v, t in zip(row["vals"], spec.types, strict=True)]
    if row["kind"] == "missing":
        return sql.SQL("insert into {} ({}) values ({});").format(
            dest, sql.SQL(", ").join(map(sql.Identifier, spec.columns)), sql.SQL(", ").join(vals)
        )
    sets = [
        sql.SQL("{} = {}").format(sql.Identifier(c), v)
        for c, v in zip(spec.columns, vals, strict=True)
        if c not in spec.keys
    ]
    return sql.SQL("update {} set {} where {};").format(
        dest, sql.SQL(", ").join(sets), key_match(spec, row["key"])
    )


def protected(conn: psycopg.Connection, dest: str) -> bool:
    return scalar(
        conn,
        "select exists (select 1 from pg_trigger where tgrelid = %s::regclass and tgname = %s)",
        (dest, PROTECT_TRIGGER),
    )


def trigger_toggle(dest: str, on: bool) -> sql.Composed:
    return sql.SQL("alter table {} {} trigger {};").format(
        sql.SQL(dest), sql.SQL("enable" if on else "disable"), sql.Identifier(PROTECT_TRIGGER)
    )


class SqlWriter:
    """Streams fix statements into a file: header, one statement per differing row, footer."""

    def __init__(
        self, out: IO[str], conn: psycopg.Connection, specs: tuple[sg.TableSpec, ...], branch: bool = False
    ):
        self.out = out
        self.conn = conn  # for quoting literals the way this server reads them
        self.guarded = [s.dest for s in specs if protected(conn, s.dest)]
        self.statements = 0
        out.write(
            "-- pgcascade repair: makes the subscriber's rows equal to the provider's at the compare's sync point\n"
        )
        if branch:
            out.write("-- on a branch it fixes this node only: repair --apply fixes the nodes below it too\n")
        out.write(f"{sg.SESSION_SETTINGS};\nbegin;\n")
        for dest in self.guarded:
            out.write(trigger_toggle(dest, False).as_string(conn) + "\n")

    def write(self, result: TableResult, row: dict) -> None:
        self.out.write(statement(result.spec, row).as_string(self.conn) + "\n")
        self.statements += 1

    def close(self) -> None:
        for dest in self.guarded:
            self.out.write(trigger_toggle(dest, True).as_string(self.conn) + "\n")
        self.out.write("commit;\n")
        self.out.flush()


class KeySpool:
    """The differing keys, spooled to a temporary file (bounded memory) for --apply."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile("w+", prefix="pgcascade-repair-")  # noqa: SIM115 (closed with the process)
        self.count = 0

    def write(self, result: TableResult, row: dict) -> None:
        self.file.write(json.dumps([result.spec.index, row["key"]]) + "\n")
        self.count += 1

    def chunks(self) -> Iterator[tuple[int, list[list[str]]]]:
        """(table index, keys) chunks of at most APPLY_CHUNK keys of one table."""
        self.file.seek(0)
        pending: dict[int, list[list[str]]] = {}
        for line in self.file:
            tidx, key = json.loads(line)
            keys = pending.setdefault(tidx, [])
            keys.append(key)
            if len(keys) >= APPLY_CHUNK:
                yield tidx, pending.pop(tidx)
        yield from pending.items()


def _keys_sql(spec: sg.TableSpec, keys: list[list[str]]) -> sql.Composed:
    """(k1, k2) in (values of these keys), with the keys inlined: COPY takes no parameters."""
    cols = [list(c) for c in zip(*keys, strict=True)]
    return sql.SQL("({}) in (select {} from unnest({}) u({}))").format(
        sql.SQL(", ").join(map(sql.Identifier, spec.keys)),
        sql.SQL(", ").join(
            sql.SQL("u.{}::{}").format(sql.Identifier(f"k{i}"), sql.SQL(t))
            for i, t in enumerate(spec.key_types)
        ),
        sql.SQL(", ").join(sql.SQL("{}::text[]").format(sql.Literal(c)) for c in cols),
        sql.SQL(", ").join(sql.Identifier(f"k{i}") for i in range(len(spec.keys))),
    )


def apply_fix(
    sub_dsn: str, queue: str, specs: tuple[sg.TableSpec, ...], spool: KeySpool, timeout: float
) -> int:
    """Replace every differing key's subscriber row by its current row upstream (or delete it):
    on a branch through the queue, for the nodes below too (`send_fix`), elsewhere here, under a
    new sync point, in one subscriber transaction.  Returns the keys fixed."""
    if spool.count == 0:
        return 0
    with pgconn.connect(sub_dsn, autocommit=True, connect_timeout=10) as sub:
        node = nodes.require_node(sub, queue)
        if node.role.copies_events:
            return send_fix(sub, node, specs, spool, timeout)
        prov_dsn = nodes.provider_location(sub, node)
        with (
            pgconn.connect(prov_dsn, autocommit=True, connect_timeout=10) as prov,
            pgconn.connect(prov_dsn) as lock,
        ):
            try:
                lock.execute(sql.SQL("set local lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
                lock.execute(sg.SESSION_SETTINGS.replace("set ", "set local "))
                lock.execute(
                    sql.SQL("lock table {} in share mode").format(
                        sql.SQL(", ").join(sql.SQL(s.table) for s in specs)
                    )
                )
                wait_applied(sub, queue, target_tick(prov, queue, timeout), timeout)
                written = 0
                with sub.transaction():
                    sub.execute(sg.SESSION_SETTINGS.replace("set ", "set local "))
                    guarded = [s.dest for s in specs if protected(sub, s.dest)]
                    for dest in guarded:
                        sub.execute(trigger_toggle(dest, False))
                    for tidx, keys in spool.chunks():
                        written += _replace_rows(lock, sub, specs[tidx], keys)
                    for dest in guarded:
                        sub.execute(trigger_toggle(dest, True))
            except psycopg.errors.LockNotAvailable:
                raise RuntimeFailure(f"could not lock the provider's tables within {LOCK_TIMEOUT}") from None
            except psycopg.Error as e:
                raise RuntimeFailure(f"repair failed, nothing applied: {db_error_line(e)}") from None
    return written


def send_fix(
    sub: psycopg.Connection,
    node: nodes.Node,
    specs: tuple[sg.TableSpec, ...],
    spool: KeySpool,
    timeout: float,
) -> int:
    """A branch's fix: sent down the cascade by the root (`emit_fix`), then waited for until
    this branch has applied it.  Returns the keys fixed."""
    queue = node.queue_name
    root_name, root_dsn = find_root(sub, queue)
    tick = emit_fix(root_dsn, queue, specs, spool, timeout)
    log.info("repair of %d key(s) sent through the root %s's queue, tick %d", spool.count, root_name, tick)
    wait_node_applied(
        sub,
        queue,
        tick,
        f"{node.node_name} to apply the fix sent through the queue (it stays queued: is the worker running?)",
        log.info,
        max(timeout, CASCADE_WAIT),
    )
    return spool.count


def emit_fix(
    root_dsn: str, queue: str, specs: tuple[sg.TableSpec, ...], spool: KeySpool, timeout: float
) -> int:
    """The root's current rows of the spooled keys (or their absence) into its queue as repair
    events, under a SHARE lock of those tables (no write comes between the rows read and the
    events); returns a tick whose batches hold them."""
    with pgconn.connect(root_dsn, autocommit=True, connect_timeout=10) as root:
        try:
            with root.transaction():
                root.execute(sql.SQL("set local lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
                root.execute(
                    sql.SQL("lock table {} in share mode").format(
                        sql.SQL(", ").join(sql.SQL(s.table) for s in specs)
                    )
                )
                for tidx, keys in spool.chunks():
                    spec = specs[tidx]
                    keyvals = json.dumps([dict(zip(spec.keys, k, strict=True)) for k in keys])
                    set_tables.emit_repair(root, queue, spec.table, list(spec.keys), keyvals)
        except psycopg.errors.LockNotAvailable:
            raise RuntimeFailure(f"could not lock the tables on the root within {LOCK_TIMEOUT}") from None
        except psycopg.Error as e:
            raise RuntimeFailure(f"repair failed, nothing sent: {db_error_line(e)}") from None
        try:  # sent: what fails from here on leaves the fix queued, to be applied in order
            if logical.is_logical(root, queue):
                logical.wait_captured(root, queue, max(timeout, CASCADE_WAIT))
            return q.ticker(root, queue)
        except (psycopg.Error, RuntimeFailure) as e:
            why = db_error_line(e) if isinstance(e, psycopg.Error) else str(e)
            raise RuntimeFailure(f"the fix is in the root's queue, but not yet in a batch: {why}") from None


def _replace_rows(
    prov: psycopg.Connection, sub: psycopg.Connection, spec: sg.TableSpec, keys: list[list[str]]
) -> int:
    """Delete these keys on the subscriber, then COPY the provider's rows of them in (text format,
    same session settings on both sides)."""
    match = _keys_sql(spec, keys)
    sub.execute(sql.SQL("delete from {} where {}").format(sql.SQL(spec.dest), match))
    cols = sql.SQL(", ").join(map(sql.Identifier, spec.columns))
    out = sql.SQL("copy (select {} from {} where {}) to stdout").format(cols, spec.relation("prov"), match)
    into = sql.SQL("copy {} ({}) from stdin").format(sql.SQL(spec.dest), cols)
    with prov.cursor() as oc, sub.cursor() as ic, oc.copy(out) as src, ic.copy(into) as dst:
        for block in src:
            dst.write(block)
    return len(keys)


def write_report(results: list[TableResult], out: IO[str], count_only: bool = False) -> None:
    """One line per table, Londiste-like, plus a few differing keys."""
    for r in results:
        name = r.spec.table if r.spec.dest == r.spec.table else f"{r.spec.table} -> {r.spec.dest}"
        if count_only:
            verdict = "ok" if r.rows == r.sub_rows else "DIFFERENT"
            out.write(f"{name}: provider {r.rows} rows, subscriber {r.sub_rows} rows: {verdict}\n")
            continue
        verdict = "ok" if r.equal else "DIFFERENT"
        out.write(
            f"{name}: rows {r.rows}, missing {r.missing}, extra {r.extra}, different {r.different}: {verdict}\n"
        )
        for kind, keys in r.samples.items():
            shown = ", ".join("(" + ", ".join(k) + ")" for k in keys)
            out.write(f"  {kind}: {shown}{' ...' if getattr(r, kind) > len(keys) else ''}\n")


def report_rows(results: list[TableResult], count_only: bool = False) -> list[dict]:
    """`compare --json`: one object per table (docs/monitoring.md); keys as text, as in repair."""
    out = []
    for r in results:
        row = {"table": r.spec.table, "dest": r.spec.dest, "rows": r.rows, "sub_rows": r.sub_rows}
        if count_only:
            row["equal"] = r.rows == r.sub_rows
        else:
            row |= {"missing": r.missing, "extra": r.extra, "different": r.different, "equal": r.equal}
            row["samples"] = r.samples
        out.append(row)
    return out


def open_output(path: str) -> IO[str]:
    if path == "-":
        import sys

        return sys.stdout
    return Path(path).open("w")
