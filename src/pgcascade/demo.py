"""The demo: replication between throwaway clusters, under a pgbench workload, with live status.

Two clusters (root and leaf), pgbench tables on the root, the ticker and the leaf's worker as
real daemons.  Two tables are replicated from the start; while pgbench runs, the other two
are added (their initial copy and hand-over happen under load).  At the end the demo checks,
with its own query on both sides, that every table is equal.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from pgcascade import node as nodes
from pgcascade import subscriber
from pgcascade.errors import RuntimeFailure
from pgcascade.localcluster import new_cluster, pg_bindir
from pgcascade.status import fmt_interval, node_lag, queue_tables

QUEUE = "demo_set"
FIRST = ["pgbench_accounts", "pgbench_branches"]
LATER = ["pgbench_tellers", "pgbench_history"]
CHECKSUM = "select count(*), md5(string_agg(t::text, E'\\n' order by t::text)) from {} t"


def write_ini(path: Path, job: str, db: str, **extra: object) -> Path:
    lines = ["[pgcascade]", f"job_name = {job}", f"db = {db}", f"queue_name = {QUEUE}"]
    lines += [f"logfile = {path.parent}/{job}.log", f"pidfile = {path.parent}/{job}.pid"]
    lines += [f"{k} = {v}" for k, v in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def pgcascade(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pgcascade", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeFailure(f"pgcascade {' '.join(args)}: {r.stderr.strip()}")


def status_view(root: psycopg.Connection, leaf: psycopg.Connection, elapsed: float, note: str) -> Group:
    node = nodes.require_node(leaf, QUEUE)
    lag = node_lag(leaf, root, node)
    t = Table(
        title=f"leaf {node.node_name}: lag {fmt_interval(lag['lag'])}, {lag['ticks_behind']} ticks behind"
    )
    t.add_column("table")
    t.add_column("state")
    t.add_column("rows on root", justify="right")
    t.add_column("rows on leaf", justify="right")
    for st in subscriber.tables(leaf, QUEUE):
        n_root = root.execute(f"select count(*) from {st.table_name}").fetchone()[0]
        n_leaf = leaf.execute(f"select count(*) from {st.dest_table}").fetchone()[0]
        t.add_row(st.table_name, st.state or "NULL", str(n_root), str(n_leaf))
    return Group(f"[bold]{elapsed:4.0f}s[/bold]  {note}", queue_tables(root), t)


def run_demo(seconds: float = 30.0, keep: bool = False) -> None:
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="pgcascade-demo-"))
    console.print(f"[bold]pgcascade demo[/bold]: root and leaf clusters in {work}")
    root_cl = new_cluster("root", basedir=work / "clusters")
    leaf_cl = new_cluster("leaf", basedir=work / "clusters")
    root_db, leaf_db = root_cl.create_database("shop"), leaf_cl.create_database("shop_copy")
    procs: list[subprocess.Popen] = []
    try:
        subprocess.run(
            [str(pg_bindir() / "pgbench"), "-i", "-q", "-s", "2", root_db], check=True, capture_output=True
        )
        with psycopg.connect(root_db, autocommit=True) as c:
            c.execute("alter table pgbench_history add column hid bigserial primary key")
        root_ini = write_ini(work / "root.ini", "root", root_db)
        leaf_ini = write_ini(work / "leaf.ini", "leaf", leaf_db)
        ticker_ini = write_ini(work / "ticker.ini", "ticker", root_db)
        pgcascade(str(root_ini), "create-root", "root")
        pgcascade(str(root_ini), "add-table", *FIRST)
        pgcascade(str(leaf_ini), "create-leaf", "leaf1", "--provider", root_db)
        pgcascade(str(leaf_ini), "add-table", *FIRST, "--create")
        procs.append(subprocess.Popen([sys.executable, "-m", "pgcascade", "-q", "ticker", str(ticker_ini)]))
        procs.append(subprocess.Popen([sys.executable, "-m", "pgcascade", "-q", str(leaf_ini), "worker"]))
        load = subprocess.Popen(
            [
                str(pg_bindir() / "pgbench"),
                "-n",
                "-c",
                "2",
                "-j",
                "2",
                "-R",
                "300",
                "-T",
                str(int(seconds)),
                root_db,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        started = time.monotonic()
        note = f"pgbench at 300 tps; replicating {', '.join(FIRST)}"
        added = False
        with (
            psycopg.connect(root_db, autocommit=True) as root,
            psycopg.connect(leaf_db, autocommit=True) as leaf,
            Live(console=console, refresh_per_second=2) as live,
        ):
            while load.poll() is None:
                elapsed = time.monotonic() - started
                if not added and elapsed > seconds / 3:
                    pgcascade(str(root_ini), "add-table", *LATER)
                    pgcascade(str(leaf_ini), "add-table", *LATER, "--create")
                    note = f"pgbench at 300 tps; added {', '.join(LATER)} under load"
                    added = True
                live.update(status_view(root, leaf, elapsed, note))
                time.sleep(0.5)
            if load.returncode != 0:
                raise RuntimeFailure(f"pgbench failed: {load.stderr.read().decode().strip()}")
            live.update(status_view(root, leaf, time.monotonic() - started, "pgbench done; waiting for sync"))
            pgcascade(str(leaf_ini), "wait-sync", "--timeout", "120")
            live.update(status_view(root, leaf, time.monotonic() - started, "in sync"))
            check_equal(console, root, leaf)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(timeout=30)
        if keep:
            console.print(f"clusters left running: root '{root_db}', leaf '{leaf_db}'; configs in {work}")
        else:
            root_cl.destroy()
            leaf_cl.destroy()


def check_equal(console: Console, root: psycopg.Connection, leaf: psycopg.Connection) -> None:
    result = Table(title="check: count and md5 of every row, computed on each side")
    for col in ("table", "rows", "root md5", "leaf md5", ""):
        result.add_column(col)
    differ = []
    for t in FIRST + LATER:
        r = root.execute(CHECKSUM.format(t)).fetchone()
        s = leaf.execute(CHECKSUM.format(t)).fetchone()
        same = r == s
        differ += [] if same else [t]
        result.add_row(
            t, str(r[0]), r[1][:12], s[1][:12], "[green]equal[/green]" if same else "[red]DIFFERS[/red]"
        )
    console.print(result)
    if differ:
        raise RuntimeFailure(f"demo check FAILED: {', '.join(differ)} differ")
    console.print("[green]check passed[/green]: the leaf equals the root")
