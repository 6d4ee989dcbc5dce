"""The demo: a cascade on throwaway clusters, under a pgbench workload, with live status.

Three clusters: a root with the pgbench tables, a branch fed by the root (it replicates the
tables and carries the queue), and a leaf fed by the branch.  Tickers and workers run as real
daemons.  Two tables are replicated from the start; while pgbench runs, the other two are added
on every node (their initial copies and hand-overs happen under load, the leaf's after the
branch's).  `serve` runs beside them: the live page of the set is printed as a URL.  At the
end the demo checks, with its own query on each side, that every table on the branch and the
leaf equals the root's.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from pgcascade.core import pgconn
from pgcascade.core.errors import RuntimeFailure
from pgcascade.core.pgconn import one, scalar
from pgcascade.dev.localcluster import LocalCluster, new_cluster, pg_bindir
from pgcascade.monitor.status import set_tree
from pgcascade.replica import tables as subscriber

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


def status_view(conns: dict[str, psycopg.Connection], elapsed: float, note: str) -> Group:
    t = Table(title="rows per table and its state on each subscriber")
    for col in ("table", "root", "branch1", "leaf1"):
        t.add_column(col, justify="left" if col == "table" else "right")
    states = {
        name: {st.table_name: str(st.state) for st in subscriber.tables(conns[name], QUEUE)}
        for name in ("branch1", "leaf1")
    }
    for table in FIRST + LATER:
        row = [table]
        for name, conn in conns.items():
            exists = scalar(conn, "select to_regclass(%s) is not null", (table,))
            n = scalar(conn, f"select count(*) from {table}") if exists else "-"
            state = "" if name == "root" else f" ({states[name].get('public.' + table, 'not added')})"
            row.append(f"{n}{state}")
        t.add_row(*row)
    return Group(f"[bold]{elapsed:4.0f}s[/bold]  {note}", set_tree(conns["leaf1"], QUEUE), t)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_page(console: Console, leaf_ini: Path, port: int | None, procs: list[subprocess.Popen]) -> None:
    """`serve` on the leaf's ini (it reads every member): the set's live page, when the port is free."""
    if port is None:
        return
    if not port_free(port):
        console.print(f"live page: port {port} is taken (demo --serve-port N picks another)")
        return
    args = [str(leaf_ini), "serve", "--port", str(port)]
    procs.append(subprocess.Popen([sys.executable, "-m", "pgcascade", "-q", *args]))
    console.print(f"live page of the set: [bold]http://127.0.0.1:{port}/[/bold] (while the demo runs)")


def run_demo(seconds: float = 30.0, keep: bool = False, serve_port: int | None = 8432) -> None:
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="pgcascade-demo-"))
    console.print(f"[bold]pgcascade demo[/bold]: root, branch and leaf clusters in {work}")
    clusters: dict[str, LocalCluster] = {}
    dbs: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    passed = False
    try:
        for name in ("root", "branch1", "leaf1"):  # one at a time: a failed start stops those before it
            clusters[name] = new_cluster(name, basedir=work / "clusters")
            dbs[name] = clusters[name].create_database("shop")
        ini = build_cascade(work, dbs, procs)
        start_page(console, ini["leaf1"], serve_port, procs)
        load = start_pgbench(dbs["root"], seconds)
        watch_until_in_sync(console, dbs, ini, load, seconds)
        passed = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(timeout=30)
        if keep:
            console.print(
                f"clusters left running: {', '.join(f'{n} {db!r}' for n, db in dbs.items())}; configs in {work}"
            )
        else:
            for cluster in clusters.values():
                cluster.destroy()
            clean_up(console, work, passed)


def clean_up(console: Console, work: Path, passed: bool) -> None:
    """A demo's directory (configs, daemons' logs) once its clusters are gone: removed after a
    passed check, kept to be read after a failure."""
    if passed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        console.print(f"the daemons' configs and logs are kept in {work}")


def build_cascade(work: Path, dbs: dict[str, str], procs: list[subprocess.Popen]) -> dict[str, Path]:
    """pgbench's tables on the root, a branch and a leaf below it, FIRST replicated, the tickers
    and workers running (their processes added to `procs`); returns each node's ini."""
    subprocess.run(
        [str(pg_bindir() / "pgbench"), "-i", "-q", "-s", "2", dbs["root"]], check=True, capture_output=True
    )
    with pgconn.connect(dbs["root"], autocommit=True) as c:
        c.execute("alter table pgbench_history add column hid bigserial primary key")
    ini = {name: write_ini(work / f"{name}.ini", name, db, loop_delay=0.5) for name, db in dbs.items()}
    tickers = {n: write_ini(work / f"ticker_{n}.ini", f"ticker_{n}", dbs[n]) for n in ("root", "branch1")}
    pgcascade(str(ini["root"]), "create-root", "root")
    pgcascade(str(ini["root"]), "add-table", *FIRST)
    pgcascade(str(ini["branch1"]), "create-branch", "branch1", "--provider", dbs["root"])
    pgcascade(str(ini["leaf1"]), "create-leaf", "leaf1", "--provider", dbs["branch1"])
    for n in ("branch1", "leaf1"):
        pgcascade(str(ini[n]), "add-table", *FIRST, "--create")
    daemons = [("ticker", str(tickers[n])) for n in ("root", "branch1")]
    daemons += [(str(ini[n]), "worker") for n in ("branch1", "leaf1")]
    for args in daemons:
        procs.append(subprocess.Popen([sys.executable, "-m", "pgcascade", "-q", *args]))
    return ini


def start_pgbench(db: str, seconds: float) -> subprocess.Popen:
    """TPC-B at 300 transactions a second for `seconds`."""
    cmd = [str(pg_bindir() / "pgbench"), "-n", "-c", "2", "-j", "2", "-R", "300", "-T", str(int(seconds)), db]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def watch_until_in_sync(
    console: Console, dbs: dict[str, str], ini: dict[str, Path], load: subprocess.Popen, seconds: float
) -> None:
    """The live view while pgbench runs (LATER is added on every node a third of the way in),
    then wait-sync on the branch and the leaf, and the final check."""
    started = time.monotonic()
    note = f"pgbench at 300 tps on the root; replicating {', '.join(FIRST)}"
    added = False
    with contextlib.ExitStack() as stack:
        conns = {n: stack.enter_context(pgconn.connect(db, autocommit=True)) for n, db in dbs.items()}
        live = stack.enter_context(Live(console=console, refresh_per_second=2))
        while load.poll() is None:
            elapsed = time.monotonic() - started
            if not added and elapsed > seconds / 3:
                pgcascade(str(ini["root"]), "add-table", *LATER)
                for n in ("branch1", "leaf1"):
                    pgcascade(str(ini[n]), "add-table", *LATER, "--create")
                note = f"pgbench at 300 tps; added {', '.join(LATER)} on every node under load"
                added = True
            live.update(status_view(conns, elapsed, note))
            time.sleep(0.5)
        if load.returncode != 0:
            err = load.stderr.read().decode().strip() if load.stderr else ""
            raise RuntimeFailure(f"pgbench failed: {err}")
        live.update(status_view(conns, time.monotonic() - started, "pgbench done; waiting for sync"))
        for n in ("branch1", "leaf1"):
            pgcascade(str(ini[n]), "wait-sync", "--timeout", "120")
        live.update(status_view(conns, time.monotonic() - started, "in sync"))
        check_equal(console, conns)


def check_equal(console: Console, conns: dict[str, psycopg.Connection]) -> None:
    result = Table(title="check: count and md5 of every row, computed on each node")
    for col in ("table", "rows", "root md5", "branch1 md5", "leaf1 md5", ""):
        result.add_column(col)
    differ = []
    for t in FIRST + LATER:
        sums = {n: one(c, CHECKSUM.format(t)) for n, c in conns.items()}
        same = len(set(sums.values())) == 1
        differ += [] if same else [t]
        result.add_row(
            t,
            str(sums["root"][0]),
            *(sums[n][1][:12] for n in conns),
            "[green]equal[/green]" if same else "[red]DIFFERS[/red]",
        )
    console.print(result)
    if differ:
        raise RuntimeFailure(f"demo check FAILED: {', '.join(differ)} differ")
    console.print("[green]check passed[/green]: the branch and the leaf equal the root")
