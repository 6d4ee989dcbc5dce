"""Throwaway local PostgreSQL clusters for the demo, the benchmarks and the tests.

A cluster is `initdb` into a temporary directory, started with `pg_ctl` on a free loopback
port with `wal_level=logical`. PostgreSQL refuses to run as root, so when we are root the
server runs as the `postgres` OS user and its directory is handed to that user.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from pgcascade.core import pgconn
from pgcascade.core.pgbin import pg_bindir

DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_wal_senders": "10",
    "max_replication_slots": "10",
    "max_connections": "200",
    "listen_addresses": "'127.0.0.1'",
    "shared_buffers": "128MB",
    "log_line_prefix": "'%m [%p] %d '",
    "log_min_messages": "warning",
    "log_checkpoints": "off",
    "max_locks_per_transaction": "256",
    "track_commit_timestamp": "on",  # two-way replication resolves conflicts by commit time
}
FAST_UNSAFE_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@dataclass
class LocalCluster:
    """One PostgreSQL cluster in a directory of its own, reachable on 127.0.0.1:port as `postgres`.

    `address`: another address of this host to listen on as well, trusted from its subnet
    (the tests' Spark workers in network namespaces reach PostgreSQL there); connection
    strings then name it."""

    name: str
    basedir: Path
    port: int = field(default_factory=free_port)
    settings: dict[str, str] = field(default_factory=dict)
    owns_basedir: bool = False  # new_cluster made basedir: destroy removes it once empty
    fast_unsafe: bool = True
    address: str = "127.0.0.1"
    _started: bool = field(default=False, init=False, repr=False)  # a port once served stays

    @property
    def datadir(self) -> Path:
        return self.basedir / self.name

    @property
    def logfile(self) -> Path:
        return self.basedir / f"{self.name}.log"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*_as_server_user(), *args], capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            msg = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(args[0]).name} failed: {msg[-1] if msg else r.returncode}")
        return r

    def init(self) -> LocalCluster:
        self.basedir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            # the server runs as `postgres`: it must own its directory and reach it
            shutil.chown(self.basedir, "postgres", "postgres")
            self.basedir.chmod(0o755)
            for parent in self.basedir.parents:
                if parent.stat().st_uid == 0 and str(parent).startswith(tempfile.gettempdir() + "/"):
                    parent.chmod(parent.stat().st_mode | 0o711)
        self._run(
            str(pg_bindir() / "initdb"),
            "-D",
            str(self.datadir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        )
        conf = dict(DEFAULT_SETTINGS)
        if self.fast_unsafe:
            conf.update(FAST_UNSAFE_SETTINGS)
        conf.update(self.settings)
        conf["port"] = str(self.port)
        conf["unix_socket_directories"] = f"'{self.basedir}'"
        if self.address != "127.0.0.1":
            conf["listen_addresses"] = f"'127.0.0.1,{self.address}'"
            with (self.datadir / "pg_hba.conf").open("a") as f:
                f.write("host all all samenet trust\n")
        with (self.datadir / "postgresql.auto.conf").open("a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        return self

    def start(self) -> LocalCluster:
        for _ in range(5):
            try:
                self._pg_ctl_start()
                self._started = True
                return self
            except RuntimeError:
                # free_port's port was free when chosen, not necessarily now: another process may
                # have bound it since. Before anything could have connected, move to another port.
                if self._started or "Address already in use" not in self.log_tail(10):
                    raise
                self._move_to(free_port())
        raise RuntimeError(f"cluster {self.name}: no free port found in 5 tries")

    def _pg_ctl_start(self) -> None:
        self._run(
            str(pg_bindir() / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.logfile), "-w", "start"
        )

    def _move_to(self, port: int) -> None:
        self.port = port
        with (self.datadir / "postgresql.auto.conf").open("a") as f:
            f.write(f"port = {port}\n")  # the last setting of a key wins

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; mode `immediate` is a crash (no checkpoint), as after a power loss."""
        self._run(str(pg_bindir() / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop", check=False)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def is_running(self) -> bool:
        r = self._run(str(pg_bindir() / "pg_ctl"), "-D", str(self.datadir), "status", check=False)
        return r.returncode == 0

    def connstr(self, dbname: str = "postgres") -> str:
        return f"host={self.address} port={self.port} user=postgres dbname={dbname}"

    def connect(self, dbname: str = "postgres", autocommit: bool = True) -> psycopg.Connection:
        return pgconn.connect(self.connstr(dbname), autocommit=autocommit)

    def create_database(self, dbname: str) -> str:
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        return self.connstr(dbname)

    def drop_database(self, dbname: str) -> None:
        with self.connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "".join(self.logfile.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.logfile.unlink()
        if self.owns_basedir:
            with contextlib.suppress(OSError):  # (only when empty)
                self.basedir.rmdir()


def new_cluster(name: str, basedir: Path | None = None, **kwargs: object) -> LocalCluster:
    """initdb and start a cluster; basedir defaults to a fresh temporary directory."""
    base = basedir or Path(tempfile.mkdtemp(prefix="pgcascade-"))
    cluster = LocalCluster(name=name, basedir=base, owns_basedir=basedir is None, **kwargs)  # type: ignore[arg-type]
    cluster.init().start()
    return cluster


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it is true and return that true value; raise TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
