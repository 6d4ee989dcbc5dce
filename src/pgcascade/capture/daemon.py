"""The capture daemon: a root's pgoutput slot read into its queue, exactly once.

A root created with `--capture=logical` has a publication (its tables) and a logical
replication slot with the pgoutput plugin; no trigger runs in the application's
transactions.  The capture daemon (`pgcascade CONF capture`) reads the slot through the
streaming replication protocol (one decoding session, `SlotStream`), decodes the pgoutput
messages (protocol 1) and writes the same events the triggers write: ev_type I/U/D/R,
ev_extra1 the table's canonical name, ev_data the row as `row_to_json` makes it - built by the
database from the text values pgoutput sends, cast to the columns' types, so every type comes
out as the trigger would write it.  (The SQL functions pg_logical_slot_peek_changes would
decode again from the slot's restart point at every call: up to 15 s of WAL a round.)

Exactly once: the events of whole source transactions go into the queue in one queue
transaction together with the end LSN of the last one (`confirmed_lsn`), committed durably;
only then is the slot told (standby status update) that it may move there.  A source
transaction whose commit record starts below `confirmed_lsn` was captured already and is
skipped, so a crash anywhere (daemon or server) repeats nothing and loses nothing: the slot
never moves past what the queue holds.  The slot itself admits one reader at a time.  A
source transaction is never split between queue transactions, so ticks never split it
either; a huge one streams through (the server spills it to disk, the daemon writes it in
chunks into one open queue transaction and holds a bounded number of rows).

The root's own events (the table list T, EXECUTE) travel through the WAL as transactional
logical messages (`pgcascade.emit_event`), so they keep their place among the row changes.

On a two-way master, a peer's apply runs under the replication origin `pgcascade_<peer>`; the
Origin message pgoutput sends for such a transaction makes its events carry the peer's name in
ev_extra4, as the capture triggers do with `pgcascade.origin`.
"""

from __future__ import annotations

import datetime
import json
import logging
import time

import psycopg

from pgcascade.capture import events, images, logical
from pgcascade.capture import tables as set_tables
from pgcascade.capture.pgoutput import (
    PG_EPOCH,
    UNCHANGED,
    Reader,
    Relation,
    SlotStream,
    Value,
    lsn_int,
    lsn_str,
)
from pgcascade.core import metrics, pgconn, privileges, roundtrip
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon
from pgcascade.core.daemonlock import DaemonRole
from pgcascade.core.errors import RuntimeFailure, UserError, redact
from pgcascade.core.hooks import pause_point
from pgcascade.core.pgconn import one
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q

log = logging.getLogger("pgcascade.capture")

MESSAGE_PREFIX = "pgcascade"
# Both connections use the trigger functions' output settings: the text pgoutput sends is read
# back with the same DateStyle, and row_to_json then renders every value as the triggers do.
SESSION_SETTINGS = (
    "set datestyle = 'ISO, MDY'; set intervalstyle = postgres; set extra_float_digits = 3;"
    " set bytea_output = hex; set search_path = pg_catalog"
)
CHUNK_ROWS = 5000  # rows buffered before they are written; a round commits after this many
MAX_ROUND_SECONDS = 0.5  # a round under steady load commits at least this often
IDLE_REPORT = 0.2  # when idle, ask the server where it has read to this often
KEEPALIVE_SECONDS = 10.0  # status updates at least this often, also while busy
CHUNK_BYTES = 8 << 20
SLOT_POLL = 2.0  # seconds between looks at a lost slot


class SlotLost(RuntimeFailure):
    """The slot cannot be read any more (invalidated or dropped): recover-slot makes a new one."""


class WalCapture(Daemon):
    """Reads the root's slot into its queue; see the module docstring."""

    name = "capture"
    default_loop_delay = 0.02
    lock_role = DaemonRole.CAPTURE

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.queue = cfg.queue_name or ""
        self.commit_delay = cfg.capture.capture_commit_delay
        self.stream: SlotStream | None = None
        self.writer: psycopg.Connection | None = None
        self.rels: dict[int, Relation] = {}
        self.keys: dict[str, list[str]] = {}
        self.stored = 0  # confirmed_lsn: transactions whose commit starts below it are in the queue
        self.committed = 0  # the same, as told to the slot
        self.safe = 0  # the server has sent everything before this and all of it is committed
        self.in_txn = False  # between a B and its C
        self.txn_time = ""  # the current source transaction's commit time
        self.origin: str | None = None  # the two-way peer whose apply made the current transaction
        self.buf_origin: str | None = None  # ... and that of the buffered rows
        self.skip = False  # the current source transaction was captured before
        self.asked_at = 0.0
        self.fed_at = 0.0
        self.lost_reported: str | None = None  # the lost slot's message, logged once
        self._reset_round()

    def reload(self) -> None:
        """SIGHUP (-r): the timing settings; db and queue_name need a restart."""
        self.loop_delay = self.cfg.loop_delay or self.default_loop_delay
        self.commit_delay = self.cfg.capture.capture_commit_delay

    def _reset_round(self) -> None:
        self.buf: dict[int, list[list]] = {}
        self.buf_rows = 0
        self.buf_bytes = 0
        self.last_end = 0  # end LSN of the last source transaction written this round
        self.last_commit: datetime.datetime | None = None
        self.events = 0
        self.txns = 0
        self.skipped = 0

    # --- connections ---
    def connect(self) -> tuple[SlotStream, psycopg.Connection]:
        if self.stream is None or self.stream.closed or self.writer is None or self.writer.closed:
            self.drop_connections()
            if not self.cfg.db or not self.queue:
                raise UserError(f"{self.cfg.path}: db and queue_name must be set")
            writer = self.writer = pgconn.connect(self.cfg.db, autocommit=False, connect_timeout=10)
            writer.execute("set application_name = 'pgcascade capture writer'")
            writer.execute(SESSION_SETTINGS)
            # the slot is told about a position right after its commit: it must be on disk first
            writer.execute("set synchronous_commit = on")
            writer.commit()  # SET in a transaction lasts only if it commits
            node = nodes.get_node(writer, self.queue)
            if node is None or not node.role.is_root or not logical.is_logical(writer, self.queue):
                raise UserError(f"this database is not a root of {self.queue} with logical capture")
            slot, pub, stored = one(
                writer,
                "select slot_name, publication, confirmed_lsn::text from pgcascade.walcapture where queue_name = %s",
                (self.queue,),
            )
            state = writer.execute(
                "select wal_status from pg_replication_slots where slot_name = %s", (slot,)
            ).fetchone()
            if state is None or state[0] == "lost":
                problem = (
                    logical.slot_problem(writer, self.queue) or f"replication slot {slot} cannot be read"
                )
                writer.rollback()
                raise SlotLost(problem)
            writer.rollback()
            self.lost_reported = None
            self.stored = self.committed = lsn_int(stored)
            self.safe = 0
            self.rels.clear()
            self.in_txn = self.skip = False
            self.stream = SlotStream(self.cfg.db, slot, pub, self.stored)
            log.info("reading slot %s from %s", slot, stored)
            writer.execute(
                "update pgcascade.walcapture set last_error = null, last_error_time = null"
                " where queue_name = %s and last_error is not null",
                (self.queue,),
            )
            writer.commit()
        return self.stream, self.writer

    def drop_connections(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.writer is not None and not self.writer.closed:
            self.writer.close()
        self.stream = None
        self.writer = None

    def shutdown(self) -> None:
        self.drop_connections()

    def report_error(self, e: Exception) -> None:
        # the stream has handed out changes the queue does not hold: start it again from the
        # queue's position (events written but not committed vanish with the connection)
        self.drop_connections()
        # and make the failure visible in `status` (best effort: the database may be down)
        message = privileges.explain(e, self.cfg.db)
        try:
            with pgconn.connect(self.cfg.db or "", autocommit=True, connect_timeout=5) as conn:
                conn.execute(
                    "update pgcascade.walcapture set last_error = %s, last_error_time = now() where queue_name = %s",
                    (redact(message), self.queue),
                )
        except psycopg.Error:
            pass

    def sleep(self, seconds: float) -> None:
        """Idle: wait for the stream's next message; ask the server now and then where it has
        read to, so that the slot moves on (and its WAL is released) while nothing is captured."""
        if self.stream is None or self.stream.closed:
            time.sleep(seconds)
            return
        if time.monotonic() - self.asked_at > IDLE_REPORT:
            self.feedback(reply=True)
        self.stream.wait(min(seconds, IDLE_REPORT))

    def feedback(self, reply: bool = False) -> None:
        assert self.stream is not None
        self.stream.feedback(max(self.committed, self.safe), reply)
        self.fed_at = time.monotonic()
        if reply:
            self.asked_at = self.fed_at

    def keep_alive(self) -> None:
        """While a big transaction is read and written: the walsender drops a client silent for
        wal_sender_timeout (60 s by default)."""
        if time.monotonic() - self.fed_at > KEEPALIVE_SECONDS and self.stream is not None:
            self.feedback()

    def wait_for_new_slot(self, e: SlotLost) -> None:
        """The slot is lost or missing: say so once (log, `status`), then look again now and
        then, until recover-slot has made a new one - not the error back-off, which would make
        the capture resume up to 30 s after the recovery."""
        if str(e) != self.lost_reported:
            log.error("%s; waiting for a new slot", e)
            self.report_error(e)
            self.lost_reported = str(e)
        self.drop_connections()
        self.backoff_sleep(SLOT_POLL)

    # --- one round: read what the stream has, commit it ---
    def work(self) -> bool:
        try:
            stream, _ = self.connect()
        except SlotLost as e:
            self.wait_for_new_slot(e)
            return False
        self._reset_round()
        started = time.monotonic()
        more = False
        n = 0
        while True:
            elapsed = time.monotonic() - started
            if self.in_txn:
                timeout = 10.0  # the rest of a transaction is on its way
            elif self.events >= CHUNK_ROWS or elapsed > MAX_ROUND_SECONDS:
                more = True
                break
            else:
                # gather the transactions of `commit_delay` into one queue transaction: a
                # commit (an fsync, six statements) per source transaction would cost more
                # than the application's own
                timeout = max(self.commit_delay - elapsed, 0.0) if self.txns else 0.0
            msg = stream.read(timeout)
            if msg is None:
                if self.in_txn:
                    raise RuntimeFailure("the replication stream stopped inside a transaction")
                break
            if msg[0] == "k":  # keepalive: the server has sent everything before wal_end
                if not self.in_txn and self.last_end <= self.committed:
                    self.safe = max(self.safe, msg[1])
                if msg[2]:
                    self.feedback()
                continue
            self.handle(msg[1])
            n += 1
            if n % 1000 == 0:
                self.keep_alive()
        self.commit()
        self.feedback()
        return more

    def commit(self) -> None:
        """Commit the events of the whole source transactions read this round, with their end."""
        assert self.writer is not None
        then: list[tuple[str, tuple]] = []  # sent with the last rows: one round trip, then the commit
        if self.last_end > self.committed:
            then.append((events.CONFIRM, (lsn_str(self.last_end), self.last_commit, self.queue)))
        if self.events or self.buf:
            # the commit group's own tick: its consumers are notified at commit, and wait for
            # no ticker (a tick counts its own transaction as committed)
            then.append((q.TICK_NOW, (self.queue,)))
        self.flush(then)
        if self.events:
            pause_point("written-not-committed", events=self.events)
        self.writer.commit()
        if self.skipped:
            log.info("skipped %d transactions captured before (the slot had not been told)", self.skipped)
        if self.last_end > self.committed:
            self.committed = self.stored = self.last_end
        if self.metrics and self.events:
            metrics.CAPTURED.labels(self.queue).inc(self.events)
            if self.last_commit is not None:
                metrics.CAPTURE_LAG.labels(self.queue).set(time.time() - self.last_commit.timestamp())
        if self.events:
            log.debug("captured %d events of %d transactions", self.events, self.txns)
            pause_point("committed-not-advanced", events=self.events)

    # --- messages ---
    def handle(self, data: bytes) -> None:
        kind = data[:1]
        r = Reader(data)
        if kind == b"B":
            final_lsn, ts, _xid = r.unpack(">qqI")
            self.in_txn = True
            self.origin = None
            # ev_time of the transaction's events: its commit time (two-way resolves conflicts by it)
            self.txn_time = (PG_EPOCH + datetime.timedelta(microseconds=ts)).isoformat()
            self.skip = final_lsn < self.stored
            self.skipped += self.skip
        elif kind == b"C":
            _flags, _commit_lsn, end_lsn, ts = r.unpack(">bqqq")
            self.in_txn = False
            if not self.skip:
                self.last_end = end_lsn
                self.last_commit = PG_EPOCH + datetime.timedelta(microseconds=ts)
                self.txns += 1
        elif kind == b"R":
            self.on_relation(r)
        elif kind == b"O":
            r.unpack(">q")  # the origin's commit LSN
            self.origin = logical.peer_of_origin(r.cstring())
        elif self.skip or kind == b"Y":
            return
        elif kind == b"I":
            (relid,) = r.unpack(">I")
            r.byte()  # 'N'
            self.add_row(relid, "I", r.tuple(), len(data))
        elif kind == b"U":
            self.on_update(r, len(data))
        elif kind == b"D":
            (relid,) = r.unpack(">I")
            r.byte()  # 'K' or 'O'
            self.add_row(relid, "D", r.tuple(), len(data))
        elif kind == b"T":
            (nrels,) = r.unpack(">I")
            r.unpack(">b")  # cascade / restart identity: the subscriber truncates its own way
            relids = r.unpack(f">{nrels}I")
            self.flush()
            for relid in relids:
                self.insert_event("R", None, self.rels[relid].canonical, self.origin)
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
        names = [c[1] for c in cols]
        # from the message, not the table: it may have been dropped or changed since (DDL)
        canonical, casts, image = one(
            self.writer,
            "select format('%%I.%%I', %s::text, %s::text),"
            " array(select format_type(t, nullif(m, -1)) from unnest(%s::oid[], %s::int4[]) with ordinality u(t, m, o)"
            "       order by o), pgcascade.json_image_expr('r', %s::text[], %s::oid[])",
            (nsp, name, [c[2] for c in cols], [c[3] for c in cols], names, [c[2] for c in cols]),
        )
        if canonical not in self.keys:  # a table added since: read the keys again
            self.keys = set_tables.set_tables(self.writer, self.queue)
        keys = self.keys.get(canonical)
        key_idx = [names.index(k) for k in keys if k in names] if keys else []
        if not key_idx:
            key_idx = [i for i, c in enumerate(cols) if c[0] & 1]
        if relid in self.rels and self.buf.get(relid):
            self.flush()  # rows buffered under the old definition go out with it
        render = images.renderer(names, [c[2] for c in cols])
        self.rels[relid] = Relation(relid, canonical, names, casts, key_idx, image=image, render=render)

    def on_update(self, r: Reader, size: int) -> None:
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
            self.add_row(relid, "D", old, size)  # the key changed: as the triggers write it
        self.add_row(relid, "U", new, size)  # the row as it is now (sql/capture/90_capture.sql)

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
        # a message a peer's apply wrote (a DDL passed on to the leaves) is tagged as its rows
        # are; not the apply's marker for the peers (peer_batch_done), which they must read
        origin = None if ev.get("untagged") else ev.get("origin") or self.origin
        self.insert_event(
            ev["type"], ev.get("data"), ev.get("extra1"), origin, ev.get("extra3"), ev.get("extra2")
        )

    # --- writing events ---
    def add_row(self, relid: int, op: str, vals: list[Value], size: int) -> None:
        if self.origin != self.buf_origin:
            self.flush()  # rows of one origin per statement
            self.buf_origin = self.origin
        self.buf.setdefault(relid, []).append([op, vals, self.txn_time])
        self.buf_rows += 1
        self.buf_bytes += size  # the message's length: close enough to the JSON's
        if self.buf_rows >= CHUNK_ROWS or self.buf_bytes >= CHUNK_BYTES:
            self.flush()

    def flush(self, then: list[tuple[str, tuple]] | None = None) -> None:
        """Write the buffered rows: one statement per table, each table's rows in order (the
        apply orders a key's events by ev_id; barriers flush first, so they keep their place);
        `then`: statements to send after them, in the same round trip."""
        assert self.writer is not None
        if not self.buf and not then:
            return
        bind = roundtrip.binder(self.writer).mogrify
        statements, counts = [], []
        for relid, rows in self.buf.items():
            statements.append(
                events.rows_statement(self.writer, self.rels[relid], self.queue, rows, self.buf_origin)
            )
            counts.append(len(rows))
        statements += [bind(query, params) for query, params in then or []]
        # one message of the simple query protocol: one round trip for the tables' statements
        # and those after them (psycopg's pipeline mode took several wake-ups)
        cur = self.writer.cursor()
        cur.execute(";\n".join(statements).encode())
        for n in counts:
            if cur.rowcount != n:
                raise RuntimeFailure(f"queue {self.queue} does not exist any more")
            self.events += n
            cur.nextset()  # (none after the last: harmless)
        self.buf.clear()
        self.buf_rows = self.buf_bytes = 0

    def insert_event(
        self,
        ev_type: str,
        data: str | None,
        extra1: str | None,
        origin: str | None = None,
        extra3: str | None = None,
        extra2: str | None = None,
    ) -> None:
        """An event of the stream's own (TRUNCATE, a message), tagged with the master a peer's
        apply made it for (and, for a DDL it passed on, that master's tick)."""
        assert self.writer is not None
        cur = self.writer.execute(
            events.INSERT_EVENT,
            {
                "type": ev_type,
                "data": data,
                "extra1": extra1,
                "extra2": extra2,
                "extra3": extra3,
                "origin": origin,
                "queue": self.queue,
            },
        )
        if cur.rowcount != 1:
            raise RuntimeFailure(f"queue {self.queue} does not exist any more")
        self.events += 1
