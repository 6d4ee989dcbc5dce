"""pgoutput, protocol version 1, read through the streaming replication protocol.

`SlotStream` is one decoding session on a replication connection (START_REPLICATION ...
LOGICAL): psycopg 3 has no replication API, so the COPY BOTH stream is read and written with
libpq's copy calls through psycopg's `pq` layer.  `Reader` walks one pgoutput message; its
`tuple()` is the hot path (every row of every change).  Nothing here touches the queue: the
capture daemon (daemon.py) decides what becomes an event.
"""

from __future__ import annotations

import datetime
import select
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgcascade.core import pgconn
from pgcascade.core.errors import RuntimeFailure

PG_EPOCH = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)


class Unchanged:
    """pgoutput's 'u': a TOASTed value the UPDATE did not change, not sent."""


UNCHANGED = Unchanged()
Value = str | None | Unchanged


def lsn_int(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def lsn_str(v: int) -> str:
    return f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"


@dataclass
class Relation:
    relid: int
    canonical: str
    names: list[str]
    casts: list[str]  # format_type() of each column
    key_idx: list[int]
    insert_sql: bytes | None = field(default=None, repr=False)
    image: str = field(
        default="row_to_json(r.*)::text", repr=False
    )  # of a row `r` of it, as capture writes it
    # the image written by the daemon (capture/images.py), where its columns' types allow
    render: Callable[[list[Value]], str | None] | None = field(default=None, repr=False)
    images_sql: bytes | None = field(default=None, repr=False)


U16 = struct.Struct(">H")
U32 = struct.Struct(">I")


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
        """A TupleData: the hot path (every row of every change), so plain locals."""
        d = self.d
        p = self.p
        (n,) = U16.unpack_from(d, p)
        p += 2
        vals: list[Value] = []
        append = vals.append
        for _ in range(n):
            kind = d[p]
            p += 1
            if kind == 0x74:  # 't': Int32 length, text
                (length,) = U32.unpack_from(d, p)
                p += 4
                append(d[p : p + length].decode())
                p += length
            elif kind == 0x6E:  # 'n'
                append(None)
            elif kind == 0x75:  # 'u'
                append(UNCHANGED)
            else:
                raise RuntimeFailure(f"pgoutput: unexpected tuple value kind {chr(kind)!r}")
        self.p = p
        return vals


class SlotStream:
    """The slot's changes through the streaming replication protocol (START_REPLICATION on a
    replication connection): one decoding session for the daemon's life.  psycopg 3 has no
    replication API, so the COPY BOTH stream is read and written with libpq's copy calls
    through psycopg's `pq` layer; the connection serves nothing else."""

    def __init__(self, connstr: str, slot: str, pub: str, start: int):
        self.conn = psycopg.connect(
            make_conninfo("", **pgconn.with_network_params(conninfo_to_dict(connstr))),  # a dead link fails
            autocommit=True,
            connect_timeout=10,
            replication="database",
            application_name="pgcascade capture reader",
            # pgoutput writes values with the walsender's settings: those of the triggers
            options="-c datestyle=ISO,MDY -c intervalstyle=postgres -c extra_float_digits=3 -c bytea_output=hex",
        )
        self.pg = self.conn.pgconn
        # the names are ours ([a-z0-9_]): no quoting beyond the delimiters is needed
        query = (
            f'START_REPLICATION SLOT "{slot}" LOGICAL {lsn_str(start)}'
            f" (proto_version '1', publication_names '\"{pub}\"', messages 'true')"
        )
        self.pg.send_query(query.encode())
        res = self.pg.get_result()
        if res is None or res.status != pq.ExecStatus.COPY_BOTH:
            msg = (res.error_message if res is not None else self.pg.error_message).decode(errors="replace")
            self.close()
            raise RuntimeFailure(f"cannot read slot {slot}: {' '.join(msg.split())}")

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def close(self) -> None:
        if not self.conn.closed:
            self.conn.close()

    def wait(self, timeout: float) -> None:
        select.select([self.pg.socket], [], [], timeout)

    def read(self, timeout: float) -> tuple | None:
        """("w", pgoutput message) or ("k", server's sent position, reply wanted); None when
        nothing came within `timeout` seconds."""
        deadline = 0.0
        consumed = False
        while True:
            n, data = self.pg.get_copy_data(1)
            if n > 0:
                kind = data[0]
                if kind == 0x77:  # 'w' XLogData: start, end, time, then the message
                    return ("w", bytes(data[25:]))
                if kind == 0x6B:  # 'k' keepalive
                    wal_end, _ts, reply = struct.unpack_from(">qqb", data, 1)
                    return ("k", wal_end, reply)
                continue
            if n == 0:  # nothing buffered: read what reached the socket, then wait
                if not consumed:
                    self.pg.consume_input()
                    consumed = True
                    deadline = time.monotonic() + timeout
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.wait(left)
                self.pg.consume_input()
                continue
            res = self.pg.get_result()
            msg = (res.error_message if res is not None else self.pg.error_message).decode(errors="replace")
            self.close()
            raise psycopg.OperationalError(f"replication stream ended: {' '.join(msg.split())}")

    def feedback(self, flush: int, reply: bool = False) -> None:
        """Standby status update: everything before `flush` is in the queue (written, flushed,
        applied alike); the slot's confirmed position moves there."""
        now = int((time.time() - PG_EPOCH.timestamp()) * 1e6)
        self.pg.put_copy_data(b"r" + struct.pack(">qqqqb", flush, flush, flush, now, 1 if reply else 0))
        self.pg.flush()
