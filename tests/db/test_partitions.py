"""A declaratively partitioned table on the root, replicated as one table: into a plain table on
one leaf and into a table partitioned another way on a second, while a writer changes rows
through the partitioned table and directly in its partitions, moves rows between partitions,
and a partition is attached mid-run - with trigger capture and with logical capture.

Equality is the md5 of every row's text on each side, computed by PostgreSQL.
"""

from __future__ import annotations

import random
import threading
import time

import psycopg
import pytest
from conftest import table_checksum
from test_replication_cli import one_line, run

from pgcascade.dev.localcluster import wait_until

EVENTS = "public.events"
ROOT_DDL = [
    "create table events (id int, at int, kind text not null, v text, primary key (id, at)) partition by range (at)",
    "create table events_p0 partition of events for values from (0) to (100)",
    "create table events_p1 partition of events for values from (100) to (200)",
    "insert into events select i, i % 200, (array['a', 'b', 'c'])[1 + i % 3], 'v' || i from generate_series(1, 600) i",
]
# the second leaf: partitioned by another column, which must then be in its primary key (so the
# root's key has no unique index there), with a plain index on the root's key
LIST_DDL = [
    "create table events (id int not null, at int not null, kind text not null, v text,"
    " primary key (id, at, kind)) partition by list (kind)",
    "create table events_a partition of events for values in ('a')",
    "create table events_b partition of events for values in ('b')",
    "create table events_rest partition of events default",
    "create index on events (id, at)",
]
KEY_REFUSED = "an UPDATE of the key of"  # a partition attached since the last maintenance


class Writer(threading.Thread):
    """Inserts, updates (moving rows between partitions) and deletes, through the partitioned
    table and directly in its partitions, until stopped; counts what it did."""

    def __init__(self, connstr: str):
        super().__init__(daemon=True)
        self.conn = psycopg.connect(connstr, autocommit=True)
        self.stop = threading.Event()
        self.upper = 200  # at < upper: the ranges with a partition
        self.direct_new = 0  # rows written by naming the partition attached mid-run
        self.refused = 0  # key changes there before the maintenance set it up (trigger capture)
        self.error: BaseException | None = None
        self.next_id = 10_000

    def run(self) -> None:
        rnd = random.Random(7)
        try:
            while not self.stop.is_set():
                self.step(rnd)
        except BaseException as e:  # the test fails with it
            self.error = e
        finally:
            self.conn.close()

    def step(self, rnd: random.Random) -> None:
        c = self.conn
        self.next_id += 1
        i, at, kind = self.next_id, rnd.randrange(self.upper), rnd.choice("abc")
        op = rnd.randrange(7)
        # statements on the table leave the rows written by naming a partition alone ('direct'
        # ones): a change to such a row that went uncaptured would stay visible
        mine = "select id from events where v not like 'direct%%' order by random() limit {}"
        if op == 0:
            c.execute("insert into events values (%s, %s, %s, 'new')", (i, at, kind))
        elif op == 1:  # moves rows between the root's partitions and the second leaf's
            try:
                c.execute(f"update events set at = %s, kind = %s where id in ({mine.format(3)})", (at, kind))
            except psycopg.errors.ObjectNotInPrerequisiteState as e:
                assert KEY_REFUSED in str(e), e
                self.refused += 1
        elif op == 2:
            c.execute(f"delete from events where id in ({mine.format(2)})")
        elif op == 3:  # naming a partition
            c.execute("insert into events_p0 values (%s, %s, %s, 'direct')", (i, at % 100, kind))
        elif op == 4:
            c.execute(
                "update events_p0 set v = v || '+', kind = %s where id in"
                " (select id from events_p0 where v like 'direct%%' order by random() limit 2)",
                (kind,),
            )
            c.execute(
                "delete from events_p0 where id in (select id from events_p0 where v like 'direct+++%%')"
            )
        elif op == 5 and self.upper > 200:  # naming the partition attached mid-run
            c.execute("insert into events_p2 values (%s, %s, %s, 'direct new')", (i, 200 + at % 100, kind))
            self.direct_new += 1
        else:
            c.execute("update events set v = %s where id = %s", (f"w{i}", rnd.randrange(1, 600)))


@pytest.mark.parametrize("capture", ["trigger", "logical"])
def test_partitioned_root_table_with_a_partition_attached_under_writes(replica, make_db, capture):
    r = replica
    run(r.root, *ROOT_DDL)
    leaf2 = make_db("b")
    run(leaf2, *LIST_DDL)
    r.run("root", "create-root", "root", *(["--capture=logical"] if capture == "logical" else []))
    r.run("root", "add-table", "events")
    if capture == "logical":
        r.daemons.start(str(r.root_ini), "capture")
    r.run("leaf", "create-leaf", "leaf1", "--provider", r.root.connstr)
    r.run("leaf", "add-table", "events", "--create")  # a plain table
    r.ini("leaf2", leaf2)
    r.run("leaf2", "create-leaf", "leaf2", "--provider", r.root.connstr)
    r.run("leaf2", "add-table", "events")
    assert r.cli("root", "tables").stdout.split()[0] == EVENTS  # one entry, whatever its partitions
    r.start_ticker()
    r.start_worker()
    r.daemons.start(str(r.tmp / "leaf2.ini"), "worker")
    # copied first: from here on every change reaches the leaves as events
    r.wait_sync()
    r.cli("leaf2", "wait-sync", "--timeout", "120", timeout=150)
    writer = Writer(r.root.connstr)
    writer.start()
    try:
        time.sleep(3)
        run(
            r.root,
            "create table events_p2 (like events including all)",
            # 'direct': the writer's updates through the table leave it alone (one that moved it away
            # meanwhile would fail the delete below)
            "insert into events_p2 values (-1, 250, 'a', 'direct, in the table before it was attached')",
            "alter table events attach partition events_p2 for values from (200) to (300)",
            "delete from events where id = -1",  # ATTACH of rows makes no event: delete them through the table
        )
        writer.upper = 300
        wait_until(
            lambda: writer.direct_new >= 5 or writer.error,
            60,
            what="direct writes into events_p2",
        )
    finally:
        writer.stop.set()
        writer.join(30)
    assert writer.error is None, writer.error
    if capture == "logical":  # the ticker's maintenance gave the new partition the table's identity
        wait_until(
            lambda: r.root.scalar("select relreplident from pg_class where relname = 'events_p2'") == "f", 30
        )
    r.wait_sync()
    r.cli("leaf2", "wait-sync", "--timeout", "120", timeout=150)
    want = table_checksum(r.root, EVENTS)
    assert want == table_checksum(r.leaf, EVENTS) == table_checksum(leaf2, EVENTS)
    assert (
        r.root.scalar("select count(*) from events_p2") > 0
        and r.leaf.scalar("select relkind from pg_class where relname = 'events'") == "r"
    )
    if capture == "trigger":
        # a partition attached and written in one transaction, before any maintenance can see it:
        # captured row by row; a change of a key there is refused
        with r.root.connect() as conn, conn.transaction(force_rollback=True):
            conn.execute("create table events_p3 partition of events for values from (300) to (400)")
            conn.execute("insert into events_p3 values (2, 351, 'a', 'naming the new partition')")
            captured = "select count(*) from pgcascade.event where ev_data like '%naming the new partition%'"
            assert conn.execute(captured).fetchone()[0] == 1
            with (
                pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match=KEY_REFUSED),
                conn.transaction(),
            ):
                conn.execute("update events_p3 set id = 3 where id = 2")
        # a partition of a replicated table cannot join the set besides it
        line = one_line(r.cli("root", "add-table", "events_p0", check=False))
        assert "public.events_p0 is a partition of public.events" in line, line
