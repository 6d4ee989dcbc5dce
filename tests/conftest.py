"""Fixtures: real PostgreSQL clusters, a fresh database per test, the CLI and daemons as processes.

Clusters are started once per session (on first use) and shared; each test gets databases of
its own.  A test that restarts or crashes a server asks for `private_cluster` instead.  When a
test fails, the tail of each server log it used is printed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from pgcascade import schema
from pgcascade.localcluster import LocalCluster, new_cluster

PGCASCADE = [sys.executable, "-m", "pgcascade"]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(request.node, f"rep_{w}", None) is not None and getattr(request.node, f"rep_{w}").failed
        for w in ("setup", "call")
    )


class ClusterPool:
    """Session-wide clusters, started on first use."""

    def __init__(self, base: Path):
        self.base = base
        self.clusters: dict[str, LocalCluster] = {}

    def get(self, name: str) -> LocalCluster:
        if name not in self.clusters:
            self.clusters[name] = new_cluster(name, basedir=self.base)
        return self.clusters[name]

    def close(self) -> None:
        for c in self.clusters.values():
            c.destroy()


@pytest.fixture(scope="session")
def session_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="pgcascade-tests-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def pool(session_dir: Path) -> Iterator[ClusterPool]:
    p = ClusterPool(session_dir / "clusters")
    yield p
    p.close()


@dataclass
class Database:
    cluster: LocalCluster
    name: str

    @property
    def connstr(self) -> str:
        return self.cluster.connstr(self.name)

    def connect(self, autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(self.connstr, autocommit=autocommit)

    def scalar(self, query: str, params: tuple | None = None):
        with self.connect() as conn:
            row = conn.execute(query, params).fetchone()
            return row[0] if row else None

    def install(self) -> Database:
        with self.connect() as conn:
            schema.install(conn)
        return self


@pytest.fixture
def make_db(pool: ClusterPool, request: pytest.FixtureRequest) -> Iterator:
    """make_db(cluster="a") -> a new empty database on that session cluster."""
    made: list[Database] = []

    def make(cluster: str = "a", installed: bool = False) -> Database:
        c = pool.get(cluster)
        name = f"t_{uuid.uuid4().hex[:12]}"
        c.create_database(name)
        db = Database(c, name)
        made.append(db)
        return db.install() if installed else db

    yield make
    if _failed(request):
        for c in {id(d.cluster): d.cluster for d in made}.values():
            print(f"\n----- server log of cluster {c.name} (port {c.port}) -----\n{c.log_tail()}")
    for d in made:
        with contextlib.suppress(psycopg.Error):
            d.cluster.drop_database(d.name)


@pytest.fixture
def db(make_db) -> Database:
    """A fresh database with pgcascade installed."""
    return make_db(installed=True)


@pytest.fixture
def private_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A cluster of the test's own, for tests that stop, crash or restart the server."""
    base = Path(tempfile.mkdtemp(prefix="pgcascade-private-"))
    c = new_cluster("private", basedir=base)
    yield c
    if _failed(request):
        print(f"\n----- server log of private cluster (port {c.port}) -----\n{c.log_tail()}")
    c.destroy()
    shutil.rmtree(base, ignore_errors=True)


# --- the CLI and daemons as processes ------------------------------------------------------------


def run_cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PGCASCADE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def write_config(tmp_path: Path):
    """write_config(name, **keys) -> path of an ini with a [pgcascade] section; logfile/pidfile in tmp_path."""

    def write(job_name: str, **keys: object) -> Path:
        keys.setdefault("logfile", str(tmp_path / "%(job_name)s.log"))
        keys.setdefault("pidfile", str(tmp_path / "%(job_name)s.pid"))
        lines = ["[pgcascade]", f"job_name = {job_name}", *(f"{k} = {v}" for k, v in keys.items())]
        path = tmp_path / f"{job_name}.ini"
        path.write_text("\n".join(lines) + "\n")
        return path

    return write


class Daemons:
    """Daemons started by a test; whatever is still running at the end is killed by pid."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [*PGCASCADE, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.procs.append(p)
        return p

    @staticmethod
    def kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        if p.poll() is None:
            os.kill(p.pid, sig)
        p.wait(timeout=30)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    yield d
    d.close()
