#!/usr/bin/env python3
"""Catch-ups of the same kind of backlog by worker code variants, alternating, in one hour.

A diagnostic beside `replication_bench.py` (whose clusters, templates and pgcascade set-up it
reuses): W2a's own runs take four minutes of pgbench each, and this machine's speed drifts more
than the changes measured between two of them.  Here each run makes a fresh clone of a scale-10
pgbench template, replicates it with pgcascade's shipped defaults, stops the worker, writes a
backlog of ROUNDS transactions (100,000 account updates at random and 100,000 history inserts
each, about one 200,000-event batch each) in seconds, CHECKPOINTs both clusters and starts the
worker of the variant (its PYTHONPATH), timed until the subscriber's history and accounts match.

    .venv/bin/python bench/catchup_ab.py main=,new=/tmp/src_new [--repeats 4] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replication_bench as rb

BACKLOG = (
    "begin; update pgbench_accounts set abalance = abalance + 1"
    " where aid in (select 1 + (random() * 999999)::int from generate_series(1, 100000));"
    " insert into pgbench_history (tid, bid, aid, delta, mtime)"
    " select 1, 1, g, 1, now() from generate_series(1, 100000) g; commit"
)


def catch_up(env: rb.Env, name: str, pythonpath: str, rounds: int) -> tuple[float, list[float]]:
    """One run: seconds until caught up, and the worker's batch durations."""
    os.environ["PYTHONPATH"] = pythonpath  # the daemons' code
    s = rb.PgCascade(env)
    s.ticker_settings, s.queue_settings = {}, {}  # the shipped defaults
    pair = rb.fresh_pair(env, name, "tmpl10")
    try:
        s.setup(pair, rb.TABLES)
        time.sleep(2)
        rb.PROCS.stop(s.worker)
        s.worker = None
        with pair.pconn() as conn:
            for _ in range(rounds):
                conn.execute(BACKLOG)
            want = conn.execute(rb.W2_POLL).fetchone(), conn.execute(rb.ACCOUNTS_SUM).fetchone()
        rb.checkpoint(env.prov, env.sub)
        offset = len(s.log_text())
        with pair.sconn() as conn:
            started = time.monotonic()
            s.start_consumer(pair)
            while (conn.execute(rb.W2_POLL).fetchone(), conn.execute(rb.ACCOUNTS_SUM).fetchone()) != want:
                time.sleep(0.05)
            secs = time.monotonic() - started
        return secs, [d for n, d in s.batches_since(offset) if n > 1000]
    finally:
        s.teardown(pair)
        pair.drop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", help="name=PYTHONPATH,... (an empty path: the installed code)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6, help="backlog transactions of 200,000 events each")
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variants.split(","))
    base = Path(tempfile.mkdtemp(prefix="pgcascade-catchup-ab-"))
    os.chmod(base, 0o777)
    settings = {"shared_buffers": "1GB"}
    prov = rb.new_cluster("provider", basedir=base, fast_unsafe=False, settings=settings)
    sub = rb.new_cluster("subscriber", basedir=base, fast_unsafe=False, settings=settings)
    env = rb.Env(prov, sub, base / "work")
    results: dict[str, list[float]] = {k: [] for k in variants}
    try:
        rb.make_template(prov, "tmpl10", 10)
        rb.make_template(sub, "tmpl10", 10)
        for rep in range(args.repeats):
            for name, path in variants.items():
                secs, batches = catch_up(env, f"ab_{rep}_{name}", path, args.rounds)
                results[name].append(secs)
                print(f"{name}: {secs:.2f}s, batches {', '.join(f'{b:.2f}' for b in batches)}", flush=True)
        for name, v in results.items():
            print(f"{name}: mean {statistics.mean(v):.2f} s, runs {', '.join(f'{x:.2f}' for x in v)}")
    finally:
        rb.PROCS.close()
        prov.destroy()
        sub.destroy()
        shutil.rmtree(base, ignore_errors=True)  # the daemons' configs and logs
    return 0


if __name__ == "__main__":
    sys.exit(main())
