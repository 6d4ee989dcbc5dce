"""One daemon per node and role, and the heartbeat that shows a daemon that stopped.

A worker and a capture daemon (per queue) and a ticker (per database) each hold a session-level
advisory lock in the node's database for their whole life, on a connection of their own.  The
lock lives in the database, not in a pidfile, so it holds whatever ini, pidfile or host a second
copy is started from; the server releases it when the holding session ends: at once when the
process dies (its socket closes), and within the keepalive timeouts set here when its host
vanishes.  A second daemon is refused at start, in one line naming the first: the row the first
keeps in `pgcascade.daemon` (host, pid, job, config, since when) and its session in
pg_stat_activity.

The same row carries the heartbeat: the time of the daemon's last loop, written at most once a
second on the lock's connection.  `status` reads the rows with pg_locks: a row whose lock nobody
holds is a daemon that stopped (`stopped` set when it exited by itself, null when it was
killed), and its heartbeat says when it was last seen.

Before every round a daemon makes sure it still holds its lock: no round trip when nothing
happened (an idle session's socket becomes readable only when the server ends it), one UPDATE a
second for the heartbeat.  A lost connection is opened again and the lock taken again before
any work; if another daemon took it meanwhile, this one stops.  The processes a daemon launches
(copy processes, a master's peer workers in the same process) work under its lock and take none.

This module is the only one that reads or writes `pgcascade.daemon`.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import select
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from pgcascade.core import pgconn
from pgcascade.core.errors import RuntimeFailure

log = logging.getLogger("pgcascade")

HEARTBEAT_SECONDS = 1.0
DEAD_HOLDER_WAIT = 10.0  # seconds a lock whose holder on this host is gone is waited for
# libpq: find a dead server within seconds, also while a statement waits for its answer
CLIENT_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
# the server: end the session (and release the lock) within ~20 s of the daemon's host vanishing;
# never end it for being idle
SESSION_SETTINGS = (
    "set idle_session_timeout = 0; set tcp_keepalives_idle = 10; set tcp_keepalives_interval = 3;"
    " set tcp_keepalives_count = 3; set tcp_user_timeout = 10000"
)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    # a zombie child of ours still answers kill(0); reap it if it is one
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    # a zombie of another parent (exited, not reaped yet) answers too, but it is not running
    with contextlib.suppress(OSError, IndexError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


class DaemonRole(enum.StrEnum):
    WORKER = "worker"
    CAPTURE = "capture"
    TICKER = "ticker"

    @property
    def lock_class(self) -> int:
        """The first key of the role's advisory lock (the second: hashtext of the queue name)."""
        return LOCK_CLASSES[self]


LOCK_CLASSES = {DaemonRole.WORKER: 0x70676401, DaemonRole.CAPTURE: 0x70676402, DaemonRole.TICKER: 0x70676403}


class AlreadyRunning(RuntimeFailure):
    """Another daemon of the same role holds the lock of this node."""


def scope(role: DaemonRole, queue: str) -> str:
    return "this database" if role is DaemonRole.TICKER else f"set {queue} in this database"


def when(t: datetime | None) -> str:
    return "?" if t is None else t.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def lock_key(role: DaemonRole, queue: str) -> dict[str, Any]:
    return {"role": role.value, "queue": queue, "class": role.lock_class}


# the session holding the lock of (role, queue): pg_locks shows a two-key advisory lock as
# classid, objid (unsigned), objsubid 2
HOLDER = """
    select l.pid, a.application_name, a.client_addr::text, a.backend_start
      from pg_locks l left join pg_stat_activity a on a.pid = l.pid
     where l.locktype = 'advisory' and l.granted and l.objsubid = 2
       and l.database = (select oid from pg_database where datname = current_database())
       and l.classid = %(class)s::int8::oid and l.objid = (hashtext(%(queue)s)::int8 & 4294967295)::oid
"""


def table_exists(conn: psycopg.Connection) -> bool:
    """pgcascade.daemon is there (a schema not upgraded yet has none)."""
    return conn.execute("select to_regclass('pgcascade.daemon') is not null").fetchone() == (True,)


def holder(conn: psycopg.Connection, role: DaemonRole, queue: str) -> str | None:
    """Who holds the lock of (role, queue) here, in words; None when nobody does."""
    session = conn.execute(HOLDER, lock_key(role, queue)).fetchone()
    if session is None:
        return None
    backend, app, addr, backend_start = session
    row = (
        conn.execute(
            "select job_name, host, pid, config, started from pgcascade.daemon"
            " where role = %s and queue_name = %s and backend_pid = %s",
            (role.value, queue, backend),
        ).fetchone()
        if table_exists(conn)
        else None
    )
    if row is not None:
        job, host, pid, config, started = row
        where = f" ({config})" if config else ""
        return f"pid {pid} on {host}, job {job}{where}, since {when(started)}"
    # no row of that session (a schema not upgraded): what the server knows of it
    frm = f" from {addr}" if addr else ""
    return f"session {backend} ({app or 'application_name unknown'}{frm}) since {when(backend_start)}"


class DaemonLock:
    """The lock and heartbeat row of one daemon (role, queue) in one database."""

    def __init__(self, dsn: str, role: DaemonRole, queue: str, job_name: str, config: str | None):
        self.dsn = dsn
        self.role = role
        self.queue = queue
        self.job_name = job_name
        self.config = config
        self.conn: psycopg.Connection | None = None
        self.next_beat = 0.0
        self.held_once = False
        self.has_row = False

    @property
    def key(self) -> dict[str, Any]:
        return lock_key(self.role, self.queue)

    def acquire(self) -> psycopg.Connection:
        """Connect and take the lock; AlreadyRunning (naming the holder) if another daemon has it."""
        self.close()
        conn = pgconn.connect(self.dsn, autocommit=True, connect_timeout=10, **CLIENT_KEEPALIVES)
        try:
            self._take(conn)
        except BaseException:
            conn.close()
            raise
        if self.held_once:
            log.info("%s lock of %s taken again", self.role, scope(self.role, self.queue))
        self.conn = conn
        self.held_once = True
        self.next_beat = time.monotonic() + HEARTBEAT_SECONDS
        return conn

    def _take(self, conn: psycopg.Connection) -> None:
        conn.execute(SESSION_SETTINGS)
        conn.execute(
            "select set_config('application_name', %s, false)",
            (f"pgcascade {self.role} {self.job_name}"[:63],),
        )
        taken = conn.execute(
            "select pg_try_advisory_lock(%(class)s, hashtext(%(queue)s))", self.key
        ).fetchone()
        if not (taken and taken[0]):
            who = holder(conn, self.role, self.queue) or "a session that ended just now"
            again = " took over" if self.held_once else " runs already"
            raise AlreadyRunning(f"a {self.role} for {scope(self.role, self.queue)}{again}: {who}")
        self.has_row = conn.execute("select to_regclass('pgcascade.daemon') is not null").fetchone() == (
            True,
        )
        if not self.has_row:  # a schema not upgraded yet: the lock holds, status cannot show it
            log.warning("pgcascade.daemon is missing: run `pgcascade CONFIG install` to upgrade the schema")
            return
        conn.execute(
            "insert into pgcascade.daemon (role, queue_name, job_name, host, pid, config, backend_pid,"
            " started, heartbeat) values (%(role)s, %(queue)s, %(job)s, %(host)s, %(pid)s, %(config)s,"
            " pg_backend_pid(), now(), now())"
            " on conflict (role, queue_name) do update set job_name = excluded.job_name,"
            " host = excluded.host, pid = excluded.pid, config = excluded.config,"
            " backend_pid = excluded.backend_pid, started = excluded.started,"
            " heartbeat = excluded.heartbeat, stopped = null",
            {
                **self.key,
                "job": self.job_name,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "config": self.config,
            },
        )

    def _try_lock(self, conn: psycopg.Connection) -> bool:
        """Take the lock; a holder that was a process of this host that is gone (killed a moment
        ago, its session not ended yet) is waited for, a few seconds at most."""
        deadline = time.monotonic() + DEAD_HOLDER_WAIT
        while True:
            row = conn.execute(
                "select pg_try_advisory_lock(%(class)s, hashtext(%(queue)s))", self.key
            ).fetchone()
            if row and row[0]:
                return True
            if time.monotonic() > deadline or not self._holder_is_gone(conn):
                return False
            time.sleep(0.1)

    def _holder_is_gone(self, conn: psycopg.Connection) -> bool:
        if not table_exists(conn):
            return False
        row = conn.execute(
            "select host, pid from pgcascade.daemon where role = %(role)s and queue_name = %(queue)s",
            self.key,
        ).fetchone()
        return (
            row is not None
            and row[0] == socket.gethostname()
            and row[1] != os.getpid()
            and not pid_alive(row[1])
        )

    def keep(self) -> psycopg.Connection:
        """Before a round: the lock is held (taken again after a lost connection) and the
        heartbeat at most a second old.  AlreadyRunning if another daemon took the lock."""
        if self.conn is None or self.conn.closed:
            return self.acquire()
        if time.monotonic() < self.next_beat and not self._socket_readable():
            return self.conn
        try:
            self.beat()
        except psycopg.OperationalError as e:
            log.warning("the session holding the %s lock ended (%s): taking it again", self.role, e)
            return self.acquire()
        return self.conn

    def beat(self) -> None:
        """The heartbeat (the daemon's last loop); also proves the session still holds the lock."""
        assert self.conn is not None
        if self.has_row:
            self.conn.execute(
                "update pgcascade.daemon set heartbeat = now() where role = %(role)s and queue_name = %(queue)s",
                self.key,
            )
        else:
            self.conn.execute("select 1")
        self.next_beat = time.monotonic() + HEARTBEAT_SECONDS

    def _socket_readable(self) -> bool:
        """Something came on the idle connection: the server ending the session (or a notice)."""
        assert self.conn is not None
        try:
            ready, _, _ = select.select([self.conn.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(ready)

    def release(self) -> None:
        """A daemon that exits by itself says so (status: stopped, not killed), then lets go."""
        if self.conn is not None and not self.conn.closed and self.has_row:
            with contextlib.suppress(psycopg.Error):
                self.conn.execute(
                    "update pgcascade.daemon set heartbeat = now(), stopped = now()"
                    " where role = %(role)s and queue_name = %(queue)s and backend_pid = pg_backend_pid()",
                    self.key,
                )
        self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None


@dataclass(frozen=True)
class DaemonState:
    """A daemon as `status` sees it: running (its lock held) or when it was last seen."""

    role: DaemonRole
    queue: str
    running: bool
    job_name: str | None = None
    host: str | None = None
    pid: int | None = None
    started: datetime | None = None
    heartbeat: datetime | None = None  # its last loop
    since_heartbeat: timedelta | None = None
    stopped: datetime | None = None  # it exited by itself then (None: killed, or running)

    @property
    def seen(self) -> bool:
        """Whether this daemon ever ran here (since the upgrade that brought daemon rows)."""
        return self.job_name is not None


def daemon_state(conn: psycopg.Connection, role: DaemonRole, queue: str) -> DaemonState:
    """The state of the daemon (role, queue) of this database."""
    found = conn.execute(f"select exists ({HOLDER})", lock_key(role, queue)).fetchone()
    running = bool(found and found[0])
    row = (
        conn.execute(
            "select job_name, host, pid, started, heartbeat, now() - heartbeat, stopped from pgcascade.daemon"
            " where role = %s and queue_name = %s",
            (role.value, queue),
        ).fetchone()
        if table_exists(conn)
        else None
    )
    return DaemonState(role, queue, running) if row is None else DaemonState(role, queue, running, *row)
