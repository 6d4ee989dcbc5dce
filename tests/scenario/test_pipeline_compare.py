"""compare and repair on real clusters with real Spark (local mode, one session per module).

Differences are planted on the leaf by hand (session_replication_role = replica passes the
protection trigger), so every test knows exactly which keys differ and how; the final
equality checks use `table_checksum` (an md5 of every row, computed by PostgreSQL).
"""

from __future__ import annotations

import json
import subprocess
import time

import psycopg
import pytest
from conftest import SPARK_TEST_CONF, run_cli, run_in_process, table_checksum
from conftest import query_checksum as checksum
from test_cascade import cascade  # noqa: F401 (a fixture)
from test_replication import PGBENCH_TABLES, pgbench, pgbench_init
from test_two_way import make_tables, two_way  # noqa: F401 (a fixture)

from pgcascade.core.config import load_config
from pgcascade.pipeline import commands
from pgcascade.pipeline.compare import Comparison
from pgcascade.pipeline.repair import KeySpool, apply_fix
from pgcascade.pipeline.session import build_session

BIG = 10 * 1024 * 1024  # a 10 MB value

SCHEMA = [
    # composite key (int, text), with gaps in the int part
    "create table comp (a int, b text, v text, n numeric, primary key (a, b))",
    "insert into comp select g * 7, 'k' || (g % 3), md5(g::text), g / 3.0 from generate_series(1, 3000) g",
    # text key with unicode, NULLs and empty strings in the values
    "create table words (w text primary key, note text, j jsonb, t timestamptz, d bytea)",
    "insert into words select 'wörd-' || g || '-ü€', case when g % 4 = 0 then null when g % 4 = 1 then '' else 'x' || g end,"
    " jsonb_build_object('g', g, 'l', array[g, g + 1]), '2026-01-01 00:00+02'::timestamptz + g * interval '1 minute',"
    " decode(md5(g::text), 'hex') from generate_series(1, 2000) g",
    # empty
    "create table empty (id int primary key, v text)",
]
BLOBS = [  # big values: only for the tests that plant differences in them
    "create table blobs (id int primary key, body text)",
    f"insert into blobs select g, repeat(chr(65 + g), {BIG}) from generate_series(1, 3) g",
]
SMALL_TABLES = ["public.comp", "public.words", "public.empty"]
TABLES = [*SMALL_TABLES, "public.blobs"]


def leaf_exec(replica, *statements: str) -> None:
    """Write on the leaf behind the replication's back (the protection trigger does not fire)."""
    with replica.leaf.connect() as conn:
        conn.execute("set session_replication_role = replica")
        for s in statements:
            conn.execute(s)


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    ini = tmp_path_factory.mktemp("spark") / "spark.ini"
    keys = {"job_name": "spark_tests", "spark_master": "local[2]", **SPARK_TEST_CONF}
    ini.write_text("[pgcascade]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))
    session = build_session(load_config(ini))
    yield session
    session.stop()


def sync(replica, statements: list[str], tables: list[str]):
    """Root and leaf with `tables` made by `statements` replicated and in sync; ticker and
    worker running."""
    with replica.root.connect() as conn:
        for s in statements:
            conn.execute(s)
    replica.setup(tables)
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    return replica


@pytest.fixture
def synced(replica):
    """Every table of SCHEMA and BLOBS in sync (30 MB of values to copy)."""
    return sync(replica, SCHEMA + BLOBS, TABLES)


@pytest.fixture
def synced_small(replica):
    """The SCHEMA tables in sync, without the blobs."""
    return sync(replica, SCHEMA, SMALL_TABLES)


def compare(replica, spark, *tables: str, **extra) -> dict:
    cfg = load_config(replica.ini("leaf", replica.leaf, **extra))
    with Comparison(cfg, list(tables)) as cmp:
        results = cmp.run(spark)
    return {r.spec.table: r for r in results}


def counts(results: dict) -> dict:
    return {t: (r.missing, r.extra, r.different) for t, r in results.items()}


def test_compare_finds_every_planted_difference_and_nothing_else(synced, spark):
    r = synced
    # small ranges, so that several key ranges and the bisection into buckets are exercised
    first = compare(r, spark, compare_segment_rows=500, compare_bucket_rows=20)
    assert counts(first) == {t: (0, 0, 0) for t in TABLES}
    assert first["public.comp"].rows == 3000 and first["public.empty"].rows == 0
    leaf_exec(
        r,
        "delete from comp where a in (7, 700, 21000)",  # missing (a = 21000: the last key)
        "insert into comp values (8, 'k1', 'extra', 1), (99999, 'zz', 'extra', 2)",  # extra, one past the end
        "update comp set v = null where a = 14",  # value -> NULL
        "update comp set n = n + 0.0000001 where a = 28",  # numeric digit far right
        "update words set note = '' where note is null and w = 'wörd-4-ü€'",  # NULL -> ''
        "update words set note = null where w = 'wörd-5-ü€'",  # '' -> NULL
        "update words set j = j || '{\"z\": 1}' where w = 'wörd-6-ü€'",  # jsonb
        "update words set t = t + interval '1 microsecond' where w = 'wörd-7-ü€'",  # timestamp
        "update words set d = d || '\\x00'::bytea where w = 'wörd-8-ü€'",  # bytea
        "delete from words where w = 'wörd-9-ü€'",
        "insert into words (w) values ('wörd-9-ü€ ')",  # a key that differs by a trailing space
        "update blobs set body = overlay(body placing 'x' from 5000000) where id = 2",  # one char of 10 MB
        "insert into empty values (1, 'extra')",
    )
    res = compare(r, spark, compare_segment_rows=500, compare_bucket_rows=20)
    assert counts(res) == {
        "public.comp": (3, 2, 2),
        "public.words": (1, 1, 5),
        "public.blobs": (0, 0, 1),
        "public.empty": (0, 1, 0),
    }
    assert res["public.words"].rows == 2000 and res["public.words"].sub_rows == 2000
    assert ["21000", "k0"] in res["public.comp"].samples["missing"]


def test_values_compare_by_value_not_by_text(synced_small, spark):
    r = synced_small
    # same values in another text form: 1.5 as 1.50, the same instant in another zone
    with r.root.connect() as conn:
        conn.execute("update comp set n = 1.5 where a = 7")
    r.wait_sync()
    leaf_exec(
        r,
        "update comp set n = 1.50000 where a = 7",
        "update words set t = (t at time zone 'Asia/Tokyo') at time zone 'Asia/Tokyo' where w = 'wörd-10-ü€'",
    )
    res = compare(r, spark)
    assert counts(res) == {t: (0, 0, 0) for t in SMALL_TABLES}
    assert table_checksum(r.root, "comp") != table_checksum(r.leaf, "comp")  # the text did change


TYPED = [
    "create type mood as enum ('sad', 'ok', 'happy')",
    "create table typed (id bigint primary key, s smallint, b bool, r real, f float8, u uuid, js json,"
    " c char(6), vc varchar(10), x text, y text, m mood, arr int[], d date, iv interval, ts timestamp)",
]
TYPED_ROWS = (
    "insert into typed select g * 10 - 500, g % 100, g % 2 = 0, g / 7.0, g / 3.0, md5(g::text)::uuid,"
    " json_build_object('a', g, 'b', 'x'), 'c' || g % 50, 'v' || g, 'x' || g, null,"
    " (array['sad', 'ok', 'happy'])[g % 3 + 1]::mood, array[g, g + 1], date '2026-01-01' + g,"
    " g * interval '1 hour', timestamp '2026-01-01' + g * interval '1 minute' from generate_series(1, 2000) g"
)


def test_typed_hashes_see_every_change_and_integer_buckets_every_key(replica, spark):
    """Column hashes by type (and text for enums, arrays, dates, intervals); an integer key's
    buckets are key intervals from the lowest key of either side to the highest."""
    r = replica
    for db in (r.root, r.leaf):
        with db.connect() as conn:
            for s in TYPED:
                conn.execute(s)
    with r.root.connect() as conn:
        conn.execute(TYPED_ROWS)
    r.setup(["typed"], leaf_args=())
    r.start_ticker()
    r.start_worker()
    r.wait_sync()
    small = {"compare_segment_rows": 500, "compare_bucket_rows": 20}
    assert counts(compare(r, spark, **small)) == {"public.typed": (0, 0, 0)}
    leaf_exec(
        r,
        # two rows of one bucket swap a value: the bucket's xor must not cancel out
        "update typed set x = case id when 100 then 'x61' else 'x60' end where id in (100, 110)",
        "update typed set x = null, y = x where id = 200",  # a value moved to the next column
        "update typed set m = case m when 'sad' then 'ok'::mood else 'sad' end where id in (300, 310)",  # enum
        'update typed set js = \'{"b": "x",  "a": 90}\' where id = 400',  # same json value
        "update typed set arr = array[1] where id = 600",  # array
        "update typed set iv = iv - interval '1 day' + interval '24 hours' where id = 700",  # '24:00:00' is not '1 day'
        "update typed set f = f + 1e-12 where id = 800",
        "update typed set s = s + 1 where id = 900",
        "update typed set b = not b where id = 1000",
        "update typed set c = c || ' ' where id = 1100",  # char(6): the same value
        "delete from typed where id = 1500",
        "insert into typed (id) values (-10000), (1000000000000)",  # below the lowest, far above the highest
    )
    res = compare(r, spark, **small)["public.typed"]
    assert (res.missing, res.extra, res.different) == (1, 2, 10), res
    assert sorted(res.samples["extra"]) == [["-10000"], ["1000000000000"]]


def test_repair_apply_makes_the_leaf_equal(synced, spark):
    r = synced
    leaf_exec(
        r,
        "delete from comp where a between 70 and 140",
        "insert into comp values (1, 'new', 'extra', 1)",
        "update words set note = null, d = null where w like 'wörd-1%'",
        "update blobs set body = 'short' where id = 3",
        "insert into empty values (5, 'extra')",
    )
    cfg = load_config(r.leaf_ini)
    spool = KeySpool()
    with Comparison(cfg, []) as cmp:
        results = cmp.run(spark, spool.write)
        specs = cmp.ctx.specs
    assert sum(x.missing + x.extra + x.different for x in results) == spool.count > 0
    # the root changes rows the fix touches between the compare and the fix: the fix must
    # carry the provider's newer values, not the compare's
    with r.root.connect() as conn:
        conn.execute("update comp set v = 'changed after compare' where a = 77")
        conn.execute("delete from words where w = 'wörd-10-ü€'")
    apply_fix(cfg.db, cfg.queue_name, specs, spool, timeout=10)
    r.wait_sync()
    for t in TABLES:
        assert table_checksum(r.root, t) == table_checksum(r.leaf, t), t
    assert counts(compare(r, spark)) == {t: (0, 0, 0) for t in TABLES}


def test_compare_under_pgbench_load_reports_no_false_difference(replica, spark):
    pgbench_init(replica.root, scale=2)
    replica.setup(list(PGBENCH_TABLES))
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync()
    load = pgbench(replica.root, "-c", "2", "-j", "2", "-T", "25", "-R", "400")
    try:
        time.sleep(2)
        for _ in range(2):
            res = compare(replica, spark, compare_segment_rows=50000)
            assert counts(res) == {f"public.{t}": (0, 0, 0) for t in PGBENCH_TABLES}
            assert res["public.pgbench_accounts"].rows == 200000
            assert res["public.pgbench_history"].rows > 0
    finally:
        load.wait(timeout=60)
    assert load.returncode == 0, load.stderr.read()
    # one planted difference is still found under load
    leaf_exec(replica, "update pgbench_accounts set filler = 'planted' where aid = 4242")
    res = compare(replica, spark, compare_segment_rows=50000)
    assert counts(res)["public.pgbench_accounts"] == (0, 0, 1)


def test_cli_compare_repair_and_count_only(synced_small, spark):
    """The verbs' exit codes and outputs.  `compare --json` runs as a process (what the JVM
    might print would break the JSON); the others run in this process, on the module's Spark
    session (a JVM each would double the time), through the same command line."""
    r = synced_small
    leaf_exec(r, "delete from comp where a = 35", "update words set note = 'changed' where w = 'wörd-3-ü€'")
    out = run_in_process(r.leaf_ini, "compare", "comp", "words", "--no-progress")
    assert out.returncode == 3, out.stderr
    assert "public.comp: rows 3000, missing 1, extra 0, different 0: DIFFERENT" in out.stdout
    assert "public.words: rows 2000, missing 0, extra 0, different 1: DIFFERENT" in out.stdout
    cnt = r.cli("leaf", "compare", "--count-only", check=False)
    assert cnt.returncode == 3 and "public.comp: provider 3000 rows, subscriber 2999 rows" in cnt.stdout
    js = r.cli("leaf", "compare", "comp", "--json", "--no-progress", check=False, timeout=300)
    assert js.returncode == 3, js.stderr
    (result,) = json.loads(js.stdout)
    samples = result.pop("samples")
    assert result == {
        "table": "public.comp",
        "dest": "public.comp",
        "rows": 3000,
        "sub_rows": 2999,
        "missing": 1,
        "extra": 0,
        "different": 0,
        "equal": False,
    }
    assert list(samples) == ["missing"] and [k[0] for k in samples["missing"]] == ["35"]  # key (a, b)
    fix = r.tmp / "fix.sql"
    rep = run_in_process(r.leaf_ini, "repair", "--output", str(fix))
    assert rep.returncode == 3, rep.stderr
    # the file is plain SQL a DBA can read and run with psql, worker stopped (as its header says)
    r.daemons.kill(r.daemons.procs[1])
    subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", str(fix), r.leaf.connstr], check=True)
    for t in SMALL_TABLES:
        assert table_checksum(r.root, t) == table_checksum(r.leaf, t), t
    # protection is back on after the file ran
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState), r.leaf.connect() as conn:
        conn.execute("delete from comp")


def test_sync_point_gives_up_when_the_worker_is_stopped(synced_small):
    r = synced_small
    r.daemons.kill(r.daemons.procs[1])  # the worker
    with r.root.connect() as conn:
        conn.execute("update comp set v = 'unapplied' where a = 7")
    r.ini("leaf", r.leaf, sync_timeout=2)
    started = time.monotonic()
    # the same sync point, no Spark; in this process, so that `took` is the sync point's wait and
    # not a process's start-up on a loaded host (14 s in a local run at load 14)
    out = run_in_process(r.leaf_ini, "compare", "--count-only", "--no-progress")
    took = time.monotonic() - started
    assert out.returncode == 1, out
    assert "did not catch up within 2 s" in out.stderr and "Traceback" not in out.stderr
    assert took < 10  # the configured 2 s, not the default 10 s
    # the lock is gone: the root takes writes at once
    with r.root.connect() as conn:
        conn.execute("set lock_timeout = '1s'")
        conn.execute("update comp set v = 'after' where a = 14")


def test_bad_input_is_one_line_and_locks_nothing(synced_small):
    r = synced_small
    cases = [
        (("compare", "nosuch"), {}, 2, "table 'nosuch' is not replicated here"),
        (("repair",), {}, 2, "repair needs --output FILE"),
        (
            ("compare",),
            {"jdbc_jar": "/nonexistent/postgresql.jar"},
            2,
            "JDBC driver not found at /nonexistent",
        ),
        (
            ("compare",),
            {"spark_remote": "sc://127.0.0.1:1"},
            1,
            "no Spark Connect server at sc://127.0.0.1:1",
        ),
        (("compare",), {"sync_timeout": "soon"}, 2, "sync_timeout = 'soon': must be a number of seconds"),
    ]
    for args, extra, code, message in cases:
        r.ini("leaf", r.leaf, **extra)
        out = (
            r.cli("leaf", *args, "--no-progress", check=False)
            if args[0] == "compare"
            else r.cli("leaf", *args, check=False)
        )
        assert out.returncode == code, (args, extra, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, extra, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # nothing was locked or left open on the root
    with r.root.connect() as conn:
        conn.execute("set lock_timeout = '1s'")
        conn.execute("update comp set v = 'after' where a = 14")
        assert (
            conn.execute(
                "select count(*) from pg_stat_activity where application_name like 'pgcascade compare%%'"
            ).fetchone()[0]
            == 0
        )


def test_current_state_is_the_last_change_per_key(spark):
    """The compaction's DataFrame function on an inline table: last change by (tick_id, ev_id)
    wins, a key whose last change is a delete is gone, a snapshot row without changes stays."""
    from pgcascade.pipeline.sink import current_state

    rows = [
        # op, tick_id, ev_id, txid, ev_time, commit_time, id, v
        ("S", 10, 0, None, None, None, 1, "a0"),
        ("S", 10, 0, None, None, None, 2, "b0"),
        ("S", 10, 0, None, None, None, 3, "c0"),
        ("U", 11, 5, 100, None, None, 1, "a1"),
        ("U", 12, 9, 101, None, None, 1, "a2"),
        ("U", 12, 7, 101, None, None, 1, "a-older-event"),
        ("D", 11, 6, 100, None, None, 2, "b0"),
        ("I", 12, 8, 101, None, None, 4, "d1"),
        ("D", 12, 10, 102, None, None, 4, "d1"),
        ("I", 13, 11, 103, None, None, 4, "d2"),
    ]
    schema = "op string, tick_id long, ev_id long, txid long, ev_time timestamp, commit_time timestamp, id int, v string"
    got = sorted(tuple(r) for r in current_state(spark.createDataFrame(rows, schema), ["id"]).collect())
    assert got == [(1, "a2"), (3, "c0"), (4, "d2")]


def test_diff_keys_classifies_each_key():
    from pgcascade.pipeline.compare import diff_keys

    prov = {("1",): 10, ("2",): 20, ("3",): 30}
    sub = {("2",): 20, ("3",): 31, ("4",): 40}
    assert sorted(diff_keys(prov, sub)) == [(("1",), "missing"), (("3",), "different"), (("4",), "extra")]


def test_repair_on_a_branch_reaches_the_leaf_below(cascade, make_db, spark, capsys):
    """root -> branch -> leaf with the same drift planted on the branch and the leaf, pgbench
    writing on the root: `repair --apply` on the branch leaves both equal to the root, and
    `compare` on the leaf exits 0 (the fix travelled through the queue).  The verbs' own code
    runs in this process, on the module's Spark session (a JVM each would double the time)."""
    c = cascade
    for name, cl in (("root", "a"), ("branch", "b"), ("leaf", "a")):
        c.node(name, make_db(cl), sync_timeout=60)  # a loaded machine: the sync point may wait long
    c.pgbench_root("root")
    c.create("branch", "branch", "root")
    c.create("leaf", "leaf", "branch")
    for n in ("branch", "leaf"):
        c.run(n, "add-table", "--all", "--create")
    c.start_all("root", "branch", "leaf")
    c.sync("root", ["branch"])
    c.sync("root", ["leaf"])
    drift = (
        "delete from pgbench_accounts where aid between 11 and 15",  # missing
        "update pgbench_accounts set filler = 'drift' where aid between 21 and 25",  # different
        "insert into pgbench_history (hid, tid, bid, aid, delta) values (1000000001, 1, 1, 1, 7)",  # extra
        "update pgbench_branches set filler = 'drift'",
    )
    for n in ("branch", "leaf"):
        with c.dbs[n].connect() as conn:
            conn.execute("set session_replication_role = replica")  # past the protection trigger
            for s in drift:
                conn.execute(s)
    assert table_checksum(c.dbs["leaf"], "pgbench_accounts") != table_checksum(
        c.dbs["root"], "pgbench_accounts"
    )
    load = pgbench(c.dbs["root"], "-c", "2", "-j", "2", "-T", "15", "-R", "50")
    try:
        assert commands.repair(load_config(c.ini("branch")), [], None, True, progress=False) == 0
        assert "DIFFERENT" in capsys.readouterr().out  # the compare saw the drift
    finally:
        assert load.wait(timeout=60) == 0, load.stderr.read()
    c.sync("root", ["branch"])
    c.sync("root", ["leaf"])
    for n in ("branch", "leaf"):
        c.assert_equal("root", n)
    assert commands.compare(load_config(c.ini("leaf")), [], progress=False) == 0
    assert "DIFFERENT" not in capsys.readouterr().out


# --- part of a table (add-table --where --columns), a partitioned table --------------------------------

ORDERS = "public.orders"
EVENTS = "public.events"
EU_COLUMNS = "select id, region, amount from orders where region = 'eu'"
SUBSET_ROOT = [
    "create table orders (id int primary key, region text not null, amount numeric, secret text)",
    "insert into orders select i, (array['eu', 'us', 'asia'])[1 + i % 3], i * 1.5, 'pii ' || i"
    " from generate_series(1, 3000) i",
    # partitioned by range on the root...
    "create table events (id int, at int, kind text not null, v text, primary key (id, at)) partition by range (at)",
    "create table events_p0 partition of events for values from (0) to (1000)",
    "create table events_p1 partition of events for values from (1000) to (5000)",
    "insert into events select i, i, (array['a', 'b', 'c'])[1 + i % 3], 'v' || i from generate_series(1, 3000) i",
    "analyze orders, events",
]
# ... by list on the leaf (which then cannot have a unique index on the root's key)
SUBSET_LEAF = [
    "create table events (id int not null, at int not null, kind text not null, v text,"
    " primary key (id, at, kind)) partition by list (kind)",
    "create table events_a partition of events for values in ('a')",
    "create table events_rest partition of events default",
    "create index on events (id, at)",
]


def spark_copy_in_process(replica, table: str) -> None:
    """The in-copy step of `table` as its copy process runs it, here, on the module's Spark (a
    copy process would start a Spark of its own); the worker's copy process catches up."""
    from pgcascade.pipeline.copy import SparkCopier
    from pgcascade.replica.copy import CopyProcess
    from pgcascade.replica.state import Phase
    from pgcascade.replica.tables import get_table

    cfg = load_config(replica.leaf_ini)
    with replica.leaf.connect() as conn:  # the worker's step: NULL -> in-copy
        conn.execute(
            "update pgcascade.subscriber_table set state = 'in-copy' where table_name = %s", (table,)
        )
        proc = CopyProcess(cfg, table, bulk=SparkCopier())
        try:
            for _ in range(5):
                proc.work()
                if get_table(conn, cfg.queue_name, table).state.phase is not Phase.IN_COPY:
                    break
        finally:
            proc.drop_connections()
        assert get_table(conn, cfg.queue_name, table).state.phase is Phase.CATCHING_UP
        assert conn.execute(
            "select count(*) > 1 and bool_and(done) from pgcascade.copy_range where table_name = %s", (table,)
        ).fetchone()[0], "not copied in Spark ranges"


def test_filtered_and_partitioned_tables_spark_copy_compare_and_repair(replica, spark):
    """A leaf holding the root's EU orders without their personal column, and a table partitioned
    by range on the root and by list on the leaf: both Spark-copied, compared clean after rows
    moved in and out of the filter and between partitions, a planted drift found and repaired."""
    r = replica
    with r.root.connect() as conn:
        for statement in SUBSET_ROOT:
            conn.execute(statement)
    with r.leaf.connect() as conn:
        for statement in SUBSET_LEAF:
            conn.execute(statement)
    r.ini(
        "leaf",
        r.leaf,
        spark_copy_min_rows=1,
        spark_copy_streams=1,
        spark_copy_range_rows=1000,
        spark_master="local[2]",
    )
    r.setup()
    r.cli("root", "add-table", ORDERS, EVENTS)
    r.cli(
        "leaf", "add-table", ORDERS, "--where", "region = 'eu'", "--columns", "id,region,amount", "--create"
    )
    r.cli("leaf", "add-table", EVENTS)
    spark_copy_in_process(r, ORDERS)
    spark_copy_in_process(r, EVENTS)
    r.start_ticker()
    r.start_worker()
    with r.root.connect() as conn:
        conn.execute("update orders set region = 'us' where region = 'eu' and id % 5 = 0")
        conn.execute("update orders set region = 'eu', amount = -1 where region = 'asia' and id % 4 = 0")
        conn.execute(
            "update events set at = at + 2000, kind = 'a' where id % 7 = 0"
        )  # partitions on both sides
        conn.execute("delete from events_p0 where id % 11 = 0")
    r.wait_sync()
    assert checksum(r.leaf, "select * from orders") == checksum(r.root, EU_COLUMNS)
    assert table_checksum(r.leaf, EVENTS) == table_checksum(r.root, EVENTS)
    assert counts(compare(r, spark, compare_segment_rows=500)) == {ORDERS: (0, 0, 0), EVENTS: (0, 0, 0)}
    leaf_exec(
        r,
        "delete from orders where id = 3",  # missing
        "insert into orders values (4, 'us', 1)",  # extra: the root has it, but not in the filter
        "update orders set amount = 0 where id = 6",  # different
        "delete from events where id = 2",
        "update events set kind = 'b', v = 'moved' where id = 10",  # into another partition here
    )
    cfg = load_config(r.leaf_ini)
    spool = KeySpool()
    with Comparison(cfg, []) as cmp:
        results = cmp.run(spark, spool.write)
        specs = cmp.ctx.specs
    assert counts({x.spec.table: x for x in results}) == {ORDERS: (1, 1, 1), EVENTS: (1, 0, 1)}
    apply_fix(cfg.db, cfg.queue_name, specs, spool, timeout=10)
    assert checksum(r.leaf, "select * from orders") == checksum(r.root, EU_COLUMNS)
    assert table_checksum(r.leaf, EVENTS) == table_checksum(r.root, EVENTS)
    # as a user runs it: clean, exit 0
    out = r.cli("leaf", "compare", "--no-progress", timeout=300)
    eu = r.root.scalar("select count(*) from orders where region = 'eu'")  # the rows the leaf holds
    assert f"{ORDERS}: rows {eu}, missing 0, extra 0, different 0: ok" in out.stdout, out.stdout
    n = r.root.scalar("select count(*) from events")
    assert f"{EVENTS}: rows {n}, missing 0, extra 0, different 0: ok" in out.stdout, out.stdout


def test_repair_on_a_two_way_master_reaches_its_leaf(two_way, make_db, tmp_path, spark, capsys):
    """Masters a and b, a leaf under a, the same drift planted on a and on the leaf (uncaptured,
    unprotected): `repair --apply` on a, against its peer b, leaves a, b and the leaf
    equal - a's own capture sent the fix on - and `compare` on the leaf exits 0."""
    a, b = (two_way.add_master(n, make_db(n)) for n in ("a", "b"))
    for m in (a, b):
        make_tables(m, "accounts")
        m.execute("insert into accounts select i, i, 'seed' from generate_series(1, 500) i")
        m.run("add-table", "accounts")
    two_way.connect_all()
    leaf_db = make_db("b")
    leaf_ini = tmp_path / "leaf.ini"
    leaf_ini.write_text(
        f"[pgcascade]\njob_name = leaf\ndb = {leaf_db.connstr}\nqueue_name = tw_a\n"
        f"logfile = {tmp_path}/leaf.log\npidfile = {tmp_path}/leaf.pid\nloop_delay = 0.2\n"
    )
    for args in (("create-leaf", "leaf", "--provider", a.db.connstr), ("add-table", "accounts", "--create")):
        r = run_cli(str(leaf_ini), *args)
        assert r.returncode == 0, r.stderr
    two_way.start()
    two_way.daemons.start(str(leaf_ini), "worker")
    a.execute("update accounts set balance = balance + 1 where id <= 50")  # a change that travels
    a.run("wait-sync", "--timeout", "120")
    assert run_cli(str(leaf_ini), "wait-sync", "--timeout", "120").returncode == 0
    drift = (
        "delete from accounts where id between 11 and 15",
        "update accounts set note = 'drift' where id between 21 and 25",
        "insert into accounts values (100001, 7, 'extra')",
    )
    with a.db.connect() as conn, conn.transaction():  # a master captures in replica mode too
        conn.execute("alter table accounts disable trigger user")
        for s in drift:
            conn.execute(s)
        conn.execute("alter table accounts enable trigger user")
    with leaf_db.connect() as conn:
        conn.execute("set session_replication_role = replica")  # past the protection trigger
        for s in drift:
            conn.execute(s)
    assert table_checksum(leaf_db, "accounts") != table_checksum(b.db, "accounts")
    # the repair's config: master a, reading its peer b's queue (b is the provider it compares with)
    repair_ini = tmp_path / "a_from_b.ini"
    repair_ini.write_text(a.ini.read_text().replace("queue_name = tw_a", "queue_name = tw_b"))
    assert commands.repair(load_config(repair_ini), [], None, True, progress=False) == 0
    assert "DIFFERENT" in capsys.readouterr().out
    a.run("wait-sync", "--timeout", "120")
    assert run_cli(str(leaf_ini), "wait-sync", "--timeout", "120").returncode == 0
    want = table_checksum(b.db, "accounts")
    assert table_checksum(a.db, "accounts") == want
    assert table_checksum(leaf_db, "accounts") == want
    assert commands.compare(load_config(leaf_ini), [], progress=False) == 0
    assert "DIFFERENT" not in capsys.readouterr().out
