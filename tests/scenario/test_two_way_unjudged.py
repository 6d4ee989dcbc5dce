"""Two-way: a peer batch whose events of a table are all inserts, or all updates, is written at
once (replica/peer_fast.py), and only when nothing here could make one of them a conflict; else
it is judged as any batch.  Convergence is checked outside pgcascade (an
md5 of every row on each master); which way a batch went, by the worker's log and the versions."""

from __future__ import annotations

import signal
import time

from conftest import Daemons
from test_two_way import Master, TwoWaySet, conflicts_of, make_tables, two_way  # noqa: F401 (the fixture)

from pgcascade.dev.localcluster import wait_until

JUDGED = "applying it with the judging statements"


def judged(s: TwoWaySet, name: str) -> int:
    """How many batches the master's worker sent again with the judging statements."""
    return (s.tmp / f"{name}.log").read_text().count(JUDGED)


def versions(s: TwoWaySet, name: str, origin: str) -> int:
    with s.masters[name].db.connect() as conn:
        return conn.execute(
            "select count(*) from pgcascade.row_version where table_name = 'public.t' and origin = %s and not deleted",
            (origin,),
        ).fetchone()[0]


def unjudged_runs(s: TwoWaySet, name: str) -> int:
    """Executions of the unjudged statements' check on the master (track_functions)."""
    with s.masters[name].db.connect() as conn:
        return conn.execute(
            "select coalesce(sum(calls), 0) from pg_stat_user_functions where funcname = 'peer_expect_rows'"
        ).fetchone()[0]


def started_masters(s: TwoWaySet, make_db, *tables: str) -> tuple[Master, Master]:
    """Masters a and b of `tables`, their function calls counted, their daemons started."""
    a, b = s.add_master("a", make_db("a")), s.add_master("b", make_db("b"))
    for m in (a, b):
        make_tables(m, *tables)
        m.run("add-table", *tables)
        m.execute("alter system set track_functions = 'pl'")
        m.execute("select pg_reload_conf()")
    s.connect_all()
    s.start()
    return a, b


def test_insert_only_batches_are_written_at_once_unless_a_key_or_a_truncate_asks_for_judging(
    two_way: TwoWaySet, make_db
) -> None:
    a, b = started_masters(two_way, make_db, "t", "u")
    # a worker's first batch goes step by step (it reads the policies): one batch each way first
    a.execute("insert into t values (1, 100, 'a')")
    b.execute("insert into t values (2, 100, 'b')")
    two_way.wait_converged("t")

    # appended rows: written at once, with their versions, nothing judged
    runs = unjudged_runs(two_way, "b")
    a.execute("insert into t select i, 100, 'a' from generate_series(3, 50) i")
    two_way.wait_converged("t")
    assert versions(two_way, "b", "a") == 49
    # (a backend's function counts reach the statistics within seconds)
    wait_until(lambda: unjudged_runs(two_way, "b") > runs, 30, what="b's unjudged statement")
    assert judged(two_way, "b") == 0 and conflicts_of(b) == []

    # b's changes held back from a: on b a new key (100) and a key inserted and deleted (200,
    # its tombstone); then a inserts both, which b's worker must judge, not write at once
    Daemons.kill(a.worker, signal.SIGINT)
    a.worker = None
    b.execute("insert into t values (100, 300, 'b')")
    b.execute("insert into t values (200, 300, 'b')")
    b.execute("delete from t where id = 200")
    time.sleep(0.05)
    a.execute("insert into t values (100, 700, 'a')")
    a.execute("insert into t values (200, 700, 'a')")
    wait_until(lambda: judged(two_way, "b") >= 1, 30, what="b judging a's inserts")
    two_way.start("a")
    two_way.wait_converged("t")
    # last-update-wins: a's inserts are the later changes
    assert two_way.rows("b", "t")[100] == (700, "a") and two_way.rows("b", "t")[200] == (700, "a")
    kinds = {(k, key) for _t, k, key, _w, _o in conflicts_of(b)}
    assert ("insert/insert", "100") in kinds and ("update/delete", "200") in kinds, kinds

    # a table truncated once is judged (the peer may not have seen the TRUNCATE): still equal
    before = judged(two_way, "b")
    a.execute("insert into u select i, 1, 'a' from generate_series(1, 10) i")
    two_way.wait_converged("u")
    a.execute("truncate u")
    two_way.wait_converged("u")
    a.execute("insert into u select i, 1, 'after' from generate_series(300, 310) i")
    two_way.wait_converged("t", "u")
    assert sorted(two_way.rows("b", "u")) == list(range(300, 311))
    assert judged(two_way, "b") == before + 1


def test_update_batches_of_rows_a_peer_wrote_last_are_written_at_once_else_judged(
    two_way: TwoWaySet, make_db
) -> None:
    a, b = started_masters(two_way, make_db, "t")
    a.execute("insert into t values (0, 0, 'a')")
    b.execute("insert into t values (1000, 0, 'b')")
    two_way.wait_converged("t")
    a.execute("insert into t select i, 0, 'a' from generate_series(1, 20) i")  # a's rows, on b too
    two_way.wait_converged("t")

    # a's own rows updated again and again on a: b writes them at once, nothing judged
    runs = unjudged_runs(two_way, "b")
    for _ in range(5):
        a.execute("update t set balance = balance + 1 where id between 1 and 20")
    a.execute("update t set balance = balance + 1, note = 'twice' where id = 3")  # one key twice
    two_way.wait_converged("t")
    wait_until(lambda: unjudged_runs(two_way, "b") > runs, 30, what="b's unjudged updates")
    assert judged(two_way, "b") == 0 and conflicts_of(b) == []
    assert two_way.rows("b", "t")[3] == (6, "twice")
    with b.db.connect() as conn:  # each row's version names a and the transaction that wrote it
        versions = conn.execute(
            "select count(*) from t join pgcascade.row_version v on v.table_name = 'public.t'"
            " and v.row_key = jsonb_build_array(t.id) where t.id between 1 and 20 and v.origin = 'a'"
            " and (v.xid::text::int8 % 4294967296)::text = t.xmin::text"
        ).fetchone()[0]
    assert versions == 20

    # a row b changed itself is judged: concurrently (a's change does not know b's) a conflict,
    # which the later change wins; once a has applied b's change, not a conflict
    Daemons.kill(a.worker, signal.SIGINT)
    a.worker = None
    b.execute("update t set balance = 100, note = 'b' where id = 5")
    time.sleep(0.05)
    a.execute("update t set balance = 200, note = 'a' where id = 5")
    wait_until(lambda: judged(two_way, "b") >= 1, 30, what="b judging a's update of its row")
    two_way.start("a")
    two_way.wait_converged("t")
    assert two_way.rows("b", "t")[5] == (200, "a")
    assert [(k, key) for _t, k, key, _w, _o in conflicts_of(b)] == [("update/update", "5")]
    a.execute("update t set balance = 300 where id = 1000")  # b's row, which a had applied
    two_way.wait_converged("t")
    assert two_way.rows("b", "t")[1000] == (300, "b")
    assert len(conflicts_of(b)) == 1
