"""Logical capture on the root: a pgoutput slot read into the queue, exactly once.

A root created with `--capture=logical` has a publication (its tables) and a logical
replication slot with the pgoutput plugin; no trigger runs in the application's
transactions.  The capture daemon (`pgcascade CONF capture`) reads the slot with
`pg_logical_slot_peek_binary_changes` (psycopg 3 has no replication-protocol client) through a
server-side cursor, decodes the pgoutput messages (protocol 1) and writes the same events the
triggers write: ev_type I/U/D/R, ev_extra1 the table's canonical name, ev_data the row as
`row_to_json` makes it - built by the database from the text values pgoutput sends, cast to
the columns' types, so every type comes out as the trigger would write it.

Exactly once: each round holds `pgcascade.walcapture`'s row lock (one daemon at a time),
inserts the events of whole source transactions in one queue transaction together with the
end LSN of the last one (`confirmed_lsn`), commits durably, and only then advances the slot.
A source transaction whose commit record starts below `confirmed_lsn` was captured already
and is skipped, so a crash anywhere (daemon or server) repeats nothing and loses nothing: the
slot never moves past what the queue holds.  A source transaction is never split between
queue transactions, so ticks never split it either; a huge one streams through (the server
spills it to disk, the daemon holds a bounded chunk of rows).

The root's own events (the table list T, EXECUTE) travel through the WAL as transactional
logical messages (`pgcascade.emit_event`), so they keep their place among the row changes.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from pgcascade import node as nodes
from pgcascade.config import JobConfig
from pgcascade.daemon import Daemon
from pgcascade.errors import RuntimeFailure, UserError, db_error_line

log = logging.getLogger("pgcascade.capture")

MESSAGE_PREFIX = "pgcascade"
# Both connections use the trigger functions' output settings: the text pgoutput sends is read
# back with the same DateStyle, and row_to_json then renders every value as the triggers do.
SESSION_SETTINGS = (
    "set datestyle = 'ISO, MDY'; set intervalstyle = postgres; set extra_float_digits = 3;"
    " set bytea_output = hex; set search_path = pg_catalog"
)
CHUNK_ROWS = 5000  # rows buffered before they are written (all tables together)
CHUNK_BYTES = 8 << 20
PG_EPOCH = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)


class Unchanged:
    """pgoutput's 'u': a TOASTed value the UPDATE did not change, not sent."""


UNCHANGED = Unchanged()
Value = str | None | Unchanged


def pause_point(name: str) -> None:
    """Test hook: with PGCASCADE_PAUSE_AT=name in the environment, log and sleep here, so a
    test can SIGKILL the daemon at exactly this point."""
    if os.environ.get("PGCASCADE_PAUSE_AT") == name:
        log.info("pause point %s (pid %d)", name, os.getpid())
        time.sleep(float(os.environ.get("PGCASCADE_PAUSE_SECONDS", "60")))


def lsn_int(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def lsn_str(v: int) -> str:
    return f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"


# --- set-up (create-root --capture=logical, add-table, remove-table) ----------------------------


def is_logical(conn: psycopg.Connection, queue: str) -> bool:
    if conn.execute("select to_regclass('pgcascade.walcapture') is null").fetchone()[0]:
        return False
    row = conn.execute("select 1 from pgcascade.walcapture where queue_name = %s", (queue,)).fetchone()
    return row is not None


def slot_name_for(conn: psycopg.Connection, queue: str) -> tuple[str, str]:
    """(slot, publication): slots are per cluster, so the slot's name carries the database."""
    qid, dboid = conn.execute(
        "select queue_id, (select oid from pg_database where datname = current_database())"
        " from pgcascade.queue where queue_name = %s",
        (queue,),
    ).fetchone()
    return f"pgcascade_{dboid}_{qid}", f"pgcascade_{qid}"


def setup_logical(conn: psycopg.Connection, queue: str) -> bool:
    """Make the root `queue` capture through a slot; True if anything was created.  Repeatable:
    a slot lost (dropped by hand) is created again, from now on."""
    if conn.execute("select current_setting('wal_level')").fetchone()[0] != "logical":
        raise UserError("logical capture needs wal_level = logical on the root (a server restart)")
    created = False
    if not is_logical(conn, queue):
        if conn.execute("select 1 from pgcascade.set_table where queue_name = %s", (queue,)).fetchone():
            raise UserError(
                f"root of {queue} captures with triggers and has tables: remove them first, or keep triggers"
            )
        slot, pub = slot_name_for(conn, queue)
        with conn.transaction():
            if not conn.execute("select 1 from pg_publication where pubname = %s", (pub,)).fetchone():
                # via_partition_root: a partitioned table's changes carry its own name, as with triggers
                conn.execute(
                    sql.SQL("create publication {} with (publish_via_partition_root = true)").format(
                        sql.Identifier(pub)
                    )
                )
            conn.execute(
                "insert into pgcascade.walcapture (queue_name, slot_name, publication) values (%s, %s, %s)",
                (queue, slot, pub),
            )
        created = True
    slot = conn.execute(
        "select slot_name from pgcascade.walcapture where queue_name = %s", (queue,)
    ).fetchone()[0]
    if not conn.execute("select 1 from pg_replication_slots where slot_name = %s", (slot,)).fetchone():
        # after the publication exists: decoding looks it up as of each change it decodes
        try:
            conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        except psycopg.Error as e:
            raise RuntimeFailure(f"cannot create replication slot {slot}: {db_error_line(e)}") from None
        created = True
    return created


def add_table(conn: psycopg.Connection, queue: str, table: str, keys: list[str]) -> str:
    """Publish the table; returns the replica identity it needs ('default' or 'full')."""
    return conn.execute(
        "select pgcascade.walcapture_add_table(%s, %s::regclass, %s)", (queue, table, keys)
    ).fetchone()[0]


def remove_table(conn: psycopg.Connection, queue: str, table: str) -> None:
    conn.execute("select pgcascade.walcapture_remove_table(%s, %s::regclass)", (queue, table))


def wait_captured(conn: psycopg.Connection, queue: str, timeout: float) -> None:
    """Wait until everything committed on the root before this call is in the queue."""
    target = conn.execute("select pg_current_wal_lsn()").fetchone()[0]
    deadline = time.monotonic() + timeout
    while True:
        done = conn.execute(
            "select greatest(w.confirmed_lsn, s.confirmed_flush_lsn) >= %s::pg_lsn"
            " from pgcascade.walcapture w left join pg_replication_slots s on s.slot_name = w.slot_name"
            " where w.queue_name = %s",
            (target, queue),
        ).fetchone()
        if done is None or done[0]:
            return
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"the capture daemon of {queue} has not read the WAL up to {target}")
        time.sleep(0.05)


# --- pgoutput (protocol version 1) ------------------------------------------------------------


@dataclass
class Relation:
    relid: int
    canonical: str
    names: list[str]
    casts: list[str]  # format_type() of each column
    key_idx: list[int]
    insert_sql: sql.Composed | None = field(default=None, repr=False)


class Reader:
    """A cursor over one pgoutput message."""

    def __init__(self, data: bytes):
        self.d = data
        self.p = 1

    def unpack(self, fmt: str) -> tuple:
        v = struct.unpack_from(fmt, self.d, self.p)
        self.p += struct.calcsize(fmt)
        return v

    def byte(self) -> bytes:
        b = self.d[self.p : self.p + 1]
        self.p += 1
        return b

    def cstring(self) -> str:
        end = self.d.index(b"\0", self.p)
        s = self.d[self.p : end].decode()
        self.p = end + 1
        return s

    def tuple(self) -> list[Value]:
        (n,) = self.unpack(">H")
        vals: list[Value] = []
        for _ in range(n):
            kind = self.byte()
            if kind == b"n":
                vals.append(None)
            elif kind == b"u":
                vals.append(UNCHANGED)
            elif kind == b"t":
                (length,) = self.unpack(">I")
                vals.append(self.d[self.p : self.p + length].decode())
                self.p += length
            else:
                raise RuntimeFailure(f"pgoutput: unexpected tuple value kind {kind!r}")
        return vals


# --- the daemon ---------------------------------------------------------------------------------


class WalCapture(Daemon):
    """Reads the root's slot into its queue; see the module docstring."""

    name = "capture"

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.loop_delay = float(cfg.raw["loop_delay"]) if cfg.raw.get("loop_delay") else 0.02
        self.max_changes = int(cfg.raw.get("capture_max_changes") or 20000)
        self.queue = cfg.queue_name or ""
        self.reader: psycopg.Connection | None = None
        self.writer: psycopg.Connection | None = None
        self.rels: dict[int, Relation] = {}
        self.keys: dict[str, list[str]] = {}
        self.read_upto = 0  # the WAL position the last complete round read up to
        self._reset_round()

    def _reset_round(self) -> None:
        self.stored = 0  # confirmed_lsn at the start of the round
        self.skip = False  # the current source transaction was captured before
        self.buf: dict[int, list[list]] = {}
        self.buf_rows = 0
        self.buf_bytes = 0
        self.last_end = 0  # end LSN of the last source transaction written this round
        self.last_commit: datetime.datetime | None = None
        self.events = 0
        self.txns = 0
        self.skipped = 0

    # --- connections ---
    def connect(self) -> tuple[psycopg.Connection, psycopg.Connection]:
        if self.reader is None or self.reader.closed or self.writer is None or self.writer.closed:
            self.drop_connections()
            if not self.cfg.db or not self.queue:
                raise UserError(f"{self.cfg.path}: db and queue_name must be set")
            self.reader = psycopg.connect(self.cfg.db, autocommit=True, connect_timeout=10)
            self.writer = psycopg.connect(self.cfg.db, autocommit=False, connect_timeout=10)
            for c, role in ((self.reader, "reader"), (self.writer, "writer")):
                c.execute(f"set application_name = 'pgcascade capture {role}'")
                c.execute(SESSION_SETTINGS)
            # each peek logs "starting logical decoding" at LOG level: 2-4 lines a round would
            # flood the server log (a superuser may turn that off; the daemon logs its own errors)
            with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                self.reader.execute("set log_min_messages = fatal")
            # the slot advances right after this commit: it must be on disk first
            self.writer.execute("set synchronous_commit = on")
            self.writer.commit()
            node = nodes.get_node(self.writer, self.queue)
            if node is None or node.node_type != "root" or not is_logical(self.writer, self.queue):
                self.writer.rollback()
                raise UserError(f"this database is not a root of {self.queue} with logical capture")
            self.writer.rollback()
            self.rels.clear()
        return self.reader, self.writer

    def drop_connections(self) -> None:
        for c in (self.reader, self.writer):
            if c is not None and not c.closed:
                c.close()
        self.reader = self.writer = None

    def shutdown(self) -> None:
        self.drop_connections()

    def report_error(self, e: Exception) -> None:
        if isinstance(e, psycopg.OperationalError):
            self.drop_connections()
        elif self.writer is not None and not self.writer.closed:
            try:
                self.writer.rollback()
            except psycopg.Error:
                self.drop_connections()

    # --- one round ---
    def work(self) -> bool:
        reader, writer = self.connect()
        # nothing written since the last complete round: no need to decode (and log) anything
        if lsn_int(reader.execute("select pg_current_wal_flush_lsn()::text").fetchone()[0]) == self.read_upto:
            return False
        self._reset_round()
        row = writer.execute(
            "select slot_name, publication, confirmed_lsn::text from pgcascade.walcapture"
            " where queue_name = %s for update",
            (self.queue,),
        ).fetchone()
        if row is None:
            raise RuntimeFailure(f"queue {self.queue} no longer captures through a slot")
        slot, pub, stored = row
        self.stored = lsn_int(stored)
        slot_lsn = self.slot_position(reader, slot)
        if slot_lsn < self.stored:  # the slot's advance was lost in a crash: skip what we have
            log.info(
                "slot %s at %s is behind the queue's position %s: advancing it",
                slot,
                lsn_str(slot_lsn),
                stored,
            )
            reader.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, stored))
        self.keys = dict(
            writer.execute(
                "select table_name, key_columns from pgcascade.set_table where queue_name = %s", (self.queue,)
            ).fetchall()
        )
        upto = lsn_int(reader.execute("select pg_current_wal_flush_lsn()::text").fetchone()[0])
        n = self.read_slot(reader, slot, pub, upto)
        self.flush()
        if self.last_end > self.stored:
            writer.execute(
                "update pgcascade.walcapture set confirmed_lsn = %s::pg_lsn, last_commit = coalesce(%s, last_commit),"
                " last_capture = now() where queue_name = %s",
                (lsn_str(self.last_end), self.last_commit, self.queue),
            )
        if self.events:
            pause_point("written-not-committed")
        writer.commit()
        if self.skipped:
            log.info("skipped %d transactions captured before (the slot had not been advanced)", self.skipped)
        if self.events:
            log.debug("captured %d events of %d transactions", self.events, self.txns)
            pause_point("committed-not-advanced")
        complete = n < self.max_changes  # every transaction committed before `upto` was read
        self.read_upto = upto if complete else 0
        target = upto if complete else self.last_end
        if target > max(slot_lsn, self.stored):
            reader.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, lsn_str(target)))
        return not complete

    def slot_position(self, reader: psycopg.Connection, slot: str) -> int:
        row = reader.execute(
            "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = %s", (slot,)
        ).fetchone()
        if row is None:
            raise RuntimeFailure(
                f"replication slot {slot} does not exist: run create-root with --capture=logical again"
                " (changes made while it was missing are not in the queue)"
            )
        return lsn_int(row[0])

    def read_slot(self, reader: psycopg.Connection, slot: str, pub: str, upto: int) -> int:
        n = 0
        with reader.transaction(), reader.cursor(name="pgcascade_capture") as cur:
            cur.itersize = 2000
            cur.execute(
                "select data from pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, %s,"
                " 'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
                (slot, lsn_str(upto), self.max_changes, pub),
            )
            for (data,) in cur:
                n += 1
                self.handle(bytes(data))
        return n

    # --- messages ---
    def handle(self, data: bytes) -> None:
        kind = data[:1]
        r = Reader(data)
        if kind == b"B":
            final_lsn, _ts, _xid = r.unpack(">qqI")
            self.skip = final_lsn < self.stored
            self.skipped += self.skip
        elif kind == b"C":
            _flags, _commit_lsn, end_lsn, ts = r.unpack(">bqqq")
            if not self.skip:
                self.last_end = end_lsn
                self.last_commit = PG_EPOCH + datetime.timedelta(microseconds=ts)
                self.txns += 1
        elif kind == b"R":
            self.on_relation(r)
        elif self.skip or kind in (b"Y", b"O"):
            return
        elif kind == b"I":
            (relid,) = r.unpack(">I")
            r.byte()  # 'N'
            self.add_row(relid, "I", r.tuple())
        elif kind == b"U":
            self.on_update(r)
        elif kind == b"D":
            (relid,) = r.unpack(">I")
            r.byte()  # 'K' or 'O'
            self.add_row(relid, "D", r.tuple())
        elif kind == b"T":
            (nrels,) = r.unpack(">I")
            r.unpack(">b")  # cascade / restart identity: the subscriber truncates its own way
            relids = r.unpack(f">{nrels}I")
            self.flush()
            for relid in relids:
                self.insert_event("R", None, self.rels[relid].canonical)
        elif kind == b"M":
            self.on_message(r)
        else:
            raise RuntimeFailure(f"pgoutput: unexpected message {kind!r}")

    def on_relation(self, r: Reader) -> None:
        (relid,) = r.unpack(">I")
        nsp = r.cstring() or "pg_catalog"
        name = r.cstring()
        r.byte()  # replica identity
        (ncols,) = r.unpack(">H")
        cols = []
        for _ in range(ncols):
            (flags,) = r.unpack(">b")
            cols.append((flags, r.cstring(), *r.unpack(">Ii")))
        assert self.writer is not None
        canonical, casts = self.writer.execute(
            "select format('%%I.%%I', %s::text, %s::text),"
            " array(select format_type(t, nullif(m, -1)) from unnest(%s::oid[], %s::int4[]) with ordinality u(t, m, o)"
            "       order by o)",
            (nsp, name, [c[2] for c in cols], [c[3] for c in cols]),
        ).fetchone()
        names = [c[1] for c in cols]
        keys = self.keys.get(canonical)
        key_idx = [names.index(k) for k in keys if k in names] if keys else []
        if not key_idx:
            key_idx = [i for i, c in enumerate(cols) if c[0] & 1]
        if relid in self.rels and self.buf.get(relid):
            self.flush()  # rows buffered under the old definition go out with it
        self.rels[relid] = Relation(relid, canonical, names, casts, key_idx)

    def on_update(self, r: Reader) -> None:
        (relid,) = r.unpack(">I")
        kind = r.byte()
        old: list[Value] | None = None
        if kind in (b"K", b"O"):
            old = r.tuple()
            r.byte()  # 'N'
        new = r.tuple()
        rel = self.rels[relid]
        for i, v in enumerate(new):
            if v is UNCHANGED:
                if kind != b"O":
                    raise RuntimeFailure(
                        f"{rel.canonical}: an UPDATE kept a TOASTed value that pgoutput does not send;"
                        f" set REPLICA IDENTITY FULL on the table (add-table does so when it is needed)"
                    )
                new[i] = old[i]  # type: ignore[index]
        if old is not None and any(old[i] != new[i] for i in rel.key_idx):
            self.add_row(relid, "D", old)  # the key changed: as the triggers write it
            self.add_row(relid, "I", new)
        else:
            self.add_row(relid, "U", new)

    def on_message(self, r: Reader) -> None:
        (_flags, _lsn) = r.unpack(">bq")
        prefix = r.cstring()
        (length,) = r.unpack(">I")
        content = r.d[r.p : r.p + length].decode()
        if prefix != MESSAGE_PREFIX:
            return
        ev = json.loads(content)
        if ev.get("queue") != self.queue:
            return
        self.flush()
        self.insert_event(ev["type"], ev.get("data"), ev.get("extra1"))

    # --- writing events ---
    def add_row(self, relid: int, op: str, vals: list[Value]) -> None:
        self.buf.setdefault(relid, []).append([op, vals])
        self.buf_rows += 1
        self.buf_bytes += sum(len(v) for v in vals if isinstance(v, str)) + 16
        if self.buf_rows >= CHUNK_ROWS or self.buf_bytes >= CHUNK_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows: one statement per table, each table's rows in order (the
        apply orders a key's events by ev_id; barriers flush first, so they keep their place)."""
        assert self.writer is not None
        for relid, rows in self.buf.items():
            rel = self.rels[relid]
            if rel.insert_sql is None:
                rel.insert_sql = self.insert_sql(rel)
            cur = self.writer.execute(rel.insert_sql, (json.dumps(rows, ensure_ascii=False),))
            if cur.rowcount != len(rows):
                raise RuntimeFailure(f"queue {self.queue} does not exist any more")
            self.events += len(rows)
        self.buf.clear()
        self.buf_rows = self.buf_bytes = 0

    def insert_sql(self, rel: Relation) -> sql.Composed:
        # each row arrives as [op, [text values]]; the cast makes each value the column's type
        # again (its input function: the exact inverse of the output pgoutput used), and
        # row_to_json renders the row as the capture trigger does
        cols = sql.SQL(", ").join(
            sql.SQL("(x.v->>{})::{} as {}").format(sql.Literal(i), sql.SQL(cast), sql.Identifier(name))
            for i, (name, cast) in enumerate(zip(rel.names, rel.casts, strict=True))
        )
        return sql.SQL(
            "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1)"
            " select nextval(q.queue_event_seq), now(), q.queue_id * 16 + q.queue_cur_table, x.op,"
            " row_to_json(r.*)::text, {table}"
            " from pgcascade.queue q,"
            " (select e->>0 as op, e->1 as v, n from json_array_elements(%s::json) with ordinality a(e, n)) x,"
            " lateral (select {cols}) r"
            " where q.queue_name = {queue} order by x.n"
        ).format(table=sql.Literal(rel.canonical), cols=cols, queue=sql.Literal(self.queue))

    def insert_event(self, ev_type: str, data: str | None, extra1: str | None) -> None:
        assert self.writer is not None
        cur = self.writer.execute(
            "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1)"
            " select nextval(q.queue_event_seq), now(), q.queue_id * 16 + q.queue_cur_table, %s, %s, %s"
            " from pgcascade.queue q where q.queue_name = %s",
            (ev_type, data, extra1, self.queue),
        )
        if cur.rowcount != 1:
            raise RuntimeFailure(f"queue {self.queue} does not exist any more")
        self.events += 1


def refuse_without_logical_root(conn: psycopg.Connection, queue: str) -> None:
    node = nodes.require_node(conn, queue)
    if node.node_type != "root" or not is_logical(conn, queue):
        raise UserError(
            f"node {node.node_name} ({node.node_type}) has no logical capture: it is set at create-root --capture=logical"
        )
