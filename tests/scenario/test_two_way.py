"""Two-way replication: masters that each take writes and replay each other's, with conflicts
detected and resolved by policy.  Convergence is checked outside pgcascade: an md5 of every row
of every table on every master, computed by PostgreSQL."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from conftest import Daemons, run_cli, run_ok, table_checksum
from test_replication import PGBENCH_TABLES, pgbench, pgbench_init

from pgcascade.dev.localcluster import wait_until

TABLE_DDL = "create table {t} (id int primary key, balance int not null default 0, note text)"


@dataclass
class Master:
    name: str
    db: object  # tests.conftest.Database
    ini: Path
    worker: subprocess.Popen | None = None
    ticker: subprocess.Popen | None = None

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = run_cli(str(self.ini), *args)
        if check:
            assert r.returncode == 0, (
                f"{self.name}: pgcascade {' '.join(args)}: rc {r.returncode}\n{r.stdout}{r.stderr}"
            )
        return r

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`pgcascade` in this process (run_ok): set-up, not what a test is about."""
        return run_ok(self.ini, *args)

    def execute(self, sql: str, params: tuple | None = None) -> None:
        with self.db.connect() as conn:
            conn.execute(sql, params)


@dataclass
class TwoWaySet:
    tmp: Path
    daemons: Daemons
    masters: dict[str, Master] = field(default_factory=dict)

    def add_master(self, name: str, db, *create_args: str) -> Master:
        ini = self.tmp / f"{name}.ini"
        ini.write_text(
            f"[pgcascade]\njob_name = {name}\ndb = {db.connstr}\nqueue_name = tw_{name}\n"
            f"logfile = {self.tmp}/{name}.log\npidfile = {self.tmp}/{name}.pid\nloop_delay = 0.2\n"
        )
        m = Master(name, db, ini)
        self.masters[name] = m
        m.run("create-root", name, *create_args)
        if create_args:  # logical capture: its daemon, a job of its own (pidfile, log)
            cap = self.tmp / f"{name}_capture.ini"
            cap.write_text(
                ini.read_text()
                .replace(f"job_name = {name}", f"job_name = {name}_capture")
                .replace(f"{name}.pid", f"{name}_capture.pid")
            )
            self.daemons.start(str(cap), "capture")
        return m

    def connect_all(self, policy: str | None = None) -> None:
        for m in self.masters.values():
            for p in self.masters.values():
                if p is not m:
                    extra = ("--conflict", policy) if policy else ()
                    m.run("add-peer", p.name, "--location", p.db.connstr, *extra)

    def start(self, *names: str) -> None:
        """Tickers and workers of these masters (all, by default)."""
        for m in [self.masters[n] for n in names] if names else self.masters.values():
            if m.ticker is None or m.ticker.poll() is not None:
                tini = self.tmp / f"ticker_{m.name}.ini"
                tini.write_text(
                    f"[pgcascade]\njob_name = ticker_{m.name}\ndb = {m.db.connstr}\n"
                    f"logfile = {self.tmp}/ticker_{m.name}.log\npidfile = {self.tmp}/ticker_{m.name}.pid\n"
                    "ticker_period = 0.05\n"
                )
                m.ticker = self.daemons.start("ticker", str(tini))
            m.worker = self.daemons.start(str(m.ini), "worker")

    def stop_workers(self) -> None:
        for m in self.masters.values():
            if m.worker is not None:
                Daemons.kill(m.worker, signal.SIGINT)
                m.worker = None

    def checksums(self, table: str) -> dict[str, tuple]:
        return {n: table_checksum(m.db, table) for n, m in self.masters.items()}

    def wait_converged(self, *tables: str, timeout: float = 120) -> None:
        def equal() -> bool:
            return all(len(set(self.checksums(t).values())) == 1 for t in tables)

        try:
            wait_until(equal, timeout=timeout, interval=0.5)
        except TimeoutError:
            detail = {t: self.checksums(t) for t in tables}
            if "accounts" in tables:
                rows = {n: dict(self.rows(n, "accounts")) for n in self.masters}
                keys = sorted(k for k in rows["a"] if len({str(r.get(k)) for r in rows.values()}) > 1)
                for k in keys[:1]:
                    for n, m in self.masters.items():
                        with m.db.connect() as conn:
                            cf = conn.execute(
                                "select conflict_type, local_row->>'balance', remote_row->>'balance', local_origin, remote_origin, local_time::time, remote_time::time, winner, logged::time from pgcascade.conflict where row_key->>0 = %s::text order by 1",
                                (k,),
                            ).fetchall()
                            v = conn.execute(
                                "select balance, xmin, pg_xact_commit_timestamp(xmin)::time, (select row(origin, origin_time::time, xid, origin_tick) from pgcascade.row_version where row_key = jsonb_build_array(id) and table_name = 'public.accounts') from accounts where id = %s",
                                (k,),
                            ).fetchone()
                        detail[f"key {k} on {n}"] = (v, cf[-5:])
            logs = {n: (self.tmp / f"{n}.log").read_text()[-2500:] for n in self.masters}
            logs["daemons"] = [p.output()[-800:] for p in self.daemons.procs]  # type: ignore[attr-defined]
            found = {n: len(conflicts_of(m)) for n, m in self.masters.items()}
            pytest.fail(f"masters did not converge in {timeout}s: {detail}\nconflicts: {found}\n{logs}")

    def rows_of(self, name: str, table: str) -> set[int]:
        with self.masters[name].db.connect() as conn:
            return {r[0] for r in conn.execute(f"select id from {table}")}

    def rows(self, name: str, table: str) -> dict[int, tuple]:
        with self.masters[name].db.connect() as conn:
            return {r[0]: r[1:] for r in conn.execute(f"select id, balance, note from {table} order by id")}


@pytest.fixture
def two_way(tmp_path: Path, daemons: Daemons):
    s = TwoWaySet(tmp_path, daemons)
    yield s
    daemons.close()


def make_tables(m: Master, *tables: str) -> None:
    for t in tables:
        m.execute(TABLE_DDL.format(t=t))


def conflicts_of(m: Master) -> list[tuple]:
    with m.db.connect() as conn:
        return conn.execute(
            "select table_name, conflict_type, row_key->>0, winner, remote_origin from pgcascade.conflict"
            " order by conflict_id"
        ).fetchall()


def test_two_masters_resolve_each_conflict_kind_by_each_policy(two_way: TwoWaySet, make_db) -> None:
    policies = {
        "t_lww": None,  # the default: last-update-wins
        "t_fuw": "first-update-wins",
        "t_origin": "origin-wins:a",
        "t_keep": "keep-local",
        "t_remote": "apply-remote",
        "t_func": "function:public.higher_balance_wins",
    }
    a = two_way.add_master("a", make_db("a"))
    b = two_way.add_master("b", make_db("b"))
    func = (
        "create function public.higher_balance_wins(kind text, tbl text, local jsonb, remote jsonb,"
        " local_origin text, remote_origin text, local_time timestamptz, remote_time timestamptz)"
        " returns text language sql as $$ select case when coalesce((remote->>'balance')::int, -1)"
        " > coalesce((local->>'balance')::int, -1) then 'remote' else 'local' end $$"
    )
    for args, message in (
        (("a", "--location", a.db.connstr), "is this master's own name"),
        (("z", "--location", b.db.connstr), "no master named 'z' at that location"),
        (
            ("b", "--location", b.db.connstr, "--conflict", "function:public.nosuch"),
            "no function public.nosuch",
        ),
    ):
        r = a.cli("add-peer", *args, check=False)
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    for m in (a, b):
        make_tables(m, *policies)
        m.execute(func)
    # a adds its tables before it knows its peer, b after: both ways must end two-way
    a.run("add-table", *policies)
    two_way.connect_all()
    for t, policy in policies.items():
        b.run("add-table", t, *(("--conflict", policy) if policy else ()))
        if policy:
            a.run("add-table", t, "--conflict", policy)
    two_way.start()
    for t in policies:
        a.execute(f"insert into {t} select i, 100, 'seed' from generate_series(1, 4) i")
    two_way.wait_converged(*policies)
    two_way.stop_workers()
    # no consumer but its peer on b's queue: what b applied from a is not written there again
    with b.db.connect() as conn:
        passed_on = conn.execute(
            "select count(*) from pgcascade.event where (ev_rare).ev_extra4 is not null"
        ).fetchone()[0]
    assert passed_on == 0, f"b wrote {passed_on} events of a's changes that nobody reads"

    # while neither replays the other: the same rows changed on both, a first, then b
    for t in policies:
        a.execute(f"update {t} set note = 'a', balance = 500 where id = 1")  # update/update
        a.execute(f"insert into {t} values (10, 700, 'a')")  # insert/insert
        a.execute(f"update {t} set note = 'a' where id = 2")  # update/delete
        a.execute(f"delete from {t} where id = 3")  # delete/delete
    time.sleep(0.05)
    for t in policies:
        b.execute(f"update {t} set note = 'b', balance = 200 where id = 1")
        b.execute(f"insert into {t} values (10, 300, 'b')")
        b.execute(f"delete from {t} where id = 2")
        b.execute(f"delete from {t} where id = 3")
    two_way.start()
    convergent = [t for t, p in policies.items() if p not in ("keep-local", "apply-remote")]
    two_way.wait_converged(*convergent)
    a_row, b_row, gone = {1: (500, "a"), 10: (700, "a")}, {1: (200, "b"), 10: (300, "b")}, {4: (100, "seed")}
    # last-update-wins: b's changes are later; first-update-wins and origin-wins:a: a's; the
    # function: the higher balance (a's); a delete against an update goes by the same rule
    assert two_way.rows("a", "t_lww") == {**b_row, **gone}
    assert two_way.rows("a", "t_fuw") == {**a_row, 2: (100, "a"), **gone}
    assert two_way.rows("a", "t_origin") == {**a_row, 2: (100, "a"), **gone}
    assert two_way.rows("a", "t_func") == {**a_row, 2: (100, "a"), **gone}
    # keep-local and apply-remote do not converge, by definition (docs/two-way.md)
    wait_until(lambda: two_way.rows("b", "t_remote").get(1) == (500, "a"), timeout=30, what="t_remote on b")
    assert two_way.rows("a", "t_keep") == {**a_row, 2: (100, "a"), **gone}
    assert two_way.rows("b", "t_keep") == {**b_row, **gone}
    assert two_way.rows("a", "t_remote") == {**b_row, **gone}
    assert two_way.rows("b", "t_remote") == {**a_row, 2: (100, "a"), **gone}

    kinds = {(t.removeprefix("public."), k, key) for t, k, key, _w, _o in conflicts_of(a)}
    for t in policies:
        assert {
            (t, "update/update", "1"),
            (t, "insert/insert", "10"),
            (t, "update/delete", "2"),
            (t, "delete/delete", "3"),
        } <= kinds, f"{t}: {sorted(kinds)}"
    assert 4 not in {int(key) for _t, _k, key in kinds}, "a row changed on one side only is no conflict"
    report = json.loads(a.cli("status", "--json").stdout)
    assert [(p["peer"], p["conflicts"]) for p in report["peers"]] == [("b", len(conflicts_of(a)))]
    assert "peers (two-way)" in a.cli("status").stdout
    listed = a.cli("conflicts").stdout
    assert (
        "update/update public.t_lww key [1]: local (a) vs remote (b), last-update-wins: remote kept" in listed
    )
    assert f"{len(conflicts_of(a))} conflicts" in listed

    # the error policy stops the batch, applying nothing of it, until the policy changes
    two_way.stop_workers()
    a.cli("add-peer", "b", "--location", b.db.connstr, "--conflict", "error")
    a.execute("update t_lww set note = 'a2' where id = 4")
    a.execute("update t_fuw set note = 'a2' where id = 4")
    b.execute("update t_lww set note = 'b2' where id = 4")
    b.execute("update t_fuw set note = 'b2' where id = 4")
    two_way.start()
    with a.db.connect() as conn:
        wait_until(
            lambda: conn.execute(
                "select last_error from pgcascade.node where queue_name = 'tw_b'"
            ).fetchone()[0],
            timeout=30,
        )
        error = conn.execute("select last_error from pgcascade.node where queue_name = 'tw_b'").fetchone()[0]
    assert "update/update conflict" in error and "error" in error
    assert two_way.rows("a", "t_lww")[4] == (100, "a2")
    assert two_way.rows("a", "t_fuw")[4] == (100, "a2"), "a batch stopped by a conflict applies nothing"
    a.cli("add-peer", "b", "--location", b.db.connstr, "--conflict", "last-update-wins")
    two_way.wait_converged("t_lww", "t_fuw")
    assert two_way.rows("a", "t_lww")[4] == (100, "b2")

    # an update that changes a key leaves a tombstone of the old key, as a delete; others do not
    a.execute("update t_lww set id = 40 where id = 4")
    a.execute("update t_lww set balance = 1 where id = 1")
    with a.db.connect() as conn:
        tombs = conn.execute(
            "select row_key->>0 from pgcascade.row_version where table_name = 'public.t_lww'"
            " and deleted and origin is null"
        ).fetchall()
    assert ("4",) in tombs and ("1",) not in tombs, tombs
    two_way.wait_converged("t_lww")
    assert two_way.rows("b", "t_lww").get(40) == (100, "b2") and 4 not in two_way.rows("b", "t_lww")


def test_three_masters_converge_under_concurrent_writes(two_way: TwoWaySet, make_db, tmp_path: Path) -> None:
    """Three masters write the same accounts at once; orders take their keys from a sequence
    spread by add-seq; DDL run with `execute` on one master reaches every master and, through
    its master, a leaf under b made while they write; everything converges, the leaf included."""
    names = ("a", "b", "c")
    masters = [two_way.add_master(n, make_db(n)) for n in names]
    for m in masters:
        make_tables(m, "accounts")
        m.execute("create table history (id bigint primary key, account int, delta int, origin text)")
        m.execute(
            "create sequence order_id; create table orders (id bigint primary key default nextval('order_id'), origin text)"
        )
        m.execute("select setval('order_id', 5)")  # some values handed out before
        m.run("add-table", "accounts", "history", "orders")
    two_way.connect_all()
    residues = set()
    for m in masters:
        said = m.cli("add-seq", "order_id").stdout
        residues.add(said.split("values are ")[1].split()[0])
    assert len(residues) == 3, f"the masters share sequence residues: {residues}"
    for m in masters:
        m.execute("insert into accounts select i, 0, null from generate_series(1, 200) i")
    two_way.start()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(m: Master, offset: int) -> None:
        rnd = random.Random(offset)
        n = 0
        try:
            with m.db.connect() as conn:
                while not stop.is_set():
                    n += 1
                    aid = rnd.randint(1, 200)  # the same accounts on every master: conflicts
                    delta = rnd.randint(-50, 50)
                    # a deadlock against a peer's apply (it locks the rows it judges) rolls the
                    # transaction back: an application retries, as this one does
                    with contextlib.suppress(psycopg.errors.DeadlockDetected):
                        write_once(conn, m, n, offset, aid, delta, rnd)
        except psycopg.Error as e:
            errors.append(e)

    def write_once(conn, m: Master, n: int, offset: int, aid: int, delta: int, rnd: random.Random) -> None:
        with conn.transaction():
            conn.execute(
                "update accounts set balance = balance + %s, note = %s where id = %s",
                (delta, m.name, aid),
            )
            # history keys of its own per master: never a conflict
            conn.execute(
                "insert into history values (%s, %s, %s, %s)",
                (n * 3 + offset, aid, delta, m.name),
            )
        conn.execute("insert into orders (origin) values (%s)", (m.name,))  # keys by add-seq
        if n % 25 == 0:
            victim = rnd.randint(1, 200)
            conn.execute("delete from accounts where id = %s", (victim,))
            conn.execute(
                "insert into accounts values (%s, 0, %s) on conflict (id) do nothing",
                (victim, m.name),
            )

    threads = [threading.Thread(target=writer, args=(m, i)) for i, m in enumerate(masters)]
    for t in threads:
        t.start()
    time.sleep(2)
    # a leaf under master b, made while the masters write: b has passed nothing of what it
    # applies from a and c on (nobody read it); from the leaf's first batch on, it does
    leaf_db = make_db("a")
    leaf_ini = tmp_path / "leaf.ini"
    leaf_ini.write_text(
        f"[pgcascade]\njob_name = leaf\ndb = {leaf_db.connstr}\nqueue_name = tw_b\n"
        f"logfile = {tmp_path}/leaf.log\npidfile = {tmp_path}/leaf.pid\nloop_delay = 0.2\n"
    )
    for args in (
        ("create-leaf", "leaf", "--provider", masters[1].db.connstr),
        ("add-table", "accounts", "history", "orders", "--create"),
    ):
        r = run_cli(str(leaf_ini), *args)
        assert r.returncode == 0, r.stderr
    two_way.daemons.start(str(leaf_ini), "worker")
    time.sleep(2)
    script = tmp_path / "ddl.sql"
    script.write_text("alter table accounts add column flag int; create table notes (id int primary key);")
    masters[2].cli("execute", str(script))
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    # wait-sync on a master waits until it applied every peer's changes committed before it:
    # with a's worker stopped it does not return; once a applied b's last row, it does
    a, b = masters[0], masters[1]
    Daemons.kill(a.worker, signal.SIGINT)
    b.execute("insert into history values (-1, 1, 0, 'b, last')")  # a key no writer uses
    waiting = two_way.daemons.start(str(a.ini), "wait-sync", "--timeout", "120")
    time.sleep(3)
    assert waiting.poll() is None, f"wait-sync returned with a's worker stopped: {waiting.output()}"
    a.worker = two_way.daemons.start(str(a.ini), "worker")
    assert waiting.wait(timeout=150) == 0, waiting.output()
    with a.db.connect() as conn:
        last = conn.execute("select origin from history where id = -1").fetchone()
    assert last == ("b, last",), "wait-sync returned before b's last row was applied"
    # then on the others: all three are equal when the last one returns
    for m in masters[1:]:
        m.cli("wait-sync", "--timeout", "120")
    for t in ("accounts", "history", "orders"):
        sums = two_way.checksums(t)
        assert len(set(sums.values())) == 1, f"{t} differs after wait-sync on every master: {sums}"
    counts = {n: table_checksum(m.db, "history")[0] for n, m in zip(names, masters, strict=True)}
    assert len(set(counts.values())) == 1 and counts["a"] > 20, counts
    assert sum(len(conflicts_of(m)) for m in masters) > 0, "overlapping updates made no conflict"
    for m in masters:
        with m.db.connect() as conn:
            assert (
                conn.execute(
                    "select count(*) from information_schema.columns where column_name = 'flag'"
                    " and table_name = 'accounts'"
                ).fetchone()[0]
                == 1
            )
            assert conn.execute("select to_regclass('notes') is not null").fetchone()[0]
            kinds = conn.execute(
                "select count(*) from pgcascade.conflict where table_name = 'public.orders'"
            ).fetchone()
            assert kinds[0] == 0, f"{m.name}: orders keys from the spread sequence collided"
    with masters[0].db.connect() as conn:
        orders = conn.execute("select count(*), count(distinct origin) from orders").fetchone()
    assert orders[0] > 20 and orders[1] == 3, orders
    for t in ("accounts", "history", "orders"):
        wait_until(
            lambda t=t: table_checksum(leaf_db, t) == table_checksum(masters[1].db, t),
            timeout=120,
            what=f"leaf {t}",
        )
    with leaf_db.connect() as conn:
        assert conn.execute("select to_regclass('notes') is not null").fetchone()[0], (
            "the DDL did not reach the leaf"
        )


APPLIED_LOG = """
create table applied_log (id bigint not null);
create function log_applied() returns trigger language plpgsql as $$
begin
    if coalesce(current_setting('pgcascade.origin', true), '') <> '' then
        insert into applied_log values (new.id);
    end if;
    return null;
end $$;
create trigger log_applied after insert or update on history for each row execute function log_applied();
alter table history enable always trigger log_applied;
"""


def assert_applied_once(m: Master, ids: set[int]) -> None:
    """Master m's peer applies (APPLIED_LOG's record) wrote each of `ids` once, and no other row."""
    with m.db.connect() as conn:
        twice = conn.execute("select id from applied_log group by id having count(*) > 1").fetchall()
        applied = {r[0] for r in conn.execute("select id from applied_log")}
    assert not twice, f"{m.name} applied rows twice: {twice[:10]}"
    assert applied == ids


def test_three_masters_lose_nothing_when_workers_are_killed_and_a_master_crashes(
    two_way: TwoWaySet, make_db, private_cluster
) -> None:
    """SIGKILL of a worker and an immediate shutdown of a master while all three write (and
    pgbench runs on two of them): every committed history row reaches every master, no peer's
    row is applied twice (an ENABLE ALWAYS trigger writes down every row a peer's apply inserts
    or updates), and the pgbench tables end equal everywhere."""
    private_cluster.create_database("c")
    with private_cluster.connect() as conn:  # a commit acknowledged must survive the crash
        conn.execute("alter system set synchronous_commit = on")
        conn.execute("select pg_reload_conf()")
    c_db = type(make_db("a"))(private_cluster, "c")
    masters = [two_way.add_master("a", make_db("a")), two_way.add_master("b", make_db("b"))]
    masters.append(two_way.add_master("c", c_db))
    for m in masters:
        make_tables(m, "accounts")
        m.execute("create table history (id bigint primary key, account int, delta int, origin text)")
        m.execute(APPLIED_LOG)
        m.execute("insert into accounts select i, 0, null from generate_series(1, 50) i")
        pgbench_init(m.db)  # the same rows on every master
        m.run("add-table", "accounts", "history", *PGBENCH_TABLES)
    two_way.connect_all()
    for m in masters:
        m.cli("add-seq", "pgbench_history_hid_seq")  # history keys of its own per master
    two_way.start()
    benches = [pgbench(m.db, "-N", "-c1", "-R", "40", "-T", "11") for m in masters[:2]]  # not c: it crashes
    stop = threading.Event()
    committed: dict[str, set[int]] = {m.name: set() for m in masters}

    def writer(m: Master, offset: int) -> None:
        rnd, n = random.Random(offset), 0
        while not stop.is_set():
            try:
                with m.db.connect() as conn:
                    while not stop.is_set():
                        n += 1
                        hid, aid = n * 3 + offset, rnd.randint(1, 50)
                        with conn.transaction():
                            conn.execute("update accounts set balance = balance + 1 where id = %s", (aid,))
                            conn.execute("insert into history values (%s, %s, 1, %s)", (hid, aid, m.name))
                        committed[m.name].add(hid)
            except psycopg.OperationalError:
                time.sleep(0.2)  # the master is down: write again once it is back

    threads = [threading.Thread(target=writer, args=(m, i)) for i, m in enumerate(masters)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        Daemons.kill(masters[0].worker)  # SIGKILL, mid-batch or between batches
        time.sleep(1)
        masters[0].worker = two_way.daemons.start(str(masters[0].ini), "worker")
        time.sleep(2)
        private_cluster.stop("immediate")  # master c crashes under load
        time.sleep(1)
        private_cluster.start()
        time.sleep(3)
        Daemons.kill(masters[1].worker)
        masters[1].worker = two_way.daemons.start(str(masters[1].ini), "worker")
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for b in benches:
            b.wait(timeout=60)
    assert [b.returncode for b in benches] == [0, 0], [b.stderr.read() for b in benches if b.stderr]
    two_way.wait_converged("accounts", "history", *PGBENCH_TABLES, timeout=120)
    with masters[2].db.connect() as conn:
        assert conn.execute("select count(*) from pgbench_history").fetchone()[0] > 100, (
            "pgbench wrote little"
        )
    for m in masters:
        with m.db.connect() as conn:
            ids = {r[0] for r in conn.execute("select id from history")}
            twice = conn.execute("select id from applied_log group by id having count(*) > 1").fetchall()
            applied = {r[0] for r in conn.execute("select id from applied_log")}
            others = {r[0] for r in conn.execute("select id from history where origin <> %s", (m.name,))}
        for origin, done in committed.items():
            assert done <= ids, f"{m.name} lacks {len(done - ids)} rows committed on {origin}"
        assert not twice, f"{m.name} applied rows twice: {twice[:10]}"
        assert applied == others, f"{m.name}: applied {len(applied)} peer rows, has {len(others)}"


def test_masters_tick_each_others_queue_on_demand_and_a_kill_after_such_a_tick_loses_nothing(
    two_way: TwoWaySet, make_db
) -> None:
    """No ticker runs: a change committed on one master reaches the other at once all the same
    (its worker ticks the peer's queue when it asks, and is woken by the peer's doorbell when
    idle). A worker SIGKILLed after such a tick opened its batch on the peer, before applying
    it, applies that batch once after its restart: every row there, none applied twice."""
    masters = [two_way.add_master(n, make_db(n)) for n in ("a", "b")]
    for m in masters:
        make_tables(m, "accounts")
        m.execute("create table history (id bigint primary key, account int, delta int, origin text)")
        m.execute(APPLIED_LOG)
        m.run("add-table", "accounts", "history")
    two_way.connect_all()
    a, b = masters
    for m in masters:
        m.worker = two_way.daemons.start(str(m.ini), "worker")
    time.sleep(2)  # both idle: asleep on their peer's doorbell
    a.execute("insert into history values (1, 1, 1, 'a')")
    wait_until(lambda: 1 in two_way.rows_of("b", "history"), 10, what="a's row on b without a ticker")

    Daemons.kill(b.worker, signal.SIGINT)
    b.worker = two_way.daemons.start(str(b.ini), "worker", env={"PGCASCADE_PAUSE_AT": "fetched"})
    a.execute("insert into history select i, i, 1, 'a' from generate_series(2, 40) i")
    paused = f"pause point fetched (pid {b.worker.pid})"
    wait_until(lambda: paused in (two_way.tmp / "b.log").read_text(), 30, what=paused)
    Daemons.kill(b.worker)  # the batch is open on a, its tick made by b's ask
    a.execute("insert into history select i, i, 1, 'a' from generate_series(41, 60) i")
    b.worker = two_way.daemons.start(str(b.ini), "worker")
    wait_until(lambda: len(two_way.rows_of("b", "history")) == 60, 30, what="a's 60 rows on b")
    assert_applied_once(b, set(range(1, 61)))


def test_two_masters_with_logical_capture_converge_without_echo(two_way: TwoWaySet, make_db) -> None:
    """Logical capture: a peer's apply runs under a replication origin, the capture daemon tags
    what it decodes of it, and the other master does not take it back."""
    a = two_way.add_master("a", make_db("a"), "--capture=logical")
    b = two_way.add_master("b", make_db("b"), "--capture=logical")
    for m in (a, b):
        make_tables(m, "t")
        m.run("add-table", "t")
    two_way.connect_all()
    two_way.start()
    a.execute("insert into t select i, 100, 'a' from generate_series(1, 50) i")
    b.execute("insert into t select i, 100, 'b' from generate_series(51, 100) i")
    two_way.wait_converged("t")
    two_way.stop_workers()
    a.execute("update t set note = 'a2' where id = 1")
    time.sleep(0.05)
    b.execute("update t set note = 'b2' where id = 1")  # later: wins
    two_way.start()
    two_way.wait_converged("t")
    assert two_way.rows("a", "t")[1] == (100, "b2")
    assert {k for _t, k, *_ in conflicts_of(a)} == {"update/update"}
    b.execute("truncate t")  # a TRUNCATE goes both ways once
    b.execute("insert into t values (200, 1, 'after truncate')")
    two_way.wait_converged("t")
    assert two_way.rows("a", "t") == {200: (1, "after truncate")}
    time.sleep(2)  # nothing comes back: the queues stay quiet once both applied everything
    with a.db.connect() as conn:
        tagged = conn.execute(
            "select count(*) from pgcascade.event where (ev_rare).ev_extra4 = 'b'"
        ).fetchone()[0]
        echo = conn.execute(
            "select count(*) from pgcascade.event where ev_type = 'I' and ev_data like '%after truncate%'"
            " and (ev_rare).ev_extra4 is null"
        ).fetchone()[0]
    assert tagged > 0, "the capture daemon did not tag what the peer's apply made"
    assert echo == 0, "a's capture sent b's insert on as a's own"
    assert two_way.rows("b", "t") == {200: (1, "after truncate")}
    # auto-ddl: a's DDL travels as a WAL message in order with its rows; b passes it on tagged
    a.cli("auto-ddl", "on")
    with a.db.connect() as conn, conn.transaction():
        conn.execute("alter table t add column x int not null default 5")
        conn.execute("insert into t values (201, 1, 'x', 6)")
    two_way.wait_converged("t")
    assert b.db.scalar("select sum(x) from t") == 11
    # b's capture daemon queues it from b's WAL, a moment after the apply's commit (asynchronous:
    # the daemon reads flushed WAL)
    wait_until(
        lambda: b.db.scalar(
            "select count(*) from pgcascade.event where ev_type = 'EXECUTE' and (ev_rare).ev_extra4 = 'a'"
        ),
        timeout=30,
        what="a's DDL passed on, tagged, in b's queue",
    )
    # a table a holds with rows, added on b empty: copied from a, under a's replication origin
    make_tables(a, "u")
    a.execute("insert into u select i, i, 'a' from generate_series(1, 500) i")
    a.run("add-table", "u")
    make_tables(b, "u")
    assert "copied from master a" in b.cli("add-table", "u").stdout
    two_way.wait_converged("u")
    b.execute("update u set note = 'b' where id = 7")
    two_way.wait_converged("u")
    assert len(two_way.rows("a", "u")) == 500 and two_way.rows("a", "u")[7] == (7, "b")
    with a.db.connect() as conn:  # the copy's rows did not come back to a as b's
        back = conn.execute(
            "select count(*) from pgcascade.conflict where table_name = 'public.u'"
        ).fetchone()[0]
    assert back == 0
    for n in ("a", "b"):  # the small batches went in one round trip each: none fell back
        assert "step by step after" not in (two_way.tmp / f"{n}.log").read_text()


def test_a_master_that_joins_copies_a_table_from_a_peer_while_the_others_write(
    two_way: TwoWaySet, make_db
) -> None:
    """Masters a and c hold a table and write to it; master b joins with the table empty and
    `add-table` copies it from a once, while a and c go on writing: c's changes that a had not
    applied at the copy's snapshot reach b from c's queue, from that point on.  All three end
    equal, and the copied rows count as a's version (each master writes rows of its own: no
    change may be judged a conflict)."""
    a, c = two_way.add_master("a", make_db("a")), two_way.add_master("c", make_db("c"))
    for m in (a, c):
        make_tables(m, "accounts")
        m.run("add-table", "accounts")
    two_way.connect_all()
    two_way.start()
    a.execute("insert into accounts select i, 0, 'a' from generate_series(1, 20000) i")
    wait_until(
        lambda: two_way.rows("c", "accounts").keys() == two_way.rows("a", "accounts").keys(), timeout=60
    )
    stop = threading.Event()
    written = {"a": 0, "b": 0, "c": 0}

    def writer(m: Master, first: int, last: int) -> None:
        rnd = random.Random(first)
        with m.db.connect(autocommit=True) as conn:
            while not stop.is_set():
                aid = rnd.randint(first, last)  # a range of its own per master: no conflict
                conn.execute(
                    "update accounts set balance = balance + 1, note = %s where id = %s", (m.name, aid)
                )
                if written[m.name] % 10 == 0:
                    conn.execute(
                        "insert into accounts values (%s, 0, %s)", (100000 * first + written[m.name], m.name)
                    )
                written[m.name] += 1

    threads = [
        threading.Thread(target=writer, args=(a, 1, 10000)),
        threading.Thread(target=writer, args=(c, 10001, 20000)),
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        b = two_way.add_master("b", make_db("b"))
        make_tables(b, "accounts")
        b.cli("add-table", "accounts")  # too early: joined so, it would never get a's rows
        r = b.cli("add-peer", "a", "--location", a.db.connstr, check=False)
        assert r.returncode == 2 and "public.accounts empty here and holding rows on master a" in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        b.cli("remove-table", "accounts")
        for m in (a, c):
            m.cli("add-peer", "b", "--location", b.db.connstr)
            b.cli("add-peer", m.name, "--location", m.db.connstr)
        said = b.cli("add-table", "accounts").stdout
        assert "copied from master a" in said, said
        two_way.start("b")
        log = two_way.tmp / "b.log"
        wait_until(lambda: log.exists() and "replayed from tick" in log.read_text(), timeout=60)
        time.sleep(3)
        b_writer = threading.Thread(target=writer, args=(b, 20001, 20001))  # inserts of its own
        b_writer.start()
        threads.append(b_writer)
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    two_way.wait_converged("accounts")
    assert min(written.values()) > 10, written

    def states() -> list[tuple[str, str]]:
        with b.db.connect() as conn:
            return conn.execute(
                "select queue_name, state from pgcascade.subscriber_table order by 1"
            ).fetchall()

    # the rows can be equal while c's copy process still walks its last (empty) batches up to
    # the worker's tick: the hand-over to ok follows within a few of them
    try:
        wait_until(lambda: states() == [("tw_a", "ok"), ("tw_c", "ok")], timeout=60)
    except TimeoutError:
        raise AssertionError(states()) from None
    assert "public.accounts  key: id  (from a: ok, from c: ok)" in b.cli("tables").stdout
    for m in two_way.masters.values():
        with m.db.connect() as conn:
            found = conn.execute(
                "select conflict_type, row_key, local_origin, local_time, remote_time, local_row, remote_row,"
                " tick_id from pgcascade.conflict"
            ).fetchall()
        assert found == [], f"{m.name}: {found[:5]}"


def test_truncates_on_one_master_racing_writes_on_the_others_converge(two_way: TwoWaySet, make_db) -> None:
    """Master a truncates a table again and again while b and c insert and update rows of it: a
    row change the truncating master had not seen is judged against the TRUNCATE by the policy
    (last-update-wins: the row stays if it is newer), on every master alike, so all three end
    equal - whatever order each received the TRUNCATEs and the changes in."""
    masters = [two_way.add_master(n, make_db(n)) for n in ("a", "b", "c")]
    for m in masters:
        make_tables(m, "t")
        m.execute("insert into t select i, 0, 'seed' from generate_series(1, 100) i")
        m.run("add-table", "t")
    two_way.connect_all()
    two_way.start()
    a, b, c = masters
    stop = threading.Event()
    errors: list[Exception] = []

    def writer(m: Master, first: int) -> None:
        rnd = random.Random(first)
        try:
            with m.db.connect() as conn:
                for n in itertools.count():
                    if stop.is_set():
                        return
                    conn.execute(  # keys of its own: every row change races a's truncates
                        "insert into t values (%s, 0, %s) on conflict (id) do update set balance = t.balance + 1",
                        (first + n, m.name),
                    )
                    conn.execute(
                        "update t set balance = balance + 1, note = %s where id = %s",
                        (m.name, first + rnd.randint(0, n)),
                    )
                    time.sleep(0.005)
        except psycopg.Error as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(m, k)) for m, k in ((b, 1000), (c, 1_000_000))]
    for t in threads:
        t.start()
    try:
        for i in range(6):
            time.sleep(0.7)
            if i % 2 == 0:
                a.execute("truncate t")
            else:  # rows inserted in the TRUNCATE's own transaction are after it
                with a.db.connect() as conn, conn.transaction():
                    conn.execute("truncate t")
                    conn.execute("insert into t values (%s, 1, 'a')", (-i - 1,))
        time.sleep(0.7)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    for m in masters:
        m.cli("wait-sync", "--timeout", "120")
    sums = two_way.checksums("t")
    assert len(set(sums.values())) == 1, f"t differs after wait-sync on every master: {sums}"
    rows = two_way.rows("a", "t")
    assert {k for k in rows if k < 0} == {-6}, sorted(rows)[:10]  # inserted with the last truncate
    assert any(k >= 1000 for k in rows), "no row written after the last truncate survived"
    kinds = {k for m in masters for _t, k, *_ in conflicts_of(m)}
    assert "update/truncate" in kinds, f"no change raced a truncate: {kinds}"
