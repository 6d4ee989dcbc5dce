"""Machine-readable state for scripts and monitoring: `status --json`, `members --json`,
`tables --json`, and `status --check --max-lag` (exit 0 ok, 2 critical), on a real root and
leaf with the ticker and the worker running.  The rows are compared independently."""

from __future__ import annotations

import json
import time

from conftest import table_checksum


def test_json_views_and_the_lag_check_follow_a_paused_and_resumed_leaf(replica):
    with replica.root.connect() as conn:
        conn.execute("create table public.t (id int primary key, v text)")
        conn.execute("insert into public.t select i, 'v' || i from generate_series(1, 100) i")
    replica.setup(["public.t"])
    replica.start_ticker()
    replica.start_worker()
    replica.wait_sync(60)

    leaf = json.loads(replica.cli("leaf", "status", "--json").stdout)
    assert (leaf["schema"], leaf["set"], leaf["node"], leaf["type"], leaf["provider"]) == (
        1,
        "rep",
        "leaf1",
        "leaf",
        "root",
    )
    assert leaf["tables"] == [
        {"table": "public.t", "dest": "public.t", "key": ["id"], "state": "ok", "phase": "ok", "tick": None}
    ]
    assert leaf["tables_per_state"] == {"ok": 1}
    assert leaf["provider_reachable"] is True and leaf["last_error"] is None and leaf["paused"] is False
    assert isinstance(leaf["lag_seconds"], float) and leaf["lag_seconds"] >= 0
    assert leaf["last_tick"] == replica.leaf.scalar("select last_tick from pgcascade.node")

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
