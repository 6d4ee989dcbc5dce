"""Faults of the world around pgcascade, each with pgbench writing on the root and every table
equal at the end (an md5 of every row, computed by PostgreSQL):

- a network partition between a leaf and its provider, longer than the TCP timeouts: the
  leaf's worker runs in a network namespace of its own and reaches the root over a veth link,
  which the test takes down and brings back;
- the leaf's disk full: its tables live in a tablespace on a small tmpfs, filled up by another
  file until the test deletes it;
- the root's logical slot invalidated by max_slot_wal_keep_size while its capture daemon is
  down: `status` says so, `recover-slot` makes a new slot and repairs what was lost.

While a fault lasts, the leaf must hold whole batches only: pgbench's transaction changes an
account, its teller, its branch and a history row by the same delta, so the four sums stay
equal in any state a whole number of transactions leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from conftest import PGCASCADE, Database, ReplicaSet, table_checksum
from test_replication import PGBENCH_TABLES, pgbench, pgbench_init

from pgcascade.dev.localcluster import LocalCluster, wait_until
from pgcascade.dev.sparkcluster import NetHost, can_make_hosts

# what a dead link is noticed by here: seconds, so that the partition need not last minutes
FAST_TCP = {
    "tcp_keepalives_idle": 1,
    "tcp_keepalives_interval": 1,
    "tcp_keepalives_count": 2,
    "tcp_user_timeout": 3,
}


def sums(db) -> tuple:
    """The four pgbench balances' sums: equal in every state made of whole transactions."""
    with db.connect() as conn:
        return conn.execute(
            "select (select sum(abalance) from pgbench_accounts), (select sum(tbalance) from pgbench_tellers),"
            " (select sum(bbalance) from pgbench_branches), (select coalesce(sum(delta), 0) from pgbench_history)"
        ).fetchone()


def assert_whole(db) -> None:
    s = sums(db)
    assert len(set(s)) == 1, f"a batch was half applied: sums {s}"


def assert_all_equal(r: ReplicaSet) -> None:
    for t in PGBENCH_TABLES:
        assert table_checksum(r.root, t) == table_checksum(r.leaf, t), f"{t} differs"


def applied_tick(db) -> int:
    with db.connect() as conn:
        return conn.execute("select last_tick from pgcascade.node").fetchone()[0] or 0


def node_error(db) -> str:
    with db.connect() as conn:
        return conn.execute("select coalesce(last_error, '') from pgcascade.node").fetchone()[0]


def start_set(r: ReplicaSet, root_args: tuple[str, ...] = ()) -> None:
    pgbench_init(r.root)
    r.run("root", "create-root", "root", *root_args)
    r.run("root", "add-table", *PGBENCH_TABLES)
    r.run("leaf", "create-leaf", "leaf1", "--provider", r.root.connstr)
    r.run("leaf", "add-table", "--all", "--create")
    r.start_ticker()


class SocketDatabase(Database):
    """A database reached through its cluster's Unix socket: from any network namespace."""

    @property
    def connstr(self) -> str:
        return f"host={self.cluster.basedir} port={self.cluster.port} user=postgres dbname={self.name}"


@pytest.fixture
def netns_root(tmp_path: Path):
    """A root cluster listening on this host's end of a veth link to a network namespace."""
    reason = can_make_hosts()
    if reason:
        pytest.fail(f"the partition test needs network namespaces: {reason}")
    host = NetHost.free(f"pgcf-{os.getpid()}").create()
    base = Path(tempfile.mkdtemp(prefix="pgcascade-partition-"))
    cluster = LocalCluster("root", base, address=host.gateway)
    try:
        cluster.init().start()
        yield host, cluster
    finally:
        cluster.destroy()
        host.destroy()
        shutil.rmtree(base, ignore_errors=True)


def test_partition_longer_than_the_tcp_timeouts_is_noticed_and_healed(netns_root, make_db, tmp_path, daemons):
    host, cluster = netns_root
    cluster.create_database("app")
    leaf = make_db("b")
    r = ReplicaSet(Database(cluster, "app"), SocketDatabase(leaf.cluster, leaf.name), tmp_path, daemons)
    r.ini("root", r.root)
    r.ini("leaf", r.leaf, loop_delay=0.2, **FAST_TCP)
    start_set(r)
    # the leaf's worker lives on the other side of the link: its own database through the
    # socket, the root at this host's address on the link
    out = (tmp_path / "worker.out").open("w")
    worker = host.run([*PGCASCADE, str(r.leaf_ini), "worker"], stdout=out, stderr=subprocess.STDOUT)
    daemons.procs.append(worker)
    r.wait_sync()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "25", "-R", "100")
    try:
        time.sleep(2)
        link = f"pgch{host.subnet}"
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        down = time.monotonic()
        logged = len(r.log())
        # noticed within the TCP timeouts (3 s), not after the kernel's 15 minutes of retries
        wait_until(
            lambda: "OperationalError" in r.log()[logged:], 20, what="the worker to notice the dead link"
        )
        noticed = time.monotonic() - down
        wait_until(lambda: node_error(r.leaf), 10, what="the error in the node's status")
        assert_whole(r.leaf)
        time.sleep(max(0.0, 10 - (time.monotonic() - down)))  # longer than every TCP timeout
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    finally:
        assert load.wait(timeout=120) == 0, load.stderr.read()
    r.wait_sync()
    assert_all_equal(r)
    assert worker.poll() is None, "the worker exited"
    print(f"dead link noticed after {noticed:.1f} s")


@pytest.fixture
def small_disk():
    """A 48 MB tmpfs the server can write: a tablespace's home."""
    base = Path(tempfile.mkdtemp(prefix="pgcascade-disk-"))
    base.chmod(0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(base)], check=True)
    try:
        (base / "ts").mkdir()
        shutil.chown(base / "ts", "postgres", "postgres")
        yield base
    finally:
        subprocess.run(["umount", "-l", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def fill_the_rest(path: Path) -> None:
    """Take every byte a file system still has free."""
    stat = os.statvfs(path.parent)
    if free := stat.f_bavail * stat.f_frsize:
        subprocess.run(["fallocate", "-l", str(free), str(path)], check=True)


def test_full_disk_stops_the_worker_whole_and_it_continues_after(make_db, tmp_path, daemons, small_disk):
    r = ReplicaSet(make_db("a"), make_db("b"), tmp_path, daemons)
    r.ini("root", r.root)
    r.ini("leaf", r.leaf, loop_delay=0.2)
    space = f"small_{r.leaf.name}"
    with r.leaf.cluster.connect() as conn:
        conn.execute(f"create tablespace {space} location '{small_disk / 'ts'}'")
    try:
        with r.leaf.cluster.connect() as conn:
            conn.execute(f'alter database "{r.leaf.name}" set default_tablespace = {space}')
        start_set(r)
        r.start_worker()
        r.wait_sync()
        filler = small_disk / "filler"
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        subprocess.run(["fallocate", "-l", str(free - 256 * 1024), str(filler)], check=True)
        load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "20", "-R", "100")
        try:
            wait_until(
                lambda: "No space left on device" in node_error(r.leaf), 60, what="the disk-full error"
            )
            status = json.loads(r.cli("leaf", "status", "--json").stdout)
            assert "No space left on device" in status["last_error"], status
            check = r.cli("leaf", "status", "--check", check=False)
            assert check.returncode == 2 and "No space left on device" in check.stdout, check.stdout
            # The space the load left may still let a retry fit (pruned pages of a failed attempt):
            # take the rest, then no batch can commit and the worker must stay where it failed.
            fill_the_rest(small_disk / "rest")
            time.sleep(0.5)
            stuck = applied_tick(r.leaf)
            time.sleep(2)
            assert applied_tick(r.leaf) == stuck, "the worker went on past the failing batch"
            assert_whole(r.leaf)
            for f in (filler, small_disk / "rest"):
                f.unlink(missing_ok=True)  # space freed: the worker goes on from that batch by itself
        finally:
            assert load.wait(timeout=120) == 0, load.stderr.read()
        r.wait_sync()
        assert_all_equal(r)
        assert node_error(r.leaf) == ""
    finally:
        daemons.close()
        with r.leaf.cluster.connect() as conn:
            conn.execute(f'drop database if exists "{r.leaf.name}" with (force)')
            conn.execute(f"drop tablespace if exists {space}")


def test_invalidated_slot_is_reported_and_recovered_without_a_copy(
    private_cluster, make_db, tmp_path, daemons
):
    r = ReplicaSet(Database(private_cluster, "postgres"), make_db("b"), tmp_path, daemons)
    r.ini("root", r.root, spark_master="local[2]")
    r.ini("leaf", r.leaf, loop_delay=0.2)
    start_set(r, ("--capture=logical",))
    capture = daemons.start(str(r.root_ini), "capture")
    r.start_worker()
    r.wait_sync()
    with r.leaf.connect() as conn:
        before = conn.execute("select pg_current_xact_id()::text::int8").fetchone()[0]
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "30", "-R", "100")
    try:
        time.sleep(1)
        daemons.kill(capture)  # down for a while; pgbench's changes pile up in the slot's WAL
        with r.root.connect() as conn:
            conn.execute("alter system set max_slot_wal_keep_size = '1MB'")
            conn.execute("select pg_reload_conf()")
            for _ in range(4):
                time.sleep(0.3)
                conn.execute("select pg_switch_wal()")
            conn.execute("checkpoint")
            assert conn.execute("select wal_status from pg_replication_slots").fetchone()[0] == "lost"
        check = r.cli("root", "status", "--check", check=False)
        assert check.returncode == 2 and "invalidated" in check.stdout and "recover-slot" in check.stdout, (
            check.stdout
        )
        assert "invalidated" in r.cli("root", "status").stdout
        capture = daemons.start(str(r.root_ini), "capture")  # back, as systemd would: it waits
        wait_until(
            lambda: "waiting for a new slot" in r.log("root"), 30, what="the capture daemon to see the loss"
        )
        rec = r.cli("root", "recover-slot", "--no-progress", timeout=300)
        fixed = int(rec.stdout.split("recovered: ")[1].split()[0])
        assert fixed > 0, rec.stdout  # pgbench's changes of the loss were found and sent
        assert r.cli("root", "status", "--check", check=False).returncode == 0
    finally:
        assert load.wait(timeout=120) == 0, load.stderr.read()
    r.wait_sync()
    assert_all_equal(r)
    with r.leaf.connect() as conn:  # rows written on the leaf since: pgbench's and the repair's, no copy
        rewritten = conn.execute(
            "select count(*) from pgbench_accounts where xmin::text::int8 >= %s::int8 %% 4294967296",
            (before,),
        ).fetchone()[0]
    assert rewritten < 20000, f"{rewritten} of 100000 accounts rewritten: copied again?"
    with contextlib.suppress(psycopg.Error), r.root.connect() as conn:
        conn.execute("alter system reset max_slot_wal_keep_size")
