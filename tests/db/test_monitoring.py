"""Machine-readable state for scripts and monitoring: `status --json`, `members --json`,
`tables --json`, and `status --check --max-lag` (exit 0 ok, 2 critical), on a real root and
leaf with the ticker and the worker running.  The rows are compared independently."""

from __future__ import annotations

import json
import re
import socket
import time

from conftest import scrape, table_checksum, value

from pgcascade.dev.localcluster import free_port, wait_until


def test_json_views_and_the_lag_check_follow_a_paused_and_resumed_leaf(replica):
    with replica.root.connect() as conn:
        conn.execute("create table public.t (id int primary key, v text)")
        conn.execute("insert into public.t select i, 'v' || i from generate_series(1, 100) i")
    replica.setup(["public.t"])
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync(60)

    tick_before = replica.leaf.scalar("select last_tick from pgcascade.node")
    leaf = json.loads(replica.cli("leaf", "status", "--json").stdout)
    tick_after = replica.leaf.scalar("select last_tick from pgcascade.node")
    assert (leaf["schema"], leaf["set"], leaf["node"], leaf["type"], leaf["provider"]) == (
        1,
        "rep",
        "leaf1",
        "leaf",
        "root",
    )
    assert leaf["tables"] == [
        {
            "table": "public.t",
            "dest": "public.t",
            "key": ["id"],
            "where": None,
            "columns": None,
            "state": "ok",
            "phase": "ok",
            "tick": None,
            "lag_seconds": 0.0,
            "pending_events": 0,
            "last_error": None,
            "last_error_time": None,
        }
    ]
    assert leaf["tables_per_state"] == {"ok": 1}
    assert leaf["provider_reachable"] is True and leaf["last_error"] is None and leaf["paused"] is False
    assert isinstance(leaf["lag_seconds"], float) and leaf["lag_seconds"] >= 0
    # idle ticks go on being applied while status runs
    assert tick_before <= leaf["last_tick"] <= tick_after

    root = json.loads(replica.cli("root", "status", "--json").stdout)
    assert (root["type"], root["capture"]) == ("root", {"mode": "trigger"})
    assert root["tables"] == [{"table": "public.t", "key": ["id"], "format": "json"}]
    assert "lag_seconds" not in root

    members = json.loads(replica.cli("leaf", "members", "--json").stdout)
    assert {m["name"]: (m["type"], m["provider"], m["reachable"]) for m in members} == {
        "root": ("root", None, True),
        "leaf1": ("leaf", "root", True),
    }
    assert json.loads(replica.cli("leaf", "tables", "--json").stdout) == leaf["tables"]

    ok = replica.cli("leaf", "status", "--check", "--max-lag", "60s")
    assert ok.stdout.startswith("OK leaf1 (leaf), lag ") and ok.returncode == 0

    # paused: the lag of the last applied tick grows past the limit, and the check says so
    replica.cli("leaf", "pause")
    with replica.root.connect() as conn:
        conn.execute("update public.t set v = v || '!' where id <= 10")
    time.sleep(2.5)
    late = replica.cli("leaf", "status", "--check", "--max-lag", "1s", check=False)
    assert late.returncode == 2, late.stdout + late.stderr
    assert late.stdout.startswith("CRITICAL leaf1 (leaf): lag ") and late.stdout.rstrip().endswith("over 1 s")
    paused = json.loads(replica.cli("leaf", "status", "--json").stdout)
    assert paused["paused"] is True and paused["lag_seconds"] > 1 and paused["ticks_behind"] >= 1
    # the table's own lag: its oldest change not applied, and how many wait (the 10 updates)
    (t,) = json.loads(replica.cli("leaf", "tables", "--json").stdout)
    assert t["pending_events"] == 10 and t["lag_seconds"] > 2, t
    text = replica.cli("leaf", "status").stdout
    assert re.search(r"public\.t\s+│\s+ok\s+│\s+[\d.]+ s\s+│\s+10", text), text

    replica.cli("leaf", "resume")
    replica.wait_sync(60)
    assert replica.cli("leaf", "status", "--check", "--max-lag", "30s").returncode == 0
    assert table_checksum(replica.root, "public.t") == table_checksum(replica.leaf, "public.t")


def test_monitoring_refusals_are_one_line(replica, make_db, write_config, cli):
    replica.setup()
    r = replica.cli("leaf", "status", "--max-lag", "5s", check=False)
    assert r.returncode == 2 and r.stderr.strip() == "pgcascade: --max-lag goes with --check"
    r = replica.cli("leaf", "status", "--check", "--max-lag", "soon", check=False)
    assert r.returncode == 2 and "is not a duration" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    plain = make_db("a", installed=True)
    cfg = write_config("plain", db=plain.connstr, queue_name="rep")
    r = cli(cfg, "status", "--json")
    assert r.returncode == 2 and "not a node of a set" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_daemons_serve_metrics_whose_lag_and_counters_move(replica, tmp_path):
    worker_port, ticker_port = free_port(), free_port()
    replica.ini("leaf", replica.leaf, parallel_copies=2, metrics_port=worker_port)
    with replica.root.connect() as conn:
        conn.execute("create table public.m (id int primary key, v text)")
        conn.execute("insert into public.m select i, 'v' || i from generate_series(1, 1000) i")
    replica.setup(["public.m"])
    ticker_ini = replica.ini("ticker", replica.root, metrics_port=ticker_port, maint_period=1)
    replica.daemons.start("ticker", str(ticker_ini))
    replica.start_worker()
    replica.wait_sync(60)
    wait_until(lambda: scrape(worker_port), 10, what="the worker's /metrics")

    # the worker counts its tables at the start of each round: the round after the hand-over
    wait_until(
        lambda: value(scrape(worker_port), "pgcascade_tables", set="rep", node="leaf1", phase="ok") == 1,
        10,
        what="the table to be counted ok",
    )
    before = scrape(worker_port)
    assert value(before, "pgcascade_daemon_up", daemon="worker", job="leaf") == 1
    assert value(before, "pgcascade_tables", set="rep", node="leaf1", phase="in-copy") == 0
    with replica.root.connect() as conn:
        for i in range(20):
            conn.execute("update public.m set v = v || '.' where id %% 20 = %s", (i,))  # 50 rows each
    replica.wait_sync(60)
    after = scrape(worker_port)
    batches = value(after, "pgcascade_batches_total", set="rep", node="leaf1")
    assert batches > value(before, "pgcascade_batches_total", set="rep", node="leaf1")
    events = value(after, "pgcascade_events_total", set="rep", node="leaf1")
    assert events - value(before, "pgcascade_events_total", set="rep", node="leaf1") >= 1000
    assert value(after, "pgcascade_batch_duration_seconds_count", set="rep", node="leaf1") == batches
    wait_until(  # idle ticks keep coming: the page and the node's record meet
        lambda: (
            value(scrape(worker_port), "pgcascade_applied_tick", set="rep", node="leaf1")
            == replica.leaf.scalar("select last_tick from pgcascade.node")
        ),
        10,
        what="the applied tick on the page to be the node's",
    )
    assert value(scrape(ticker_port), "pgcascade_ticks_total") > 0

    # paused, the lag grows on the page; resumed, it falls back
    replica.cli("leaf", "pause")
    time.sleep(3)
    assert value(scrape(worker_port), "pgcascade_lag_seconds", set="rep", node="leaf1") > 1.5
    replica.cli("leaf", "resume")
    replica.wait_sync(60)
    wait_until(
        lambda: value(scrape(worker_port), "pgcascade_lag_seconds", set="rep", node="leaf1") < 1.5,
        15,
        what="the lag to fall after resume",
    )
    assert table_checksum(replica.root, "public.m") == table_checksum(replica.leaf, "public.m")


def test_a_taken_metrics_port_is_a_one_line_error(replica, cli):
    replica.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        replica.ini("leaf", replica.leaf, metrics_port=s.getsockname()[1])
        r = cli(replica.leaf_ini, "worker", timeout=30)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
