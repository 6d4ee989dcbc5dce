"""The Parquet lake sink: SIGKILLed mid-batch under pgbench, then compaction.

The lake is read back with pyarrow (not with the sink's code) and checked against the root:
every change event of the queue appears exactly once, and the compacted state of each table
equals the root's rows.
"""

from __future__ import annotations

import re
from collections import Counter

import pyarrow.dataset as ds
from test_replication import PGBENCH_TABLES, pgbench, pgbench_init

from pgcascade.dev.localcluster import wait_until

KEYS = {
    "pgbench_accounts": "aid",
    "pgbench_branches": "bid",
    "pgbench_tellers": "tid",
    "pgbench_history": "hid",
}


def lake_rows(path, table: str, columns: list[str]) -> list[dict]:
    files = [str(p) for p in (path / f"public.{table}").glob("tick_id=*/*.parquet")]
    return ds.dataset(files, format="parquet").to_table(columns=columns).to_pylist() if files else []


def test_sink_killed_mid_batch_writes_each_change_once_and_compacts_to_the_root(
    replica, write_config, tmp_path
):
    r = replica
    pgbench_init(r.root, scale=1)
    r.cli("root", "create-root", "root")
    r.cli("root", "add-table", *PGBENCH_TABLES)
    lake = tmp_path / "lake"
    ini = write_config("lake", db=r.root.connstr, queue_name=r.queue, spark_master="local[2]")
    r.start_ticker()
    pause = {"PGCASCADE_PAUSE_AT": "sink-table-written", "PGCASCADE_PAUSE_SECONDS": "120"}
    sink = r.daemons.start(str(ini), "sink", "--path", str(lake), env=pause)
    wait_until(lambda: (lake / "_sink.json").exists(), 60, what="the sink's initial snapshot")
    load = pgbench(r.root, "-c", "2", "-j", "2", "-T", "8", "-R", "300")
    wait_until(
        lambda: "pause point sink-table-written" in sink.output(), 60, what="the sink paused mid-batch"
    )
    r.daemons.kill(sink)  # SIGKILL: one table of the batch is in place, the batch is not finished
    assert re.search(r"tick \d+: \d+ changes", sink.output())
    r.daemons.start(str(ini), "sink", "--path", str(lake))
    assert load.wait(timeout=60) == 0, load.stderr.read()
    with r.root.connect() as conn:
        target = conn.execute("select pgcascade.ticker(%s)", (r.queue,)).fetchone()[0]

        def caught_up() -> bool:
            last = conn.execute(
                "select last_tick from pgcascade.get_consumer_info(%s, 'lake')", (r.queue,)
            ).fetchone()[0]
            return last >= target

        wait_until(caught_up, 60, what="the sink to reach the last tick")
        events = {
            t: Counter(
                ev
                for (ev,) in conn.execute(
                    "select ev_id from pgcascade.event where ev_extra1 = %s and ev_type in ('I', 'U', 'D')",
                    (f"public.{t}",),
                )
            )
            for t in PGBENCH_TABLES
        }
    assert sum(events["pgbench_history"].values()) > 100
    for t in PGBENCH_TABLES:
        changes = [x for x in lake_rows(lake, t, ["op", "ev_id"]) if x["op"] != "S"]
        assert Counter(x["ev_id"] for x in changes) == events[t], f"{t}: changes missing or written twice"
    assert not list(lake.glob("*/_tmp.*")), "a staged directory was left behind"

    out = r.cli("lake", "sink", "compact", "--path", str(lake), timeout=300)
    assert "public.pgbench_accounts: 100000 rows" in out.stdout, out.stdout
    with r.root.connect() as conn:
        for t, key in KEYS.items():
            cols = [
                c
                for (c,) in conn.execute(
                    "select attname::text from pg_attribute where attrelid = %s::regclass and attnum > 0"
                    " and not attisdropped order by attnum",
                    (t,),
                )
            ]
            root_rows = conn.execute(
                f"select {', '.join(c + '::text' for c in cols)} from {t} order by {t}.{key}"
            ).fetchall()
            current = (
                ds.dataset(str(lake / "_current" / f"public.{t}"), format="parquet").to_table().to_pylist()
            )
            current.sort(key=lambda x: x[key])
            as_text = [tuple(None if x[c] is None else _text(x[c]) for c in cols) for x in current]
            assert as_text == root_rows, f"{t}: compacted state differs from the root"


def _text(v) -> str:
    """Python value -> PostgreSQL's text output, for the types of the pgbench tables."""
    if hasattr(v, "isoformat"):
        text = v.isoformat(sep=" ").replace("+00:00", "+00")
        return re.sub(r"(\.\d*?)0+\b", r"\1", text).replace(". ", " ").rstrip(".")  # PG drops trailing zeros
    return str(v)
