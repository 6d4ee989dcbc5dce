"""Fixtures of the db and scenario tiers: real PostgreSQL clusters, a fresh database per
test, the CLI and daemons as processes.  (tests/unit uses none of them: it runs with no
PostgreSQL installed.)  Every test under tests/scenario is marked `slow`.

Clusters are started once per session (on first use) and shared; each test gets databases of
its own.  A test that restarts or crashes a server asks for `private_cluster` instead.  When a
test fails, the tail of each server log it used is printed.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pgcascade.cli.main import main as cli_main
from pgcascade.core import schema
from pgcascade.dev.localcluster import LocalCluster, new_cluster

PGCASCADE = [sys.executable, "-m", "pgcascade"]

# Spark settings every config the tests write carries (spark.* keys reach Spark unchanged; the
# other verbs ignore them): the tests' Spark jobs are small and each starts a JVM - a driver, and
# on the test cluster an executor - so a JIT that stops at C1 and the serial collector halve the
# CPU a start costs on 2 cores (measured: ~36 s -> ~20 s of CPU per local[2] session and first job)
SPARK_TEST_CONF = {
    f"spark.{role}.defaultJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    for role in ("driver", "executor")
}


# seconds each module's tests took in the last measured full run (session 48: two workers, a
# slow hour, load 4-7; the Spark modules' fixtures added); a module not listed counts as
# MODULE_SECONDS_DEFAULT.  Only the order of the modules depends on them (see below).
MODULE_SECONDS = {
    "test_cascade.py": 410,
    "test_spark_cluster.py": 362,
    "test_replication.py": 274,
    "test_pipeline_compare.py": 270,
    "test_two_way.py": 192,
    "test_walcapture.py": 137,
    "test_spark_classes.py": 137,
    "test_replication_cli.py": 131,
    "test_faults.py": 109,
    "test_between_ticks.py": 106,
    "test_cli.py": 99,
    "test_replication_types.py": 93,
    "test_pipeline_copy.py": 92,
    "test_staged_apply.py": 85,
    "test_serve.py": 76,
    "test_pipeline_sink.py": 76,
    "test_ticker_daemon.py": 52,
    "test_londiste_import.py": 50,
    "test_auto_ddl.py": 47,
    "test_packaging.py": 46,
    "test_demo.py": 44,
    "test_daemons.py": 44,
    "test_partitions.py": 37,
    "test_filters.py": 36,
    "test_monitoring.py": 34,
    "test_delay.py": 32,
    "test_stream.py": 31,
    "test_fetch_ahead.py": 31,
    "test_capture_update.py": 30,
    "test_queue.py": 26,
    "test_auto_ddl_checks.py": 26,
    "test_privileges.py": 25,
    "test_setup_atomic.py": 23,
    "test_two_way_logical.py": 21,
    "test_least_privilege.py": 21,
    "test_paced_batches.py": 20,
    "test_doorbell.py": 20,
    "test_two_way_durability.py": 19,
    "test_two_way_unjudged.py": 12,
    "test_plans.py": 12,
    "test_leaf_commits_after_root.py": 10,
    "test_two_way_commits_after_peer.py": 8,
    "test_copystream.py": 8,
    "test_pgq_compat.py": 7,
    "test_localcluster.py": 5,
    "test_early_commit.py": 5,
    "test_one_kind.py": 3,
    "test_two_way_truncate.py": 1,
}
MODULE_SECONDS_DEFAULT = 30


def module_seconds(item: pytest.Item) -> float:
    if "unit" in item.path.parts:
        return 0
    return MODULE_SECONDS.get(item.path.name, MODULE_SECONDS_DEFAULT)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the scenario tier slow; run the longest modules first (a module's tests keep their
    order): test.sh hands modules to the two xdist workers in this order (--no-loadscope-reorder),
    so the last ones are short and both workers end together."""
    for item in items:
        if "scenario" in item.path.parts:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -module_seconds(item))  # stable: within a module, as written


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With PGCASCADE_TEST_LOG=FILE, append each test's outcome and time as it ends (a run cut
    short, or one spread over xdist workers, still says which test failed and what took long)."""
    path = os.environ.get("PGCASCADE_TEST_LOG")
    if path and not os.environ.get("PYTEST_XDIST_WORKER") and (report.when == "call" or report.failed):
        with open(path, "a") as f:
            f.write(f"{report.outcome} {report.when} {report.duration:.1f}s {report.nodeid}\n")


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
            release_slots(d)
            d.cluster.drop_database(d.name)


def release_slots(db: Database, timeout: float = 10.0) -> None:
    """End the walsenders reading the database's replication slots (a capture daemon just
    killed leaves one for a moment): DROP DATABASE drops the slots, but not active ones."""
    with db.cluster.connect() as conn:
        conn.execute(
            "select pg_terminate_backend(active_pid) from pg_replication_slots where database = %s and active",
            (db.name,),
        )
        deadline = time.monotonic() + timeout
        while (
            time.monotonic() < deadline
            and conn.execute(
                "select count(*) from pg_replication_slots where database = %s and active", (db.name,)
            ).fetchone()[0]
        ):
            time.sleep(0.05)


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


def run_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`pgcascade ARGS` in this process, with its exit code and outputs: for commands a test
    runs many of (a process each costs seconds of start-up on a loaded machine); daemons and
    the commands a scenario is about stay processes (run_cli)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main([str(a) for a in args])
        except SystemExit as e:
            code = int(e.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_ok(ini: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    """run_in_process, checked to exit 0: the set-up steps and waits a test is not about (a
    process each costs a second of CPU); what a test is about runs as a process (run_cli)."""
    r = run_in_process(str(ini), *args)
    assert r.returncode == 0, f"pgcascade {ini} {' '.join(args)}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def write_config(tmp_path: Path):
    """write_config(name, **keys) -> path of an ini with a [pgcascade] section; logfile/pidfile in tmp_path."""

    def write(job_name: str, **keys: object) -> Path:
        keys.setdefault("logfile", str(tmp_path / "%(job_name)s.log"))
        keys.setdefault("pidfile", str(tmp_path / "%(job_name)s.pid"))
        keys = {**SPARK_TEST_CONF, **keys}
        lines = ["[pgcascade]", f"job_name = {job_name}", *(f"{k} = {v}" for k, v in keys.items())]
        path = tmp_path / f"{job_name}.ini"
        path.write_text("\n".join(lines) + "\n")
        return path

    return write


def kill_processes_mentioning(marker: str) -> None:
    """SIGKILL our own processes whose command line contains `marker` (a test's unique temp
    path): the copy processes a SIGKILLed worker leaves behind."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and "pgcascade" in cmdline:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


class Daemons:
    """Daemons started by a test; whatever is still running at the end is killed by pid, with
    the processes it started (a worker's copy processes): each daemon leads a process group of
    its own."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.outputs: list[Path] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `pgcascade ARGS`; its output goes to a file (an unread pipe would block a
        chatty daemon), read back with `p.output()`."""
        fd, name = tempfile.mkstemp(prefix="pgcascade-daemon-", suffix=".out")
        path = Path(name)
        with os.fdopen(fd, "wb") as out:
            p = subprocess.Popen(
                [*PGCASCADE, *map(str, args)],
                env={**os.environ, **env} if env else None,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        p.output = lambda: path.read_text(errors="replace")  # type: ignore[attr-defined]
        self.procs.append(p)
        self.outputs.append(path)
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
            # a copy process its worker left when a test killed the worker outlives it
            # (as it should: the next worker finds it at work); the test is over now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for f in self.outputs:
            with contextlib.suppress(OSError):
                f.unlink()
        self.outputs.clear()


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    yield d
    d.close()


# --- a root and a leaf, with the CLI and daemons -------------------------------------------------


# the same text for the same value on every server, whatever its defaults (set by the tests, not
# taken from pgcascade)
TEXT_SETTINGS = (
    "set datestyle = 'ISO, YMD'; set intervalstyle = postgres; set timezone = 'UTC';"
    " set extra_float_digits = 3; set bytea_output = hex"
)


def table_checksum(db: Database, table: str) -> tuple[int, str | None]:
    """(rows, md5 of every row's text in key order): computed by PostgreSQL, not by pgcascade."""
    return query_checksum(db, f"select * from {table} t")  # t: a subquery needs an alias


def query_checksum(db: Database, query: str) -> tuple[int, str | None]:
    """table_checksum of the rows a query returns (say, the root's rows a filter passes)."""
    with db.connect() as conn:
        conn.execute(TEXT_SETTINGS)
        return conn.execute(
            f"select count(*), md5(string_agg(t::text, E'\\n' order by t::text)) from ({query}) t"
        ).fetchone()


@dataclass
class ReplicaSet:
    root: Database
    leaf: Database
    tmp: Path
    daemons: Daemons
    queue: str = "rep"

    def ini(self, name: str, db: Database, **extra: object) -> Path:
        path = self.tmp / f"{name}.ini"
        lines = [
            "[pgcascade]",
            f"job_name = {name}",
            f"db = {db.connstr}",
            f"queue_name = {self.queue}",
            f"logfile = {self.tmp}/{name}.log",
            f"pidfile = {self.tmp}/{name}.pid",
            *(f"{k} = {v}" for k, v in {**SPARK_TEST_CONF, **extra}.items()),
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    @property
    def root_ini(self) -> Path:
        return self.tmp / "root.ini"

    @property
    def leaf_ini(self) -> Path:
        return self.tmp / "leaf.ini"

    def cli(
        self, node: str, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        r = run_cli(str(self.tmp / f"{node}.ini"), *args, timeout=timeout)
        if check:
            assert r.returncode == 0, (
                f"pgcascade {node} {' '.join(args)}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
            )
        return r

    def run(self, node: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`pgcascade NODE.ini ARGS` in this process (run_ok): set-up, not what a test is about."""
        return run_ok(self.tmp / f"{node}.ini", *args)

    def setup(self, tables: list[str] | None = None, leaf_args: tuple[str, ...] = ("--create",)) -> None:
        self.run("root", "create-root", "root")
        self.run("leaf", "create-leaf", "leaf1", "--provider", self.root.connstr)
        if tables:
            self.run("root", "add-table", *tables)
            self.run("leaf", "add-table", *tables, *leaf_args)

    def set_up_stopped(self, ddl: tuple[str, ...], tables: tuple[str, ...], **leaf: object) -> None:
        """`ddl` run on both sides, `tables` replicated (the leaf's ini with `leaf` too), the set's
        own events applied, then the worker stopped: what is written next is a backlog."""
        for db in (self.root, self.leaf):
            with db.connect() as conn:
                for statement in ddl:
                    conn.execute(statement)
        self.ini("leaf", self.leaf, parallel_copies=2, **leaf)
        self.setup(list(tables), leaf_args=("--expect-sync",))
        worker = self.start_worker()
        self.wait_sync()
        self.daemons.kill(worker, signal.SIGTERM)
        worker.wait(30)

    def start_ticker(self) -> subprocess.Popen:
        ini = self.tmp / "ticker.ini"
        ini.write_text(
            f"[pgcascade]\njob_name = ticker\ndb = {self.root.connstr}\nlogfile = {self.tmp}/ticker.log\n"
            f"pidfile = {self.tmp}/ticker.pid\nmaint_period = 1\n"
        )
        return self.daemons.start("ticker", str(ini))

    def start_worker(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.daemons.start(str(self.leaf_ini), "worker", env=env)

    def wait_sync(self, timeout: float = 120) -> None:
        self.run("leaf", "wait-sync", "--timeout", str(timeout))

    def assert_equal(self, *tables: str) -> None:
        for t in tables:
            assert table_checksum(self.root, t) == table_checksum(self.leaf, t), f"{t} differs"

    def log(self, name: str = "leaf") -> str:
        p = self.tmp / f"{name}.log"
        return p.read_text() if p.exists() else ""


@pytest.fixture
def replica(
    make_db, tmp_path: Path, daemons: Daemons, request: pytest.FixtureRequest
) -> Iterator[ReplicaSet]:
    """A root database on cluster a and a leaf database on cluster b, with their configs."""
    rs = ReplicaSet(make_db("a"), make_db("b"), tmp_path, daemons)
    rs.ini("root", rs.root)
    rs.ini("leaf", rs.leaf, parallel_copies=2)
    yield rs
    daemons.close()
    kill_processes_mentioning(str(tmp_path))
    if _failed(request):
        for name in ("leaf", "ticker"):
            print(f"\n----- {name}.log -----\n{rs.log(name)[-6000:]}")


def drop_roles(dbs: list[Database], *roles: str) -> None:
    """Drop roles a test made on the clusters of `dbs`, with what they own there (the databases
    go back to postgres, which make_db drops) and their grants."""
    names = ", ".join(f'"{r}"' for r in roles)
    for db in dbs:
        with contextlib.suppress(psycopg.Error), db.connect() as conn:
            conn.execute(f'alter database "{db.name}" owner to postgres')
            conn.execute(f"reassign owned by {names} to postgres")
            conn.execute(f"drop owned by {names}")
    for c in {id(db.cluster): db.cluster for db in dbs}.values():
        with contextlib.suppress(psycopg.Error), c.connect() as conn:
            conn.execute(f"revoke set on parameter session_replication_role from {names}")
            conn.execute(f"drop role if exists {names}")


# connection strings that hold a secret (the password, an SSL key's): pgcascade stores none of it
# (pgconn.without_secrets; the upgrade's SQL in migration 12 for what earlier releases stored)
SECRET_DSNS = [
    "host=h port=5432 password=s3cret dbname=x",
    "password = 's3 \\'cret' host=h user=u",
    "host=h sslpassword=k3y user=u password=s3cret",
    "postgresql://u:s3cret@h:5433/db?sslmode=require",
    "postgres://u@h/db?password=s3cret&application_name=a",
    "postgresql://u:s3cret@h/db?sslpassword=k3y",
]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics of a daemon: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, f"{name} {labels}: {matches}"
    return matches[0]
