"""The resumable Spark copy inside the copy state machine, under load, SIGKILLed halfway.

"No range copied twice" is checked by an ENABLE ALWAYS statement trigger on the leaf's table
that adds up the rows every committed INSERT/COPY put in: a range copied again would count
its rows twice.  Equality is an md5 of every row on both sides, computed by PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from test_replication import PGBENCH_TABLES, pgbench, pgbench_init

from pgcascade.dev.localcluster import wait_until

ACCOUNTS = "public.pgbench_accounts"


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def ranges(leaf) -> list[tuple]:
    with leaf.connect() as conn:
        return conn.execute(
            "select range_no, done, done_at, attempt from pgcascade.copy_range where table_name = %s order by 1",
            (ACCOUNTS,),
        ).fetchall()


def test_spark_copy_killed_halfway_resumes_with_the_ranges_not_done(replica):
    from conftest import table_checksum

    r = replica
    pgbench_init(r.root, scale=20)  # 2,000,000 accounts
    r.ini(
        "leaf",
        r.leaf,
        parallel_copies=2,
        spark_copy_min_rows=1000000,
        spark_copy_range_rows=100000,
        spark_copy_streams=1,  # on a host under 4 cores the pipe copies unless streams are set
        spark_master="local[2]",
    )
    r.setup(list(PGBENCH_TABLES))
    with r.leaf.connect() as conn:
        conn.execute("create table copy_audit (n int8)")
        conn.execute(
            "create function audit_rows() returns trigger language plpgsql as $$"
            " begin insert into copy_audit select count(*) from new_rows; return null; end $$"
        )
        conn.execute(
            "create trigger audit after insert on pgbench_accounts referencing new table as new_rows"
            " for each statement execute function audit_rows()"
        )
        conn.execute("alter table pgbench_accounts enable always trigger audit")
    r.start_ticker()
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "35", "-R", "100")
    worker = r.start_worker()

    def halfway() -> bool:
        rs = ranges(r.leaf)
        done = sum(1 for x in rs if x[1])
        return 3 <= done < len(rs) - 3

    wait_until(halfway, 180, what="a Spark copy with some ranges done and some not")

    def range_in_flight() -> dict | None:
        """The copy as `status --json` shows it, once a range in flight has copied rows."""
        copies = json.loads(r.cli("leaf", "status", "--json").stdout)["copies"]
        (c,) = [c for c in copies if c["table"] == ACCOUNTS]
        return c if any(f["rows"] > 0 and f["eta"] is not None for f in c["ranges_in_flight"]) else None

    # the snapshot that satisfied the wait: a second look may fall between two ranges
    c = wait_until(range_in_flight, 30, interval=0.2, what="a range in flight with rows in status --json")
    # rows_total is PostgreSQL's estimate (reltuples, from a sample): near 2,000,000, not exact
    assert c["method"] == "spark" and c["step"] == "copying" and abs(c["rows_total"] - 2_000_000) < 40_000, c
    assert c["ranges"] >= 10 and c["ranges_done"] < c["ranges"] and 0 < c["percent"] < 100, c
    assert c["eta"] is not None and c["eta"] > 0 and c["rows_per_s"] > 0, c
    for f in c["ranges_in_flight"]:
        assert f["rows_total"] == c["rows_total"] // c["ranges"] and f["rows"] <= f["rows_total"] * 1.5, f
    with r.leaf.connect() as conn:
        copy_pid = conn.execute(
            "select copy_pid from pgcascade.subscriber_table where table_name = %s", (ACCOUNTS,)
        ).fetchone()[0]
    jvms = children_of(copy_pid)
    r.daemons.kill(worker)
    os.kill(copy_pid, signal.SIGKILL)
    before = {n: (done_at, attempt) for n, done, done_at, attempt in ranges(r.leaf) if done}
    status = r.cli("leaf", "status").stdout
    assert "copy public.pgbench_accounts (spark, " in status and " ranges, " in status, status
    # the Spark JVM and its Python workers go with the copy process that ran them
    wait_until(lambda: not any(alive(p) for p in jvms), 30, what="the killed copy's Spark JVM to exit")

    r.start_worker()
    assert load.wait(timeout=150) == 0, load.stderr.read()
    r.wait_sync(timeout=300)
    for t in PGBENCH_TABLES:
        assert table_checksum(r.root, t) == table_checksum(r.leaf, t), t
    after = ranges(r.leaf)
    assert all(done for _, done, _, _ in after)
    for n, done_at, attempt in ((n, d, a) for n, _, d, a in after if n in before):
        assert (done_at, attempt) == before[n], f"range {n} was copied again"
    # attempt 1 copied until the kill, attempt 2 the rest: no attempt failed and retried
    assert {a for *_, a in after} == {1, 2}, f"attempts {sorted({a for *_, a in after})}"
    with r.leaf.connect() as conn:
        inserted = conn.execute("select coalesce(sum(n), 0) from copy_audit").fetchone()[0]
        rows = conn.execute("select count(*) from pgbench_accounts").fetchone()[0]
    assert rows == 2_000_000
    assert inserted == rows, f"{inserted} rows inserted for {rows}: some range was copied twice"
    log = r.log()
    assert "spark copy attempt 2" in log and "ETA" in log
