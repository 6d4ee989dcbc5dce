"""What `status` prints: the set's tree, this node's lag, tables per state, queues and
consumers, capture and copy progress, as rich tables.  Read-only: every figure comes from the
package that owns it."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from rich.console import Console, Group
from rich.table import Table
from rich.tree import Tree

from pgcascade.capture import ddl
from pgcascade.capture import logical as walcapture
from pgcascade.cascade.survey import Member, tree_rows
from pgcascade.monitor import report
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.node import Node


def fmt_interval(td: timedelta | None) -> str:
    return report.human(None if td is None else td.total_seconds())


def queue_tables(conn: psycopg.Connection) -> Group:
    queues = Table(title="queues", title_justify="left")
    for col in ("queue", "last tick", "ticker lag", "events waiting", "events/s", "table", "consumers"):
        queues.add_column(col, justify="left" if col == "queue" else "right")
    for r in q.queue_info(conn):
        flags = (
            " (paused)"
            if r["queue_ticker_paused"]
            else " (external ticks)"
            if r["queue_external_ticker"]
            else ""
        )
        queues.add_row(
            r["queue_name"] + flags,
            str(r["last_tick_id"]),
            fmt_interval(r["ticker_lag"]),
            str(r["ev_new"]),
            f"{r['ev_per_sec']:.0f}" if r["ev_per_sec"] is not None else "-",
            f"{r['queue_cur_table'] + 1}/{r['queue_ntables']}",
            str(r["consumers"]),
        )
    consumers = Table(title="consumers", title_justify="left")
    for col in ("queue", "consumer", "lag", "last seen", "last tick", "open batch", "pending events"):
        consumers.add_column(col, justify="left" if col in ("queue", "consumer") else "right")
    for r in q.consumer_info(conn):
        consumers.add_row(
            r["queue_name"],
            r["consumer_name"],
            fmt_interval(r["lag"]),
            fmt_interval(r["last_seen"]),
            str(r["last_tick"]),
            str(r["current_batch"] or "-"),
            str(r["pending_events"]),
        )
    return Group(queues, consumers)


def print_queue_status(conn: psycopg.Connection) -> None:
    Console().print(queue_tables(conn))


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def print_capture_status(console: Console, conn: psycopg.Connection, queue: str) -> None:
    """The capture mode; for logical capture the slot, the WAL it retains and the capture lag."""
    r = walcapture.capture_status(conn, queue)
    if r is None:
        console.print("capture: triggers")
        return
    slot, exists, active, retained, behind, wal_status, since_commit, since_capture, error, error_time = r
    if not exists:
        console.print(f"capture: logical, slot {slot} [red]missing[/red]")
    else:
        warn = "" if wal_status in ("reserved", None) else f"  [red]wal_status {wal_status}[/red]"
        console.print(
            f"capture: logical, slot {slot} ({'in use' if active else 'idle'}),"
            f" WAL retained {fmt_bytes(retained)}, not captured yet {fmt_bytes(behind)}{warn}"
        )
        console.print(
            f"capture lag: last captured commit {fmt_interval(since_commit)} ago,"
            f" daemon last wrote {fmt_interval(since_capture)} ago"
        )
    problem = walcapture.slot_problem(conn, queue)
    if problem:
        console.print(f"[red]capture slot[/red]: {problem}")
    elif error:
        console.print(f"[red]capture error[/red] ({error_time:%Y-%m-%d %H:%M:%S}): {error}")


def is_root(m: Member) -> bool:
    return m.node is not None and m.node.role.is_root


def set_tree(conn: psycopg.Connection, queue: str) -> Tree:
    """The set as a tree, root at the top: every node's type, lag behind the root (time and
    ticks), paused flag and last error; nodes that do not answer are marked."""
    members, info = tree_rows(conn, queue)
    by_name = {m.name: m for m in members}

    def label(m: Member) -> str:
        if m.node is None:
            return f"[red]{m.name}[/red] " + ("dead" if m.dead else f"unreachable ({m.error})")
        n, i = m.node, info.get(m.name)
        text = f"[bold]{n.node_name}[/bold] {n.node_type}"
        if not n.role.is_root and i:
            text += f", lag {fmt_interval(i.lag)}, {i.behind} ticks behind (tick {i.tick})"
            if n.apply_delay:
                text += f", apply delay {fmt_interval(n.apply_delay)}"
        elif i:
            text += f", tick {i.tick}"
        if n.paused:
            text += " [yellow]paused[/yellow]"
        if n.last_error:
            text += f" [red]error:[/red] {n.last_error}"
        return text

    children: dict[str | None, list[str]] = {}
    for m in members:
        parent = m.node.provider_node if m.node is not None else None
        children.setdefault(parent if parent in by_name else None, []).append(m.name)
    roots = children.get(None, [])
    tree = Tree(f"set {queue}")
    seen: set[str] = set()

    def add(branch: Tree, name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        sub = branch.add(label(by_name[name]))
        for child in sorted(children.get(name, [])):
            add(sub, child)

    for name in sorted(roots, key=lambda n: (not is_root(by_name[n]), n)):
        add(tree, name)
    return tree


def watermark_table(conn: psycopg.Connection, queue: str) -> Table:
    """On a node with a queue: what each subscriber (and the nodes below it) still needs."""
    t = Table(title="watermarks (rotation waits for the lowest)", title_justify="left")
    for col in ("node", "needs tick", "reported"):
        t.add_column(col, justify="left" if col == "node" else "right")
    for name, wm, age in nodes.watermarks(conn, queue):
        t.add_row(name, str(wm), fmt_interval(age) + " ago")
    return t


def print_node_status(conn: psycopg.Connection, node: Node) -> None:
    console = Console()
    console.print(f"[bold]{node.node_name}[/bold] ({node.node_type}) of set {node.queue_name}")
    console.print(set_tree(conn, node.queue_name))
    if node.role.captures_changes:
        print_capture_status(console, conn, node.queue_name)
        setting = ddl.setting(conn, node.queue_name)
        console.print(f"auto-ddl: {setting.describe() if setting else 'off (DDL through execute)'}")
    elif node.all_tables:
        console.print("new tables of the set: added here too (add-table --all)")
    if node.role.has_queue:
        console.print(queue_tables(conn))
        console.print(watermark_table(conn, node.queue_name))
    if node.role.captures_changes:
        print_daemons(console, {"daemons": report.daemons_report(conn, node)})
        peers = report.peers_report(conn, node.queue_name)
        if peers:
            console.print(peer_table(peers))
        return
    r = report.node_report(conn, node)
    print_daemons(console, r)
    if not r["provider_reachable"]:
        console.print(f"provider {node.provider_node}: [red]unreachable[/red] ({r['provider_error']})")
    console.print(f"provider: {node.provider_node}")
    behind = r["ticks_behind"] if r["ticks_behind"] is not None else "?"
    age = fmt_seconds(r["lag_seconds"])
    console.print(
        f"lag: {age}, {behind} ticks (last applied tick {node.last_tick})"
        f"{'  [yellow]paused[/yellow]' if node.paused else ''}"
    )
    if r["apply_delay_seconds"]:
        console.print(
            f"apply delay: {fmt_seconds(r['apply_delay_seconds'])}, lag beyond it:"
            f" {fmt_seconds(r['lag_beyond_delay_seconds'])}"
        )
    console.print(
        "tables: " + (", ".join(f"{s}: {n}" for s, n in sorted(r["tables_per_state"].items())) or "none")
    )
    if r["tables"]:
        console.print(table_lag_table(r["tables"]))
    for p in r["copies"]:
        console.print(copy_line(p), highlight=False, soft_wrap=True)
    if r["last_error"]:
        console.print(f"[red]last error[/red] ({r['last_error_time']}): {r['last_error']}")
    for row in r["tables"]:
        if row["last_error"]:
            console.print(
                f"[red]copy of {row['table']}[/red] ({row['last_error_time']}): {row['last_error']}"
            )


def print_daemons(console: Console, r: dict) -> None:
    """One line per daemon of the node: running, or when it was last seen (red when needed)."""
    for d in r["daemons"]:
        words = report.daemon_line(d)
        role, _, rest = words.partition(" ")
        colour = "red" if d["critical"] else "yellow" if not d["running"] else "green"
        console.print(f"{role}: [{colour}]{rest}[/{colour}]", highlight=False, soft_wrap=True)


def peer_table(peers: list[dict]) -> Table:
    """A two-way master's peers: how far behind each peer's queue it is, its conflicts."""
    t = Table(title="peers (two-way)", title_justify="left")
    for col in ("peer", "queue", "lag", "ticks behind", "conflicts", "policy", "error"):
        t.add_column(col, justify="right" if col in ("lag", "ticks behind", "conflicts") else "left")
    for p in peers:
        t.add_row(
            p["peer"],
            p["queue"],
            fmt_seconds(p["lag_seconds"]) if p["reachable"] else "[red]unreachable[/red]",
            "-" if p["ticks_behind"] is None else str(p["ticks_behind"]),
            str(p["conflicts"]),
            p["policy"] or "-",
            p["last_error"] or "",
        )
    return t


def fmt_seconds(s: float | None) -> str:
    return fmt_interval(None if s is None else timedelta(seconds=s))


def table_lag_table(tables: list[dict]) -> Table:
    """Per table: its state and how late it is (the oldest change not applied here)."""
    t = Table(title="tables (lag: age of the oldest change not applied here)", title_justify="left")
    for col in ("table", "state", "lag", "waiting events"):
        t.add_column(col, justify="left" if col in ("table", "state") else "right")
    for row in tables:
        waiting = row["pending_events"]
        t.add_row(
            row["table"],
            row["state"],
            fmt_seconds(row["lag_seconds"]),
            "-" if waiting is None else str(waiting),
        )
    return t


def copy_line(p: dict) -> str:
    """One in-copy table: rows done of the estimate, rate, ETA (and Spark ranges)."""
    total = "?" if p["rows_total"] is None else str(p["rows_total"])
    pct = "" if p["percent"] is None else f" ({p['percent']:.0f}%)"
    eta = "-" if p["eta"] is None else fmt_seconds(p["eta"])
    ranges = f", {p['ranges_done']}/{p['ranges']} ranges" if p["ranges"] else ""
    return (
        f"copy {p['table']} ({p['method']}, {p['step']}): {p['rows']}/{total} rows{pct}{ranges},"
        f" {p['rows_per_s']:.0f} rows/s, ETA {eta}"
    )
