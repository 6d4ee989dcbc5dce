"""The Spark pipeline on a standalone cluster whose worker is another host.

The fixture starts a Spark master from pip's pyspark here and a worker in a network namespace
of its own (its own address, a veth link to this host; see pgcascade.dev.sparkcluster).  The
worker's Python is a venv at another path that cannot import pgcascade: every task that runs
there runs code the driver shipped.  PostgreSQL listens on this host's address on that link,
and every DSN names it, as DSNs must on a real cluster.

What a user checks: the tables equal after a Spark copy, repair --apply finds the planted
differences (its compare, the compare verb's code) and fixes them, the sink's compaction equals
the root, and the master's page lists each command as an application; a master that grants no
executor gives a one-line error in bounded time.  (What `compare` prints and exits with once the
tables are equal, `compare --json` and `repair --output` are the same on any master:
test_pipeline_compare checks them in local mode; a Spark application fewer here keeps the
suite's time.)
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pyarrow.dataset as ds
import pytest
from conftest import Daemons, Database, ReplicaSet, table_checksum
from test_replication import PGBENCH_TABLES, pgbench_init

from pgcascade.dev.localcluster import LocalCluster, wait_until
from pgcascade.dev.sparkcluster import SparkCluster, can_make_hosts

ACCOUNTS = "public.pgbench_accounts"


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory):
    reason = can_make_hosts()
    if reason:
        pytest.fail(f"the cluster tests need network namespaces: {reason}")
    cluster = SparkCluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        cluster.start(hosts=1)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def pg(spark_cluster, tmp_path_factory):
    """One PostgreSQL cluster that the worker host reaches at this host's address on its link."""
    c = LocalCluster("pg", tmp_path_factory.mktemp("pg"), address=spark_cluster.address)
    c.init().start()
    yield c
    c.destroy()


@pytest.fixture
def cluster_set(spark_cluster, pg, tmp_path, request):
    """A root and a leaf (two databases of `pg`) whose configs run Spark on the cluster."""
    name = request.node.name[-20:].lower().strip("_")
    root, leaf = Database(pg, f"root_{name}"), Database(pg, f"leaf_{name}")
    pg.create_database(root.name)
    pg.create_database(leaf.name)
    daemons = Daemons()
    r = ReplicaSet(root, leaf, tmp_path, daemons)
    spark = spark_keys(spark_cluster)
    r.ini("root", root, **spark)
    r.ini(
        "leaf",
        leaf,
        parallel_copies=1,
        spark_copy_min_rows=50000,
        spark_copy_range_rows=12500,
        compare_segment_rows=25000,
        **spark,
    )
    yield r
    daemons.close()


def spark_keys(spark_cluster: SparkCluster) -> dict[str, object]:
    """What a config needs to run Spark on the cluster."""
    return {
        "spark_master": spark_cluster.master_url,
        "spark.pyspark.python": spark_cluster.python,
        "spark.executor.memory": "1g",
        # the executor's first task, not a figure under test: on a host at load 13-19 the
        # driver took 140 s to submit it (seen in a full run), past the default 120 s
        "spark_executor_wait": 300,
    }


def app_names(spark_cluster: SparkCluster) -> list[str]:
    return [a["name"] for a in spark_cluster.applications()]


def test_copy_compare_repair_and_compact_run_on_the_other_host(cluster_set, spark_cluster, tmp_path):
    r = cluster_set
    pgbench_init(r.root, scale=1)  # 100,000 accounts: a Spark copy of about 8 ranges
    r.setup(list(PGBENCH_TABLES))
    r.start_ticker()
    r.start_worker()
    r.wait_sync(timeout=300)
    r.assert_equal(*PGBENCH_TABLES)
    log = r.log()
    planned = re.search(r"spark copy planned: (\d+) range", log)
    assert planned and int(planned.group(1)) >= 5, log[-3000:]
    # the cluster's cores (one worker of 2), within the databases' connection slots
    assert f"2 range(s) at once on {spark_cluster.master_url}" in log, log[-3000:]
    assert f"pgcascade copy {ACCOUNTS}" in app_names(spark_cluster)

    with r.leaf.connect() as conn:
        conn.execute("set session_replication_role = replica")
        conn.execute("delete from pgbench_accounts where aid in (7, 50001)")
        conn.execute("update pgbench_accounts set abalance = -1 where aid in (42, 99999)")
        conn.execute("insert into pgbench_accounts values (100001, 1, 0, 'extra')")
    assert table_checksum(r.root, ACCOUNTS) != table_checksum(r.leaf, ACCOUNTS)
    # repair compares first (the compare verb's code): it must find exactly what was planted
    fix = r.cli("leaf", "repair", ACCOUNTS, "--apply", check=False, timeout=300)
    assert fix.returncode == 0, fix.stdout + fix.stderr
    found = f"{ACCOUNTS}: rows 100000, missing 2, extra 1, different 2: DIFFERENT"
    assert found in fix.stdout, fix.stdout + fix.stderr
    assert "applying the fix of 5 differing row(s)" in fix.stderr and "applied: 5 row(s)" in fix.stderr
    assert table_checksum(r.root, ACCOUNTS) == table_checksum(r.leaf, ACCOUNTS)

    lake = tmp_path / "lake"
    sink_ini = r.ini(
        "lake", r.root, sink_path=f"file://{lake}", **spark_keys(spark_cluster)
    )  # a URI, as for s3a://
    sink = r.daemons.start(str(sink_ini), "sink")
    wait_until(lambda: (lake / "_sink.json").exists(), 120, what="the sink's initial snapshot")
    r.daemons.kill(sink)
    compact = r.cli("lake", "sink", "compact", timeout=300)
    assert f"{ACCOUNTS}: 100000 rows" in compact.stdout, compact.stdout + compact.stderr
    current = ds.dataset(str(lake / "_current" / ACCOUNTS), format="parquet").to_table()
    with r.root.connect() as conn:
        root_sum = conn.execute("select count(*), sum(aid), sum(abalance) from pgbench_accounts").fetchone()
    aid, bal = current.column("aid").to_pylist(), current.column("abalance").to_pylist()
    assert (len(aid), sum(aid), sum(bal)) == root_sum

    names = app_names(spark_cluster)
    for app in ("pgcascade repair", "pgcascade sink compact"):
        assert app in names, names


def test_a_master_that_grants_no_executor_fails_in_one_line(cluster_set, spark_cluster):
    r = cluster_set
    with r.root.connect() as conn:
        conn.execute("create table t (id int primary key)")
    r.setup(["t"])
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    # more memory per executor than the worker has: the master never grants one
    r.ini(
        "leaf",
        r.leaf,
        spark_master=spark_cluster.master_url,
        spark_executor_wait=45,  # Spark's warning below comes 1 s after the job's submission,
        # which took over 12 s at load 5+ (the warning missed a 15 s wait, and once a 30 s one)
        # Spark warns of a job with no resources after spark.starvation.timeout (default 15 s)
        **{"spark.executor.memory": "64g", "spark.starvation.timeout": "1s"},
    )
    started = time.monotonic()
    out = r.cli("leaf", "compare", "t", "--no-progress", check=False, timeout=150)
    took = time.monotonic() - started
    assert out.returncode == 1, out.stdout + out.stderr
    ours = [line for line in out.stderr.splitlines() if line.startswith("pgcascade")]
    assert len(ours) == 1 and ours[0].startswith("pgcascade: no Spark executor from spark://"), out.stderr
    assert "Traceback" not in out.stderr
    assert "Initial job has not accepted any resources" in out.stderr  # Spark's own warning reaches the user
    # the configured 45 s, not the default 120 s: the rest is two JVMs starting on a loaded host
    # (63 s in one CI run at load 10+ with a 15 s wait, where 45 s was asserted)
    assert "within 45 s" in ours[0], ours[0]
    assert took < 140, f"gave up after {took:.0f} s"


def test_spark_server_on_the_cluster_ships_pgcascade_and_refuses_a_busy_port(
    cluster_set, spark_cluster, tmp_path
):
    r = cluster_set
    with r.root.connect() as conn:
        conn.execute("create table t (id int primary key, v text)")
        conn.execute("insert into t select g, md5(g::text) from generate_series(1, 1000) g")
    r.setup(["t"])
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    port = _free_port()
    server = {
        "spark_master": spark_cluster.master_url,
        "spark.pyspark.python": spark_cluster.python,
        "spark.executor.memory": "1g",
        "spark.cores.max": "1",
        "spark_server_port": port,
        "spark_server_dir": tmp_path / "server",
    }
    srv = r.ini("server", r.leaf, **server)
    with socket.create_server(("127.0.0.1", port)):
        busy = r.cli("server", "spark-server", "start", check=False)
    assert busy.returncode == 1 and f"port {port} is in use by another program" in busy.stderr, busy.stderr
    try:
        r.cli("server", "spark-server", "start", timeout=180)
        r.ini("leaf", r.leaf, spark_remote=f"sc://127.0.0.1:{port}")
        with r.leaf.connect() as conn:
            conn.execute("set session_replication_role = replica")
            conn.execute("update t set v = 'changed' where id = 500")
        out = r.cli("leaf", "compare", "t", "--no-progress", check=False, timeout=300)
        assert out.returncode == 3 and "different 1" in out.stdout, out.stdout + out.stderr
        # the server keeps one core: the other is free for another application
        state = spark_cluster.state() or {}
        assert state.get("coresused") == 1, state
    finally:
        subprocess.run([*_cli(srv), "spark-server", "stop"], capture_output=True, timeout=120)


def _cli(ini) -> list[str]:
    return [sys.executable, "-m", "pgcascade", str(ini)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
