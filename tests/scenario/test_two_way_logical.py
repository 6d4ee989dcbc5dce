"""Two-way with logical capture under concurrent writes to the same rows.

A master's capture daemon queues the master's commits from the WAL, a moment after them.  The
marker a master writes with each peer batch it applies (what it had applied of that peer, which
the peer judges conflicts by) goes the same way, in its place among them.  Inserted into the
queue at once, it overtook commits the daemon had not queued yet; the peer took those for
changes made after the batch, judged them no conflict, and the masters diverged under pgbench
flat out (`bench/two_way_bench.py`, from the asynchronous peer commits of session 28 on).
Convergence is checked outside pgcascade: an md5 of every row on each master."""

from __future__ import annotations

from pathlib import Path

from test_replication import PGBENCH_TABLES, pgbench, pgbench_init
from test_two_way import TwoWaySet, two_way  # noqa: F401 (the fixture)

# both masters update the same 200 accounts (bench/two_way_bench.py's transaction)
HOT = """\\set aid random(1, 200)
\\set delta random(-5000, 5000)
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, :aid, :delta, CURRENT_TIMESTAMP);
END;
"""


def test_two_logical_masters_updating_the_same_rows_flat_out_end_equal(
    two_way: TwoWaySet, make_db, tmp_path: Path
) -> None:
    """pgbench flat out on both masters over 200 shared accounts (hundreds of conflicts, each
    decided last-update-wins): once both stop, every table is the same on both."""
    masters = [two_way.add_master(n, make_db(n), "--capture=logical") for n in ("a", "b")]
    for m in masters:
        pgbench_init(m.db)  # the same rows on both
        m.run("add-table", *PGBENCH_TABLES)
    two_way.connect_all()
    for m in masters:
        m.cli("add-seq", "pgbench_history_hid_seq")  # history keys of its own per master
    two_way.start()
    script = tmp_path / "hot.sql"
    script.write_text(HOT)
    benches = [pgbench(m.db, "-c2", "-j2", "-T", "12", "-f", str(script)) for m in masters]
    for b in benches:
        assert b.wait(timeout=90) == 0, b.stderr.read() if b.stderr else ""
    two_way.wait_converged(*PGBENCH_TABLES, timeout=60)
    conflicts = sum(m.db.scalar("select count(*) from pgcascade.conflict") for m in masters)
    assert conflicts > 10, f"only {conflicts} conflicts: the masters hardly wrote the same rows at once"
