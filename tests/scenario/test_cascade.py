"""Cascades: root, branches and leaves with pgbench writing; failover, switchover, moving
subscribers, watermarks.  Daemons and the CLI run as processes; nodes that are lost live on
clusters of their own, stopped with `pg_ctl -m immediate`.  Every test ends by comparing an md5
of every row (computed by PostgreSQL) between each surviving node and the root, and proves with
an ENABLE ALWAYS audit trigger that no history row was applied twice.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from conftest import Daemons, kill_processes_mentioning, run_cli, run_ok, table_checksum
from test_replication import PGBENCH_TABLES, add_apply_audit, pgbench, pgbench_init

from pgcascade.dev.localcluster import LocalCluster, new_cluster, pg_bindir, wait_until

QUEUE = "cas"


@dataclass
class PrivateDb:
    """A database on a cluster of its own, which the test may crash."""

    cluster: LocalCluster
    name: str = "postgres"

    @property
    def connstr(self) -> str:
        return self.cluster.connstr(self.name)

    def connect(self, autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(self.connstr, autocommit=autocommit)


@dataclass
class Cascade:
    tmp: Path
    daemons: Daemons
    dbs: dict[str, object] = field(default_factory=dict)
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    tickers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def ini(self, name: str) -> Path:
        return self.tmp / f"{name}.ini"

    def node(self, name: str, db, queue_name: str = QUEUE, **extra: object) -> None:
        self.dbs[name] = db
        lines = [
            "[pgcascade]",
            f"job_name = {name}",
            f"db = {db.connstr}",
            f"queue_name = {queue_name}",
            f"logfile = {self.tmp}/{name}.log",
            f"pidfile = {self.tmp}/{name}.pid",
            "loop_delay = 0.2",
            "watermark_period = 0.2",
            *(f"{k} = {v}" for k, v in extra.items()),
        ]
        self.ini(name).write_text("\n".join(lines) + "\n")
        tick = self.tmp / f"ticker-{name}.ini"
        tick.write_text(
            f"[pgcascade]\njob_name = ticker-{name}\ndb = {db.connstr}\nlogfile = {self.tmp}/ticker-{name}.log\n"
            f"pidfile = {self.tmp}/ticker-{name}.pid\nmaint_period = 0.5\nticker_period = 0.05\n"
        )

    def cli(self, name: str, *args: str, check: bool = True, timeout: float = 180):
        r = run_cli(str(self.ini(name)), *args, timeout=timeout)
        if check:
            assert r.returncode == 0, (
                f"pgcascade {name} {' '.join(args)}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
            )
        return r

    def run(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`pgcascade NAME.ini ARGS` in this process (run_ok): set-up, not what a test is about."""
        return run_ok(self.ini(name), *args)

    def create(self, name: str, kind: str, provider: str | None = None) -> None:
        if kind == "root":
            self.run(name, "create-root", name)
        else:
            self.run(name, f"create-{kind}", name, "--provider", self.dbs[provider].connstr)

    def pgbench_root(self, name: str) -> None:
        """The root `name` with the pgbench tables (scale 1) in its set."""
        pgbench_init(self.dbs[name])
        self.create(name, "root")
        self.run(name, "add-table", *PGBENCH_TABLES)

    def start_ticker(self, name: str) -> None:
        self.tickers[name] = self.daemons.start("ticker", str(self.tmp / f"ticker-{name}.ini"))

    def start_worker(self, name: str) -> subprocess.Popen:
        self.workers[name] = self.daemons.start(str(self.ini(name)), "worker")
        return self.workers[name]

    def kill_worker(self, name: str) -> None:
        self.daemons.kill(self.workers[name])

    def start_all(self, *names: str) -> None:
        for n in names:
            self.start_ticker(n)
            self.start_worker(n)

    def scalar(self, name: str, query: str, params: tuple = ()):
        with self.dbs[name].connect() as c:
            return c.execute(query, params).fetchone()[0]

    def last_tick(self, name: str) -> int:
        return self.scalar(name, "select last_tick from pgcascade.node where queue_name = %s", (QUEUE,)) or 0

    def newest_tick(self, name: str) -> int:
        return self.scalar(name, "select last_tick_id from pgcascade.get_queue_info(%s)", (QUEUE,))

    def tick_now(self, root: str) -> int:
        return self.scalar(root, "select pgcascade.ticker(%s)", (QUEUE,))

    def copying(self, name: str) -> int:
        return self.scalar(
            name,
            "select count(*) from pgcascade.subscriber_table where queue_name = %s and state is distinct from 'ok'",
            (QUEUE,),
        )

    def wait_applied(self, names: list[str], tick: int, timeout: float = 120) -> None:
        """Each node has every table ok and applied `tick`."""
        for n in names:
            wait_until(
                lambda n=n: self.copying(n) == 0 and self.last_tick(n) >= tick,
                timeout,
                what=f"{n} to hold every table and apply tick {tick}",
            )

    def sync(self, root: str, names: list[str], timeout: float = 120) -> None:
        """Every named node applied everything committed on the root before now."""
        self.wait_applied(names, self.tick_now(root), timeout)

    def assert_equal(self, a: str, b: str, tables=PGBENCH_TABLES) -> None:
        for t in tables:
            assert table_checksum(self.dbs[a], t) == table_checksum(self.dbs[b], t), (
                f"{t}: {a} and {b} differ"
            )

    def log(self, name: str) -> str:
        p = self.tmp / f"{name}.log"
        return p.read_text() if p.exists() else ""


def assert_history_applied_once(db) -> None:
    with db.connect() as conn:
        rows, distinct, updates = conn.execute(
            "select count(*), count(distinct hid), count(*) filter (where op <> 'INSERT') from history_audit"
        ).fetchone()
        history = conn.execute("select count(*) from pgbench_history").fetchone()[0]
    assert updates == 0 and rows == distinct == history, (rows, distinct, updates, history)


def copy_schema(src, dst) -> None:
    """The pgbench tables on dst exactly as on src, defaults and sequences included, no rows:
    what a user loads on a node that may become the root."""
    dump = subprocess.run(
        [
            str(pg_bindir() / "pg_dump"),
            "-s",
            "--no-owner",
            "-x",
            *(f"-t{t}" for t in PGBENCH_TABLES),
            src.connstr,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # no psql meta-commands, and no capture triggers of a root (the functions are not on dst)
    dump = "\n".join(
        line for line in dump.splitlines() if not line.startswith("\\") and "_pgcascade_capture" not in line
    )
    with dst.connect() as conn:
        conn.execute(dump)
        conn.execute("select pg_catalog.set_config('search_path', 'public', false)")


@pytest.fixture
def cascade(tmp_path: Path, daemons: Daemons, request: pytest.FixtureRequest) -> Iterator[Cascade]:
    cas = Cascade(tmp_path, daemons)
    yield cas
    daemons.close()
    kill_processes_mentioning(str(tmp_path))
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for name in cas.dbs:
            print(f"\n----- {name}.log -----\n{cas.log(name)[-4000:]}")


@pytest.fixture
def private_clusters(request: pytest.FixtureRequest) -> Iterator:
    """private_clusters(n) -> n clusters of the test's own."""
    made: list[tuple[LocalCluster, Path]] = []

    def make(n: int) -> list[LocalCluster]:
        out = []
        for i in range(n):
            base = Path(tempfile.mkdtemp(prefix="pgcascade-private-"))
            c = new_cluster(f"p{i}", basedir=base)
            made.append((c, base))
            out.append(c)
        return out

    yield make
    for c, base in made:
        c.destroy()
        shutil.rmtree(base, ignore_errors=True)


def batches_between(db, first: int, last: int) -> list[tuple]:
    """(tick, ev_id, type, data) of every event in the batches first..last, read through a
    probe consumer registered at `first`: what any subscriber of this node would receive."""
    out = []
    with db.connect() as c:
        c.execute("select pgcascade.set_consumer_position(%s, 'probe', %s)", (QUEUE, first))
        while True:
            info = c.execute(
                "select batch_id, cur_tick_id from pgcascade.next_batch_info(%s, 'probe')", (QUEUE,)
            ).fetchone()
            if info[0] is None or info[1] > last:
                break
            for ev in c.execute(
                "select ev_id, ev_type, ev_data, ev_extra1 from pgcascade.get_batch_events(%s) order by ev_id",
                (info[0],),
            ):
                out.append((info[1], *ev))
            c.execute("select pgcascade.finish_batch(%s)", (info[0],))
            if info[1] == last:
                break
        c.execute("select pgcascade.unregister_consumer(%s, 'probe')", (QUEUE,))
    return out


def test_branches_carry_identical_batches_and_feed_leaves(cascade, make_db):
    """S1 root; S2 branch with every table; S3 branch with two tables, S4 a leaf under S3; S5 a
    queue-only branch.  pgbench on S1, workers killed at random: every node equals the root,
    every queue presents the root's batches tick for tick, locations reach every node."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b"), ("s3", "a"), ("s4", "b"), ("s5", "b")):
        c.node(name, make_db(cl))
    c.pgbench_root("s1")
    c.create("s2", "branch", "s1")
    c.create("s3", "branch", "s1")
    c.create("s4", "leaf", "s3")
    c.create("s5", "branch", "s2")
    c.run("s2", "add-table", "--all", "--create")
    c.run("s3", "add-table", "pgbench_accounts", "pgbench_history", "--create")
    r = c.cli("s4", "add-table", "pgbench_tellers", "--create", check=False)
    assert r.returncode == 2 and "pgbench_tellers" in r.stderr, r.stderr  # s3 does not hold it
    c.run("s4", "add-table", "pgbench_accounts", "pgbench_history", "--create")
    for n in ("s2", "s4"):
        add_apply_audit(c.dbs[n])
    c.start_all("s1", "s2", "s3", "s4", "s5")
    c.sync("s1", ["s2", "s3"])
    c.sync("s1", ["s4", "s5"])
    first = c.last_tick("s5")
    for n in ("s1", "s2", "s3", "s5"):  # a probe holds the ticks from here on every queue
        c.scalar(n, "select pgcascade.register_consumer_at(%s, 'probe', %s)", (QUEUE, first))
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "10", "-R", "200")
    rng = random.Random(11)
    for _ in range(8):
        time.sleep(rng.uniform(0.3, 1.0))
        victim = rng.choice(["s2", "s3", "s4", "s5"])
        c.kill_worker(victim)
        c.start_worker(victim)
    assert load.wait(timeout=60) == 0, load.stderr.read()
    c.sync("s1", ["s2", "s3", "s5"])
    c.sync("s1", ["s4"])  # s4 behind s3, which is at the root's tick already
    c.assert_equal("s1", "s2")
    c.assert_equal("s1", "s3", ("pgbench_accounts", "pgbench_history"))
    c.assert_equal("s1", "s4", ("pgbench_accounts", "pgbench_history"))
    for n in ("s2", "s4"):
        assert_history_applied_once(c.dbs[n])
    # identical batches, tick for tick, on every node that carries the queue
    last = c.last_tick("s5")
    reference = batches_between(c.dbs["s1"], first, last)
    assert len(reference) > 100, "too few events to compare"
    for n in ("s2", "s3", "s5"):
        assert batches_between(c.dbs[n], first, last) == reference, f"{n} carries other batches than s1"
    # s5 was created last, under s2: its location reached s4 through the root and s3
    wait_until(lambda: "s5" in c.cli("s4", "members").stdout, 30, what="s5's location on s4")
    status = c.cli("s4", "status").stdout
    for n in ("s1", "s2", "s3", "s4", "s5"):
        assert n in status, status
    assert "branch" in status and "leaf" in status


def test_seed_illustration_lose_root_then_branch(cascade, make_db, private_clusters):
    """Seed 003's simple illustration: S1 root, S2 and S3 branches, S4 leaf under S3.  Lose S1
    (immediate shutdown): S2 takes over (--dead-root) and S3 follows it.  Lose S3: S4 moves to
    S2 (--dead-branch).  Workers are killed at random throughout; S4 ends equal to S2 and no
    history row was applied twice anywhere."""
    c = cascade
    p1, p3 = private_clusters(2)
    c.node("s1", PrivateDb(p1))
    c.node("s2", make_db("a"))
    c.node("s3", PrivateDb(p3))
    c.node("s4", make_db("b"))
    c.pgbench_root("s1")
    c.run("s1", "add-seq", "--all")
    for n, kind, prov in (("s2", "branch", "s1"), ("s3", "branch", "s1"), ("s4", "leaf", "s3")):
        copy_schema(c.dbs["s1"], c.dbs[n])
        c.create(n, kind, prov)
        c.run(n, "add-table", "--all")
        c.run(n, "add-seq", "--all")
        add_apply_audit(c.dbs[n])
    c.start_all("s1", "s2", "s3", "s4")
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "8", "-R", "200")
    rng = random.Random(3)
    for _ in range(4):
        time.sleep(rng.uniform(0.3, 1.0))
        victim = rng.choice(["s2", "s3", "s4"])
        c.kill_worker(victim)
        c.start_worker(victim)
    load.wait(timeout=60)
    c.sync("s1", ["s2", "s3", "s4"])
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "30", "-R", "200")
    time.sleep(2)
    c.kill_worker("s2")  # both branches fall behind: S1 will die with events nobody else has
    c.kill_worker("s3")
    time.sleep(1)
    p1.stop("immediate")  # S1 lost under load
    load.wait(timeout=60)
    c.start_worker("s2")
    c.start_worker("s3")
    r = c.cli("s2", "takeover", "s1", "--dead-root", timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "s2 is the root" in r.stdout
    assert c.scalar("s3", "select provider_node from pgcascade.node where queue_name = %s", (QUEUE,)) == "s2"
    load = pgbench(c.dbs["s2"], "-c", "2", "-j", "2", "-T", "4", "-R", "200")
    assert load.wait(timeout=60) == 0, load.stderr.read()
    c.sync("s2", ["s3"])
    c.sync("s2", ["s4"])
    c.assert_equal("s2", "s3")
    c.assert_equal("s2", "s4")
    # now lose S3; S4 moves to S2
    load = pgbench(c.dbs["s2"], "-c", "2", "-j", "2", "-T", "6", "-R", "200")
    time.sleep(1.5)
    c.kill_worker("s3")
    p3.stop("immediate")
    r = c.cli("s2", "takeover", "s3", "--dead-branch", timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert c.scalar("s4", "select provider_node from pgcascade.node where queue_name = %s", (QUEUE,)) == "s2"
    assert load.wait(timeout=60) == 0, load.stderr.read()
    c.sync("s2", ["s4"])
    c.assert_equal("s2", "s4")
    for n in ("s2", "s4"):
        assert_history_applied_once(c.dbs[n])
    members = c.cli("s2", "members").stdout
    assert "s1" in members and "dead" in members
    # S1 comes back: what it alone had goes to a file, and it becomes S2's branch
    p1.start()
    history = "select aid, tid, bid, delta, mtime::text from pgbench_history"
    with c.dbs["s1"].connect() as a, c.dbs["s2"].connect() as b:
        lost_rows = set(a.execute(history).fetchall()) - set(b.execute(history).fetchall())
    assert lost_rows, "the test meant S1 to die with changes nobody else had"
    lost_file = c.tmp / "lost.jsonl"
    r = c.cli("s1", "resurrect", "--lost-events", str(lost_file))
    assert "s1 is a branch of s2" in r.stdout, r.stdout
    events = [json.loads(line) for line in lost_file.read_text().splitlines()]
    inserted = {
        (d["aid"], d["tid"], d["bid"], d["delta"], d["mtime"].replace("T", " "))
        for d in (json.loads(e["ev_data"]) for e in events if e["ev_extra1"] == "public.pgbench_history")
    }
    assert inserted == lost_rows
    c.sync("s2", ["s1"])
    c.assert_equal("s2", "s1")


def test_failover_keeps_history_for_a_node_down_during_it(cascade, make_db, private_clusters):
    """A leaf of the lost root is down while the branch takes over: it is not redirected, but
    the new root keeps the ticks it continues from through its maintenance, so once back it
    moves to the new root and ends equal, nothing applied twice."""
    c = cascade
    p1, p3 = private_clusters(2)
    c.node("s1", PrivateDb(p1))
    c.node("s2", make_db("a"))
    c.node("s3", PrivateDb(p3))
    c.pgbench_root("s1")
    c.run("s1", "add-seq", "--all")
    for n, kind in (("s2", "branch"), ("s3", "leaf")):
        copy_schema(c.dbs["s1"], c.dbs[n])
        c.create(n, kind, "s1")
        c.run(n, "add-table", "--all")
        c.run(n, "add-seq", "--all")
        add_apply_audit(c.dbs[n])
    c.start_all("s1", "s2", "s3")
    assert pgbench(c.dbs["s1"], "-c", "2", "-T", "3", "-R", "200").wait(timeout=60) == 0
    c.sync("s1", ["s2", "s3"])
    c.kill_worker("s3")
    p3.stop("immediate")  # s3 is down; s1 goes on, then dies too
    assert pgbench(c.dbs["s1"], "-c", "2", "-T", "2", "-R", "200").wait(timeout=60) == 0
    c.sync("s1", ["s2"])
    p1.stop("immediate")
    r = c.cli("s2", "takeover", "s1", "--dead-root", timeout=240)
    assert "s3: unreachable" in r.stdout and "keeps history for it" in r.stdout, r.stdout
    assert pgbench(c.dbs["s2"], "-c", "2", "-T", "3", "-R", "200").wait(timeout=60) == 0
    with c.dbs["s2"].connect() as conn:  # maintenance as the new root, whenever its ticker runs it
        for _ in range(3):
            conn.execute("select pgcascade.ticker(%s)", (QUEUE,))
            conn.execute("select pgcascade.maint_global_watermark(%s)", (QUEUE,))
            conn.execute("select pgcascade.maint_tick_cleanup(%s)", (QUEUE,))
    p3.start()
    r = c.cli("s3", "change-provider", "--provider", "s2")
    assert "s3 feeds from s2" in r.stdout, r.stdout
    c.start_worker("s3")
    c.sync("s2", ["s3"])
    c.assert_equal("s2", "s3")
    assert_history_applied_once(c.dbs["s3"])


def test_switchover_and_back_under_load(cascade, make_db):
    """S1 root, S2 branch, S3 leaf under S1.  takeover S1 on S2 while pgbench writes: S2 becomes
    the root, S1 its branch (S3 still under S1); and back.  Nothing lost, nothing twice."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b"), ("s3", "b")):
        c.node(name, make_db(cl))
    pgbench_init(c.dbs["s1"])
    for n in ("s2", "s3"):
        copy_schema(c.dbs["s1"], c.dbs[n])
    c.create("s1", "root")
    c.run("s1", "add-table", *PGBENCH_TABLES)
    c.run("s1", "add-seq", "--all")
    c.create("s2", "branch", "s1")
    c.create("s3", "leaf", "s1")
    for n in ("s2", "s3"):
        c.run(n, "add-table", "--all")
        c.run(n, "add-seq", "--all")
    add_apply_audit(c.dbs["s3"])
    c.start_all("s1", "s2", "s3")
    c.sync("s1", ["s2", "s3"])
    rng = random.Random(13)
    for new_root, old_root in (("s2", "s1"), ("s1", "s2")):
        load = pgbench(c.dbs[old_root], "-c", "2", "-j", "2", "-T", "6", "-R", "200")
        for victim in (new_root, "s3", old_root):  # every worker killed once before the takeover
            time.sleep(rng.uniform(0.2, 0.7))
            c.kill_worker(victim)
            c.start_worker(victim)
        r = c.cli(new_root, "takeover", old_root, timeout=240)
        assert f"{new_root} is the root" in r.stdout and "left out" not in r.stdout, r.stdout
        blocked = float(r.stdout.split("writes were refused for ")[1].split("s")[0])
        assert blocked < 5, r.stdout
        load.wait(timeout=60)  # its clients fail once writes are refused: that is the point
        # the old root refuses writes now; the new one takes them
        with pytest.raises(psycopg.Error, match="replicated"), c.dbs[old_root].connect() as conn:
            conn.execute("update pgbench_branches set bbalance = bbalance + 1 where bid = 1")
        load = pgbench(c.dbs[new_root], "-c", "2", "-j", "2", "-T", "3", "-R", "200")
        assert load.wait(timeout=60) == 0, load.stderr.read()
        c.sync(new_root, [old_root])
        c.sync(new_root, ["s3"])
        c.assert_equal(new_root, old_root)
        c.assert_equal(new_root, "s3")
    assert_history_applied_once(c.dbs["s3"])


def test_change_provider_to_nodes_behind_and_ahead(cascade, make_db):
    """A leaf moves to a branch that is behind it (waits, or refuses with --no-wait), then to
    the root (ahead): no gap, no duplicate."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b"), ("s3", "a"), ("l", "b")):
        c.node(name, make_db(cl))
    c.pgbench_root("s1")
    c.create("s2", "branch", "s1")
    c.create("s3", "branch", "s1")
    c.create("l", "leaf", "s2")
    for n in ("s2", "s3", "l"):
        c.run(n, "add-table", "--all", "--create")
    add_apply_audit(c.dbs["l"])
    c.start_all("s1", "s2", "s3", "l")
    c.sync("s1", ["s2", "s3", "l"])
    c.cli("s1", "pause", "s3")
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "3", "-R", "200")
    assert load.wait(timeout=60) == 0
    c.sync("s1", ["s2"])
    c.sync("s1", ["l"])
    r = c.cli("l", "change-provider", "--provider", "s3", "--no-wait", check=False)
    assert r.returncode == 1 and "s3 is at tick" in r.stderr, r.stderr
    proc = c.daemons.start(str(c.ini("l")), "change-provider", "--provider", "s3", "--timeout", "60")
    time.sleep(1)
    assert proc.poll() is None, proc.output()  # waiting for s3
    c.cli("s1", "resume", "s3")
    assert proc.wait(timeout=90) == 0, proc.output()
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "2", "-R", "200")
    assert load.wait(timeout=60) == 0
    c.sync("s1", ["s3"])
    c.sync("s1", ["l"])
    c.assert_equal("s1", "l")
    c.cli("l", "change-provider", "--provider", "s1")
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "2", "-R", "200")
    assert load.wait(timeout=60) == 0
    c.sync("s1", ["l"])
    c.assert_equal("s1", "l")
    assert_history_applied_once(c.dbs["l"])
    r = c.cli("s2", "change-provider", "--provider", "l", check=False)
    assert r.returncode == 2 and "leaf" in r.stderr


def test_stalled_leaf_holds_rotation_until_dropped(cascade, make_db):
    """A paused leaf under a branch keeps the root from deleting the ticks it needs (its
    watermark reaches the root through the branch); drop-node releases them."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b"), ("l", "a")):
        c.node(name, make_db(cl))
    c.pgbench_root("s1")
    c.create("s2", "branch", "s1")
    c.create("l", "leaf", "s2")
    for n in ("s2", "l"):
        c.run(n, "add-table", "--all", "--create")
    c.start_all("s1", "s2", "l")
    c.sync("s1", ["s2"])
    c.sync("s1", ["l"])
    c.cli("s1", "pause", "l")
    time.sleep(1)
    held = c.last_tick("l")
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "3", "-R", "200")
    assert load.wait(timeout=60) == 0
    c.sync("s1", ["s2"])
    time.sleep(2)  # several maintenance rounds
    oldest = "select min(tick_id) from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue where q.queue_name = %s"
    assert c.scalar("s1", oldest, (QUEUE,)) <= held, "the root deleted ticks the paused leaf needs"
    assert c.scalar("s2", oldest, (QUEUE,)) <= held
    status = c.cli("s1", "status").stdout
    assert "watermarks" in status and "s2" in status
    c.cli("s1", "drop-node", "l")
    wait_until(
        lambda: c.scalar("s1", oldest, (QUEUE,)) > held, 30, what="the root to release the leaf's ticks"
    )
    assert "l\t" not in c.cli("s2", "members").stdout


def test_commands_wait_for_the_work_they_depend_on(cascade, make_db):
    """Seed 004's rule: add-table on a leaf under a branch waits until a table just added on the
    root reaches the branch (--no-wait refuses), and add-seq likewise (Londiste 3's usual
    sequence of commands); wait-provider and wait-root wait on purpose."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b"), ("l", "a")):
        c.node(name, make_db(cl))
        with c.dbs[name].connect() as conn:
            conn.execute('create table "New Table" (id int primary key, v text)')
            conn.execute('create sequence "New Seq"')
    c.create("s1", "root")
    c.create("s2", "branch", "s1")
    c.create("l", "leaf", "s2")
    c.start_all("s1", "s2", "l")
    c.cli("s1", "pause", "s2")
    c.cli("s1", "add-table", '"New Table"')
    c.cli("s2", "add-table", '"New Table"')  # the root lists it: the branch may subscribe at once
    r = c.cli("l", "add-table", '"New Table"', "--no-wait", check=False)
    assert r.returncode == 2 and "not replicated by the provider" in r.stderr, r.stderr
    waiting = c.daemons.start(str(c.ini("l")), "add-table", '"New Table"', "--timeout", "60")
    time.sleep(1.5)
    assert waiting.poll() is None, waiting.output()
    c.cli("s1", "add-seq", '"New Seq"')
    # a leaf follows a sequence only through a branch that keeps its value: it waits for the
    # branch's add-seq (Londiste's order of commands, run from two terminals)
    r = c.cli("l", "add-seq", '"New Seq"', "--no-wait", check=False)
    assert r.returncode == 2 and "not replicated by the provider" in r.stderr, r.stderr
    waiting_seq = c.daemons.start(str(c.ini("l")), "add-seq", '"New Seq"', "--timeout", "60")
    time.sleep(1.5)
    assert waiting_seq.poll() is None, waiting_seq.output()
    c.cli("s2", "add-seq", '"New Seq"')
    assert waiting_seq.wait(timeout=60) == 0, waiting_seq.output()
    assert waiting.poll() is None, waiting.output()
    c.cli("s1", "resume", "s2")
    assert waiting.wait(timeout=60) == 0, waiting.output()
    with c.dbs["s1"].connect() as conn:
        conn.execute(
            """insert into "New Table" select g, repeat('x', g % 7) from generate_series(1, 500) g"""
        )
        conn.execute("""select setval('"New Seq"', 4242)""")
    r = c.cli("l", "wait-root", "--timeout", "60")
    assert "applied the root's tick" in r.stdout
    c.cli("l", "wait-provider", "--timeout", "60")
    wait_until(lambda: c.copying("l") == 0, 60, what="the leaf's copy")
    c.sync("s1", ["s2"])
    c.sync("s1", ["l"])
    c.assert_equal("s1", "l", ('"New Table"',))
    assert c.scalar("l", 'select count(*) from "New Table"') == 500
    wait_until(lambda: c.scalar("l", 'select last_value from "New Seq"') == 4242, 60, what="the sequence")
    assert c.scalar("s2", 'select last_value from "New Seq"') == 4242


PART_DDL = (
    "create table orders (id int8 primary key, part text not null, v int not null);"
    "create table log (part text, n bigserial, at timestamptz, primary key (part, n));"
)


def part_script(tmp: Path, part: str, first_id: int) -> Path:
    f = tmp / f"part_{part}.sql"
    f.write_text(
        f"\\set id random({first_id}, {first_id + 2000})\n"
        f"insert into orders values (:id, '{part}', 1) on conflict (id) do update set v = orders.v + 1;\n"
        f"insert into log (part, at) values ('{part}', now());\n"
    )
    return f


def add_log_audit(db) -> None:
    with db.connect() as conn:
        conn.execute("create table log_audit (part text, n int8, op text)")
        conn.execute(
            "create function audit_log() returns trigger language plpgsql as $$"
            " begin insert into log_audit values (new.part, new.n, tg_op); return null; end $$"
        )
        conn.execute(
            "create trigger audit after insert or update on log for each row execute function audit_log()"
        )
        conn.execute("alter table log enable always trigger audit")


def part_checksum(db, table: str, part: str) -> tuple:
    with db.connect() as conn:
        return conn.execute(
            f"select count(*), md5(string_agg(t::text, E'\\n' order by t::text)) from {table} t where part = %s",
            (part,),
        ).fetchone()


def test_combined_partitions_with_the_combined_root_lost(cascade, make_db, private_clusters):
    """Seed 003's complex illustration, two partitions: A1 and B1 are partition roots; on C, a
    merge-leaf per partition feeds the combined root; F is the combined-failover (a branch of
    the combined queue, with merge-leafs that follow); S3 is a branch under C.  C is lost under
    load: F takes over, its merge-leafs continue from the partitions, S3 moves to F, and both
    end equal to the union of the partitions with no row applied twice."""
    c = cascade
    (pc,) = private_clusters(1)
    dbs = {"a1": make_db("a"), "b1": make_db("b"), "c": PrivateDb(pc), "f": make_db("a"), "s3": make_db("b")}
    for db in dbs.values():
        with db.connect() as conn:
            conn.execute(PART_DDL)
    for name in ("f", "s3"):
        add_log_audit(dbs[name])
    jobs = {  # job -> (db, queue)
        "a1": ("a1", "part_a"),
        "b1": ("b1", "part_b"),
        "c": ("c", "combined"),
        "c_a": ("c", "part_a"),
        "c_b": ("c", "part_b"),
        "f": ("f", "combined"),
        "f_a": ("f", "part_a"),
        "f_b": ("f", "part_b"),
        "s3": ("s3", "combined"),
    }
    for job, (db, queue) in jobs.items():
        c.node(job, dbs[db], queue_name=queue)
    for name in ("a1", "b1", "c"):
        c.run(name, "create-root", name)
    c.run("a1", "add-table", "orders", "log")
    c.run("b1", "add-table", "orders", "log")

    def merge_leaf(leaf: str, part_root: str) -> None:  # with Londiste's flag, which always holds here
        synced = f"c_{part_root[0]},f_{part_root[0]}"
        r = c.cli(leaf, "create-leaf", leaf, "--provider", dbs[part_root].connstr, "--merge", "combined",
                  "--sync-watermark", synced)  # fmt: skip
        assert "keeps its events until every subscriber has them" in r.stdout, r.stdout

    for leaf, part_root in (("c_a", "a1"), ("c_b", "b1")):
        merge_leaf(leaf, part_root)
    r = c.cli("c_a", "add-table", "orders", "log", "--skip-truncate", "--merge-all")  # c_b's too
    assert "orders (part_b)" in r.stdout, r.stdout
    for name in ("f", "s3"):
        c.run(name, "create-branch", name, "--provider", dbs["c"].connstr)
        c.run(name, "add-table", "orders", "log")
    for leaf, part_root in (("f_a", "a1"), ("f_b", "b1")):
        merge_leaf(leaf, part_root)
    c.run("f_b", "add-table", "orders", "log", "--expect-sync", "--merge-all")
    for leaf in ("c_b", "f_a"):  # subscribed by --merge-all from their sibling
        listed = [line.split()[0] for line in c.cli(leaf, "tables").stdout.splitlines()]
        assert sorted(listed) == ["public.log", "public.orders"], (leaf, listed)
    for db in ("a1", "b1", "c", "f", "s3"):
        c.start_ticker(db)
    for job in jobs:
        c.start_worker(job)
    for job in ("c_a", "c_b", "f", "s3"):
        c.run(job, "wait-sync", "--timeout", "120")
    loads = [
        pgbench(dbs["a1"], "-c", "1", "-T", "14", "-R", "100", "-f", str(part_script(c.tmp, "a", 1))),
        pgbench(dbs["b1"], "-c", "1", "-T", "14", "-R", "100", "-f", str(part_script(c.tmp, "b", 100000))),
    ]
    rng = random.Random(5)
    for _ in range(4):
        time.sleep(rng.uniform(0.3, 1.0))
        victim = rng.choice(["c_a", "c_b", "f", "s3", "f_a"])
        c.kill_worker(victim)
        c.start_worker(victim)
    time.sleep(1)
    for job in ("c", "c_a", "c_b"):
        c.kill_worker(job)
    pc.stop("immediate")  # the combined root is lost while the partitions keep writing
    r = c.cli("f", "takeover", "c", "--dead-root", timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert c.scalar("s3", "select provider_node from pgcascade.node where queue_name = 'combined'") == "f", (
        r.stdout
    )
    for load in loads:
        assert load.wait(timeout=60) == 0, load.stderr.read()
    for leaf in ("f_a", "f_b"):
        c.cli(leaf, "wait-root", "--timeout", "120")  # every partition change is in F
    with dbs["f"].connect() as conn:
        target = conn.execute("select pgcascade.ticker('combined')").fetchone()[0]
    wait_until(
        lambda: (
            c.scalar("s3", "select last_tick from pgcascade.node where queue_name = 'combined'") >= target
        ),
        120,
        what="s3 to follow f",
    )
    for table in ("orders", "log"):
        for part, root in (("a", "a1"), ("b", "b1")):
            want = part_checksum(dbs[root], table, part)
            assert want[0] > 0
            assert part_checksum(dbs["f"], table, part) == want, f"{table} of partition {part} differs on f"
            assert part_checksum(dbs["s3"], table, part) == want, f"{table} of partition {part} differs on s3"
    for name in ("f", "s3"):
        with dbs[name].connect() as conn:
            rows, distinct, updates = conn.execute(
                "select count(*), count(distinct (part, n)), count(*) filter (where op <> 'INSERT') from log_audit"
            ).fetchone()
        assert updates == 0 and rows == distinct, (name, rows, distinct, updates)


def test_switchover_of_a_root_with_logical_capture_is_refused(cascade, make_db):
    """A root that captures from WAL would decode its own replayed changes once a branch: the
    switchover refuses it with the way out, and changes nothing."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b")):
        c.node(name, make_db(cl))
    c.run("s1", "create-root", "s1", "--capture=logical")
    c.create("s2", "branch", "s1")
    r = c.cli("s2", "takeover", "s1", check=False)
    assert r.returncode == 2 and "captures from WAL" in r.stderr and "--dead-root" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert c.scalar("s1", "select node_type from pgcascade.node") == "root"
    assert c.scalar("s2", "select node_type from pgcascade.node") == "branch"


FULL_SCHEMA = """
create sequence shared_seq start 1000;
create table parent (id serial primary key, name text not null default 'anon' unique,
    created timestamptz not null default now(), check (length(name) < 100));
create table child (id bigint generated by default as identity primary key,
    parent_id int references parent (id) on delete cascade, qty int not null default 1 check (qty > 0),
    total int generated always as (qty * 2) stored, note text collate "C");
create index child_parent on child (parent_id);
create index child_note_lower on child (lower(note)) where note is not null;
create table "Odd Name" (k bigint primary key default nextval('shared_seq'), v text);
"""
FULL_TABLES = ("parent", "child", '"Odd Name"')


def app_writes(c: Cascade, name: str, n: int) -> None:
    """What the application does: inserts that leave keys and defaults out."""
    with c.dbs[name].connect() as conn:
        for i in range(n):
            pid = conn.execute(
                "insert into parent (name) values (%s) returning id", (f"p{i}-{name}-{time.monotonic_ns()}",)
            ).fetchone()[0]
            conn.execute(
                "insert into child (parent_id, note) values (%s, %s), (%s, null)", (pid, f"n{i}", pid)
            )
            conn.execute("""insert into "Odd Name" (v) values (%s)""", (f"v{i}",))


def definitions(c: Cascade, name: str) -> dict[str, list]:
    """Defaults, constraints and indexes as the catalog shows them (names qualified)."""
    out: dict[str, list] = {}
    with c.dbs[name].connect() as conn:
        conn.execute("set search_path = pg_catalog")
        for t in ("public.parent", "public.child", 'public."Odd Name"'):
            out[t] = [
                conn.execute(
                    "select array_agg(format('%%s %%s %%s %%s %%s', attname, format_type(atttypid, atttypmod),"
                    " attnotnull, attidentity, coalesce(pg_get_expr(adbin, adrelid), '-')) order by attnum)"
                    " from pg_attribute left join pg_attrdef on adrelid = attrelid and adnum = attnum"
                    " where attrelid = %s::regclass and attnum > 0 and not attisdropped",
                    (t,),
                ).fetchone()[0],
                sorted(
                    r[0]
                    for r in conn.execute(
                        "select conname || ' ' || pg_get_constraintdef(oid) from pg_constraint"
                        " where conrelid = %s::regclass",
                        (t,),
                    )
                ),
                sorted(
                    r[0]
                    for r in conn.execute(
                        "select indexdef from pg_indexes where tablename = %s", (t.split(".")[1].strip('"'),)
                    )
                ),
            ]
    return out


def test_create_full_makes_a_node_that_can_become_the_root(cascade, make_db):
    """Londiste's --create-full: a branch made with it has the root's defaults, identity and
    generated columns, sequences, constraints, indexes and foreign keys (the one whose other
    end comes later too).  takeover refuses a node the application could not write to (a
    table made with --create has no defaults; sequences not followed are behind) and says
    what is missing; once they follow, the switchover goes and the application's inserts work
    on the new root, keys continuing."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b"), ("s3", "a")):
        c.node(name, make_db(cl))
    with c.dbs["s1"].connect() as conn:
        conn.execute(FULL_SCHEMA)
    app_writes(c, "s1", 30)
    c.create("s1", "root")
    c.run("s1", "add-table", *FULL_TABLES)
    c.run("s1", "add-seq", "parent_id_seq")
    c.create("s2", "branch", "s1")
    c.create("s3", "branch", "s1")
    c.start_all("s1", "s2", "s3")
    r = c.cli("s2", "add-table", "child", "--create-full")
    assert "foreign key child_parent_id_fkey not made: public.parent is not here" in r.stderr + r.stdout, r
    wait_until(lambda: c.copying("s2") == 0, 60, what="child's copy")
    r = c.cli("s2", "add-table", "parent", '"Odd Name"', "--create-full")
    assert "foreign key child_parent_id_fkey of public.child made" in r.stderr + r.stdout, r
    # the sequence parent's column owns follows the root's (the root passes it on): no add-seq
    assert c.cli("s2", "seqs").stdout.split() == ["public.parent_id_seq"]
    c.run("s3", "add-table", *FULL_TABLES, "--create")
    app_writes(c, "s1", 10)
    c.sync("s1", ["s2", "s3"])
    assert definitions(c, "s2") == definitions(c, "s1")
    assert c.scalar("s2", "select last_value from parent_id_seq") == 40

    r = c.cli("s3", "takeover", "s1", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for missing in (
        "public.parent.id has no default here",
        "public.child.id has no default here",
        'public."Odd Name".k has no default here',
    ):
        assert missing in r.stderr, r.stderr
    r = c.cli("s2", "takeover", "s1", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "sequence public.child_id_seq (public.child.id) is at 60 here, 80 on the old root" in r.stderr
    assert "sequence public.shared_seq" in r.stderr and "parent_id_seq" not in r.stderr, r.stderr
    assert c.scalar("s1", "select node_type from pgcascade.node") == "root"
    assert c.scalar("s2", "select node_type from pgcascade.node") == "branch"

    c.run("s1", "add-seq", "child_id_seq", "shared_seq")
    c.run("s2", "add-seq", "child_id_seq", "shared_seq")
    app_writes(c, "s1", 5)
    c.sync("s1", ["s2", "s3"])
    c.cli("s2", "takeover", "s1", timeout=240)
    assert c.scalar("s2", "select node_type from pgcascade.node") == "root"
    app_writes(c, "s2", 7)  # keys continue from the old root's sequences: no duplicate
    c.sync("s2", ["s1", "s3"])
    assert c.scalar("s2", "select count(*) from parent") == 52
    assert c.scalar("s2", "select max(id) from child") == 104
    c.assert_equal("s2", "s1", ("public.parent", "public.child", 'public."Odd Name"'))
    # --create made no generated column: s3 has the others
    c.assert_equal(
        "s2", "s3", ("public.parent", "(select id, parent_id, qty, note from child)", '"Odd Name"')
    )


def test_failover_checks_sequences_against_the_keys_it_holds(cascade, make_db, private_clusters):
    """With the root lost, the old root's sequences cannot be read: a failover compares each
    sequence a column draws from with the largest value in that column, refuses, and goes on
    with --force (saying what to fix)."""
    c = cascade
    (p1,) = private_clusters(1)
    c.node("s1", PrivateDb(p1))
    c.node("s2", make_db("a"))
    with c.dbs["s1"].connect() as conn:
        conn.execute("create table t (id serial primary key, v text)")
        conn.execute("insert into t (v) select 'x' from generate_series(1, 10)")
    c.create("s1", "root")
    c.run("s1", "add-table", "t")  # the sequence is not added: the branch's stays where it was made
    c.create("s2", "branch", "s1")
    c.cli("s2", "add-table", "t", "--create-full")
    c.start_all("s1", "s2")
    with c.dbs["s1"].connect() as conn:
        conn.execute("insert into t (v) select 'y' from generate_series(1, 20)")
    c.sync("s1", ["s2"])
    p1.stop("immediate")
    r = c.cli("s2", "takeover", "s1", "--dead-root", check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "sequence public.t_id_seq is at 10, behind public.t.id (up to 30)" in r.stderr, r.stderr
    assert c.scalar("s2", "select node_type from pgcascade.node") == "branch"
    r = c.cli("s2", "takeover", "s1", "--dead-root", "--force")
    assert "warning (--force): sequence public.t_id_seq is at 10" in r.stderr, r.stderr
    assert c.scalar("s2", "select node_type from pgcascade.node") == "root"


def test_copy_node_flags_copy_from_upstream_under_load(cascade, make_db):
    """Londiste's --find-copy-node and --copy-node: a leaf under a queue-only branch copies its
    tables from the nearest node upstream that holds them (here the root), or from the node it
    names; the branch carries their changes.  --wait-sync returns once the tables are in sync.
    pgbench writes throughout; the leaf ends equal to the root."""
    c = cascade
    for name, cl in (("s1", "a"), ("s2", "b"), ("l", "a")):
        c.node(name, make_db(cl))
    c.pgbench_root("s1")
    c.create("s2", "branch", "s1")
    c.create("l", "leaf", "s2")
    c.start_all("s1", "s2", "l")
    load = pgbench(c.dbs["s1"], "-c", "2", "-j", "2", "-T", "12", "-R", "150")
    r = c.cli("l", "add-table", "pgbench_accounts", "--create", check=False)
    assert (
        r.returncode == 2
        and "does not replicate public.pgbench_accounts" in r.stderr
        and "--find-copy-node" in r.stderr
    ), r.stderr
    r = c.cli("l", "add-table", "pgbench_accounts", "--create", "--copy-node", "s2", check=False)
    assert r.returncode == 2 and "--copy-node: s2 cannot give the copy of public.pgbench_accounts" in r.stderr
    r = c.cli(
        "l", "add-table", "pgbench_accounts", "pgbench_history", "--create", "--find-copy-node", "--wait-sync"
    )
    assert r.stdout.splitlines()[-1] == "in sync", r.stdout
    assert c.copying("l") == 0
    c.cli(
        "l",
        "add-table",
        "pgbench_branches",
        "pgbench_tellers",
        "--create",
        "--copy-node",
        "s1",
        "--wait-sync",
    )
    assert load.wait(timeout=60) == 0, load.stderr.read()
    c.sync("s1", ["s2"])
    c.sync("s1", ["l"])
    c.assert_equal("s1", "l")
    assert c.scalar("l", "select count(*) from pgbench_history") > 500
    # the copies read the root's queue: their consumers there are gone once in sync
    assert (
        c.scalar(
            "s1",
            "select count(*) from pgcascade.get_consumer_info(%s) where consumer_name like '%%.copy.%%'",
            (QUEUE,),
        )
        == 0
    )
