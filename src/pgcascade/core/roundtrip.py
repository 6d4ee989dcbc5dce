"""The round trips a worker makes at every batch, sent and read by libpq itself.

A worker that keeps up makes two round trips a batch: the fetch from its provider and the
batch's one message to its subscriber (replica/inline.py).  psycopg's cursor does its result
bookkeeping in Python (a result object, the row maker, the loaders looked up again per
result): about 0.2 ms of the worker's 2.1 ms of CPU per batch at 500 tps, the subscriber's
message holding ~14 statements.  Here a statement (or a message of several, with their values
as literals, composed by `compose`) is sent with libpq's own calls, its results taken as
libpq's objects, and only the rows wanted are loaded, by the loaders psycopg would use.  Every
wait for the server is a poll() here, with the GIL released: libpq's own blocking waits hold
it, and froze every other thread of the worker meanwhile (the fetch ahead's thread while the
apply waited for its server, and the other way round).  Errors are psycopg's own exceptions,
built from the failed result, and notifications received meanwhile reach the connection as
after any of its statements.
A leaf's fetch comes back before its commit is done (`send_early`, then `settle`): the
batch is applied meanwhile and committed after it.
"""

from __future__ import annotations

import contextlib
import select
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import abc
from psycopg.adapt import Transformer
from psycopg.pq import ConnStatus, ExecStatus, PipelineStatus
from psycopg.pq.abc import PGconn, PGresult

_BINDERS: weakref.WeakKeyDictionary[psycopg.Connection, psycopg.ClientCursor] = weakref.WeakKeyDictionary()
_ESCAPING: weakref.WeakKeyDictionary[psycopg.Connection, tuple[Callable[[bytes], bytes], str]] = (
    weakref.WeakKeyDictionary()
)
_TRANSFORMERS: weakref.WeakKeyDictionary[psycopg.Connection, abc.Transformer] = weakref.WeakKeyDictionary()


def compose(conn: psycopg.Connection, query: str, values: Sequence[object]) -> bytes:
    """`query` with its %s placeholders replaced by `values` as SQL literals: str, int, bool,
    None and a list of str (text[]) quoted here and by libpq, anything else by psycopg's
    mogrify (whose Python machinery cost ~0.2 ms of a loaded worker's batch for its four
    statements; the fetch's list of sequences: 9 -> 2 us)."""
    escape, encoding = _escaping(conn)
    literals: list[bytes] = []
    for v in values:
        if type(v) is str:  # (most values: the type itself, before isinstance's chain)
            literals.append(escape(v.encode(encoding)))
        elif v is None:
            literals.append(b"NULL")
        elif isinstance(v, bool):
            literals.append(b"true" if v else b"false")
        elif isinstance(v, int):
            literals.append(b"%d" % v)
        elif isinstance(v, str):
            literals.append(escape(v.encode(encoding)))
        elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):  # a text[] (the seqs)
            literals.append(b"ARRAY[" + b", ".join(escape(x.encode(encoding)) for x in v) + b"]")
        else:
            literals.append(binder(conn).mogrify("%s", (v,)).encode(encoding))
    return query.encode() % tuple(literals)


def _escaping(conn: psycopg.Connection) -> tuple[Callable[[bytes], bytes], str]:
    """libpq's literal quoting of `conn` and its client encoding, made once a connection (the
    encoding is never changed on a worker's connections)."""
    known = _ESCAPING.get(conn)
    if known is None:  # (a connection keeps its libpq connection: one per connection, as _BINDERS)
        known = _ESCAPING[conn] = (psycopg.pq.Escaping(conn.pgconn).escape_literal, conn.info.encoding)
    return known


def binder(conn: psycopg.Connection) -> psycopg.ClientCursor:
    """A client-side cursor of `conn` to compose statements with literals (its mogrify): one per
    connection, as making a cursor costs more than composing a small statement."""
    cur = _BINDERS.get(conn)
    if cur is None:
        cur = _BINDERS[conn] = psycopg.ClientCursor(conn)
    return cur


def send(
    conn: psycopg.Connection, message: bytes, meanwhile: Callable[[], None] | None = None
) -> list[PGresult]:
    """Run `message` (statements with literal values, `;`-separated) in one round trip of the
    simple query protocol; a result per statement.  The server stops at the first failure,
    which raises here as psycopg would raise it; the transaction is left as the server left it.
    `meanwhile` is called once the message is sent, while the server runs it."""
    pg = conn.pgconn
    pg.nonblocking = 0  # libpq sends the whole message before it returns
    try:
        pg.send_query(message)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            results = list(iter(lambda: _result(pg), None))
    finally:
        pg.nonblocking = 1
    _forward_notifies(conn)
    _check_alive(conn)
    failed = next((r for r in results if r.status == ExecStatus.FATAL_ERROR), None)
    if failed is not None:
        raise psycopg.errors.error_from_result(failed, encoding=conn.info.encoding)
    return results


def send_early(
    conn: psycopg.Connection, statement: bytes, meanwhile: Callable[[], None] | None = None
) -> PGresult:
    """Run one statement (with literal values) in a transaction of its own and return its result
    as soon as the statement is done - before its commit, whose WAL flush the caller overlaps
    with other work.  One round trip of the extended protocol in libpq's pipeline mode: the
    statement, a flush request (the server sends the result at once) and the sync that
    commits.  `settle` reads the commit's outcome and must come before any other use of the
    connection.  `meanwhile` is called once the message is sent."""
    pg = conn.pgconn
    pg.nonblocking = 0
    pg.enter_pipeline_mode()
    _PENDING.add(conn)
    try:
        pg.send_query_params(statement, None)
        pg.send_flush_request()
        pg.pipeline_sync()
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            result = _result(pg)
            while _result(pg) is not None:  # (the end of the statement's results)
                pass
    except BaseException:
        settle(conn)
        raise
    if result is None or result.status != ExecStatus.TUPLES_OK:
        settle(conn)  # (what is left of the pipeline; a lost connection raises there)
        if result is not None and result.status == ExecStatus.FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        raise psycopg.InterfaceError(f"no result from {statement[:60]!r}")
    return result


def committed(conn: psycopg.Connection) -> bool:
    """Whether send_early's commit is done, read without waiting (settled if it is)."""
    if conn not in _PENDING:
        return True
    pg = conn.pgconn
    pg.consume_input()
    if pg.is_busy():
        return False
    settle(conn)
    return True


def settle(conn: psycopg.Connection) -> None:
    """Wait for send_early's commit and leave pipeline mode; raises if the statement or the
    commit failed (a lost connection among them).  Nothing to do when nothing is pending."""
    if conn not in _PENDING:
        return
    _PENDING.discard(conn)
    pg = conn.pgconn
    failed, ends = None, 0
    try:
        while pg.status == ConnStatus.OK and ends < 2:  # (an end of results, then the sync's)
            r = _result(pg)
            if r is None:
                ends += 1
            elif r.status == ExecStatus.PIPELINE_SYNC:
                break
            elif failed is None and r.status == ExecStatus.FATAL_ERROR:
                failed = r
    finally:
        with contextlib.suppress(psycopg.OperationalError):  # a lost connection: raised below
            pg.exit_pipeline_mode()
        pg.nonblocking = 1
        if pg.status == ConnStatus.OK and pg.pipeline_status != PipelineStatus.OFF:
            # results left unread: a signal cut the wait short (SIGTERM: the daemon exits).  A
            # statement sent now would wait forever for a result the server never sends (no
            # sync follows it): a worker's shutdown hung there finishing its batch
            conn.close()
    if conn.closed:
        raise psycopg.OperationalError("the wait for a commit was cut short: the session is closed")
    _forward_notifies(conn)
    _check_alive(conn)
    if failed is not None:
        raise psycopg.errors.error_from_result(failed, encoding=conn.info.encoding)


# connections whose send_early commit is not read yet
_PENDING: weakref.WeakSet[psycopg.Connection] = weakref.WeakSet()


def load_rows(
    conn: psycopg.Connection,
    result: PGresult,
    make_row: Callable[[Sequence[Any]], Any] = tuple,
) -> list:
    """The rows of one of send()'s results, their values loaded as psycopg loads them, each
    made by `make_row` from its values in column order."""
    tx = _TRANSFORMERS.get(conn)
    if tx is None:  # one per connection, as a cursor keeps its own (loading a row: 5.2 -> 2.8 us)
        tx = _TRANSFORMERS[conn] = Transformer(conn)
    tx.set_pgresult(result)
    return tx.load_rows(0, result.ntuples, make_row)


def column_names(result: PGresult) -> list[str]:
    """The result's column names, for a row maker by name."""
    return [(result.fname(i) or b"").decode() for i in range(result.nfields)]


def relay_copy(src: psycopg.Connection, copy_out: bytes, dst: psycopg.Connection, copy_in: bytes) -> int:
    """Run `copy_out` (COPY ... TO STDOUT) on src and `copy_in` (COPY ... FROM STDIN) on dst
    and move the rows between them with libpq's own calls, in pieces of RELAY_PIECE bytes:
    psycopg's Copy object costs ~0.6 us of Python a row (a 5M-event batch: 3 s of the worker's
    CPU), this ~0.25.  Bytes moved.  A failure on either side raises as psycopg would; dst's
    COPY then ends with an error, so nothing of a partial stream stays in its transaction."""
    source = CopyOut(src, copy_out)
    try:
        moved = source.relay(dst, copy_in)[1]
    finally:
        source.close()
    return moved


class CopyOut:
    """A COPY TO STDOUT of one connection, relayed in parts (relay_copy's way) into COPY FROM
    STDIN statements of any connections: a large batch streams its first part into the apply's
    own stage and the rest, chunk by chunk, through another session (replica/stream.py)."""

    def __init__(self, src: psycopg.Connection, copy_out: bytes):
        self.src = src
        self.ended = False  # every row was read
        self.rows = 0
        _begin_copy(src, copy_out, ExecStatus.COPY_OUT)

    def relay(self, dst: psycopg.Connection, copy_in: bytes, rows: int | None = None) -> tuple[int, int]:
        """Move the next `rows` rows (None: all that are left) into `copy_in` on dst; rows and
        bytes moved.  A failure of the source raises once its COPY is over (close)."""
        dp = dst.pgconn
        _begin_copy(dst, copy_in, ExecStatus.COPY_IN)
        moved, count, buf = 0, 0, bytearray()
        sp = self.src.pgconn
        while rows is None or count < rows:  # a row a message: handed on in pieces
            got = _copy_row(sp)
            if got is None:
                self.ended = True
                break
            buf += got
            count += 1
            if len(buf) >= RELAY_PIECE:
                _put(dp, bytes(buf))
                moved += len(buf)
                buf.clear()
        if buf:
            _put(dp, bytes(buf))
            moved += len(buf)
        failed = _results(self.src) if self.ended else None
        while not dp.put_copy_end(None if failed is None else b"the rows' source failed"):
            _flush(dp)
        _flush(dp)
        in_failed = _results(dst)
        self.rows += count
        if failed is not None:
            raise psycopg.errors.error_from_result(failed, encoding=self.src.info.encoding)
        if in_failed is not None:
            self.close()
            raise psycopg.errors.error_from_result(in_failed, encoding=dst.info.encoding)
        return count, moved

    def close(self) -> None:
        """Read what is left unread (a stream given up), and give the source back."""
        if not self.ended:
            self.ended = True
            _end_copy_out(self.src)


RELAY_PIECE = 1 << 16


def _begin_copy(conn: psycopg.Connection, query: bytes, status: ExecStatus) -> None:
    pg = conn.pgconn
    pg.nonblocking = 0  # the statement sent whole before send_query returns
    try:
        pg.send_query(query)
    finally:
        pg.nonblocking = 1  # (COPY FROM's pieces: each sent by _flush)
    result = _result(pg)
    if result is not None and result.status == status:
        return
    failed = result if result is not None and result.status == ExecStatus.FATAL_ERROR else None
    rest = _results(conn) if result is not None else None
    if failed is None and rest is None:
        raise psycopg.InterfaceError(f"not a COPY: {query[:60]!r}")
    raise psycopg.errors.error_from_result(failed or rest, encoding=conn.info.encoding)  # type: ignore[arg-type]


def _end_copy_out(conn: psycopg.Connection) -> PGresult | None:
    """Read what is left of a COPY TO STDOUT (after a failure on the other side); its error."""
    while _copy_row(conn.pgconn) is not None:
        pass
    return _results(conn)


def _results(conn: psycopg.Connection) -> PGresult | None:
    """The statement's remaining results; the failed one, if any."""
    pg, failed = conn.pgconn, None
    while (r := _result(pg)) is not None:
        if failed is None and r.status == ExecStatus.FATAL_ERROR:
            failed = r
    _forward_notifies(conn)
    _check_alive(conn)
    return failed


def _result(pg: PGconn) -> PGresult | None:
    """pg.get_result(), the wait for it done here (_wait)."""
    while pg.is_busy():
        _wait(pg, select.POLLIN)
        pg.consume_input()
    return pg.get_result()


def _copy_row(pg: PGconn) -> memoryview | None:
    """The next row of a COPY TO STDOUT; None at its end."""
    while True:
        size, row = pg.get_copy_data(1)
        if size > 0:
            return row
        if size < 0:
            return None
        _wait(pg, select.POLLIN)
        pg.consume_input()


def _put(pg: PGconn, piece: bytes) -> None:
    """Send a piece of a COPY FROM STDIN (its connection nonblocking)."""
    while not pg.put_copy_data(piece):  # (libpq could not make room for it: send what it has)
        _flush(pg)
    _flush(pg)


def _flush(pg: PGconn) -> None:
    """Send what a nonblocking connection holds, reading what the server sends meanwhile (as
    libpq asks)."""
    while pg.flush():
        _wait(pg, select.POLLIN | select.POLLOUT)
        pg.consume_input()


def _wait(pg: PGconn, events: int) -> None:
    """Wait until the connection's socket is ready for `events`, with the GIL released."""
    poller = select.poll()
    poller.register(pg.socket, events)
    poller.poll()


def _forward_notifies(conn: psycopg.Connection) -> None:
    """Notifications received meanwhile, to the connection's backlog, as psycopg does."""
    pg = conn.pgconn
    while (n := pg.notifies()) is not None:
        if pg.notify_handler is not None:
            pg.notify_handler(n)


def _check_alive(conn: psycopg.Connection) -> None:
    if conn.pgconn.status != ConnStatus.OK:
        reason = conn.pgconn.error_message.decode(errors="replace").strip() or "no reason given"
        raise psycopg.OperationalError(f"connection lost: {reason}")
