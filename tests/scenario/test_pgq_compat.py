"""The pgq compatibility schema (install --pgq-compat) against the real PgQ 3.5 from Debian.

The differential test runs one script of PgQ calls - every function of PgQ's SQL API, its
warnings and errors, the corner cases (unknown and empty batches, retry, rotation, disabled
insert, per-transaction limit, session_replication_role, external and paused tickers, the
three capture triggers and their arguments) - against a database with the real PgQ and one
with pgcascade's pgq schema, and compares what each statement returned, warned or raised.
The deliberate differences (docs/pgq-compat.md) are asserted on their own.

Then PgQ's own clients: Skytools' Python pgq.Consumer (Debian's python3-pgq) consumes a
pgcascade queue exactly once across a SIGKILL, and Debian's pgqd ticks and maintains it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psycopg
import pytest
from conftest import run_cli
from test_londiste_import import stop, write_ini

from pgcascade.core import schema
from pgcascade.dev.localcluster import wait_until

SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3-pgq and python3-skytools (psycopg2)

# One statement per step.  "name := SQL" saves the first value of the result under `name`;
# "{name}" in a later step is replaced by it (each database keeps its own values).
SCRIPT = r"""
select pgq.version()
select pgq.create_queue(null)
select pgq.create_queue('tq')
select pgq.create_queue('tq')
select pgq.create_queue('tq2')
select queue_name, queue_ntables, queue_cur_table, queue_rotation_period, queue_external_ticker, queue_disable_insert, queue_ticker_paused, queue_ticker_max_count, queue_ticker_max_lag, queue_ticker_idle_period, queue_per_tx_limit, queue_extra_maint from pgq.queue order by queue_id
select tick_queue, tick_id, tick_event_seq from pgq.tick order by 1, 2
select pgq.set_queue_config('tq', 'ticker_max_lag', '0')
select pgq.set_queue_config('tq', 'ticker_idle_period', '0')
select pgq.set_queue_config('tq', 'disable_insert', 'true')
select pgq.set_queue_config('tq', 'queue_ticker_max_lag', '1')
select pgq.set_queue_config('tq', null, '1')
select pgq.set_queue_config('nope', 'ticker_max_lag', '1')
select pgq.set_queue_config('tq', 'ticker_max_count', 'abc')
select queue_ticker_max_lag, queue_ticker_idle_period from pgq.queue where queue_name = 'tq'
select pgq.register_consumer('tq', 'c1')
select pgq.register_consumer('tq', 'c1')
select pgq.register_consumer('nope', 'c1')
select pgq.register_consumer_at('tq', 'c2', 999)
select pgq.register_consumer_at('tq', 'c2', 1)
select sub_queue, sub_consumer, sub_last_tick, sub_batch, sub_next_tick from pgq.subscription order by 1, 2
select co_id, co_name from pgq.consumer order by 1
select pgq.next_batch('tq', 'c1')
select * from pgq.next_batch_info('tq', 'c1')
select pgq.next_batch('tq', 'nobody')
select pgq.insert_event('tq', 't1', 'd1')
select pgq.insert_event('tq', 't2', 'd2', 'x1', 'x2', 'x3', 'x4')
select pgq.insert_event('nope', 't', 'd')
select pgq.insert_event_raw('tq', 50, '2020-01-01 00:00:00+00', null, 3, 'raw', 'rd', null, null, null, 'x4')
select pgq.insert_event_raw('tq', null, null, null, null, 'raw2', null, null, null, null, null)
select pgq.insert_event_raw(null, null, null, null, null, 'raw2', null, null, null, null, null)
select pgq.ticker('tq')
select tick_queue, tick_id, tick_event_seq from pgq.tick order by 1, 2
b1 := select pgq.next_batch('tq', 'c1')
select batch_id = {b1}, cur_tick_id, prev_tick_id, cur_tick_event_seq, prev_tick_event_seq from pgq.next_batch_info('tq', 'c1')
select queue_name, consumer_name, prev_tick_id, tick_id, seq_start, seq_end, batch_start <= batch_end, lag >= '0' from pgq.get_batch_info({b1})
select queue_name, consumer_name, prev_tick_id, tick_id from pgq.get_batch_info(999999)
select ev_id, ev_retry, ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4 from pgq.get_batch_events({b1})
select count(*) from pgq.get_batch_events(999999)
select pgq.batch_event_sql(999999)
select count(*) from pgq.batch_event_tables(999999)
begin
select ev_id, ev_type from pgq.get_batch_cursor({b1}, 'evs', 2)
fetch all from evs
close evs
select ev_id, ev_type from pgq.get_batch_cursor({b1}, 'evs2', 10, 'ev_type like ''raw%''')
select ev_id, ev_type from pgq.get_batch_cursor({b1}, 'evs3', 0)
fetch all from evs3
select * from pgq.get_batch_cursor(null, 'evs4', 10)
commit
select pgq.event_retry({b1}, 1, 0)
select pgq.event_retry({b1}, 1, 0)
select pgq.event_retry({b1}, 424242, 0)
select pgq.event_retry(999999, 1, 0)
select pgq.event_retry({b1}, 2, '2000-01-01 00:00:00+00'::timestamptz)
select pgq.batch_retry({b1}, 0)
select pgq.batch_retry(999999, 0)
select ev_id, ev_owner is not null, ev_retry, ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4 from pgq.retry_queue order by ev_id
select pgq.finish_batch({b1})
select pgq.finish_batch({b1})
select pgq.next_batch('tq', 'c1')
select pgq.maint_retry_events()
select pgq.maint_retry_events()
select count(*) from pgq.retry_queue
select pgq.ticker('tq')
b2 := select pgq.next_batch('tq', 'c1')
select ev_id, ev_retry, ev_type, ev_data, ev_extra4 from pgq.get_batch_events({b2})
select pgq.finish_batch({b2})
b3 := select pgq.next_batch('tq', 'c2')
select ev_id, ev_retry, ev_type from pgq.get_batch_events({b3})
select pgq.event_retry_raw('tq', 'c1', now(), null, '2020-01-01 00:00:00+00', null, 'rr', 'rd', 'e1', null, null, null)
select pgq.event_retry_raw('tq', 'c1', now(), 77, '2020-01-01 00:00:00+00', 4, 'rr', 'rd', 'e1', null, null, null)
select pgq.event_retry_raw('tq', 'nobody', now(), 78, now(), 0, 'rr', 'rd', null, null, null, null)
select ev_id, ev_retry, ev_type, ev_data, ev_extra1 from pgq.retry_queue order by ev_id
select queue_name, queue_ntables, queue_cur_table, queue_rotation_period, queue_external_ticker, queue_ticker_paused, queue_ticker_max_count, queue_ticker_max_lag, queue_ticker_idle_period, ticker_lag >= '0', ev_per_sec >= 0, ev_new, last_tick_id from pgq.get_queue_info('tq')
select queue_name, ev_new, last_tick_id from pgq.get_queue_info() order by 1
select count(*) from pgq.get_queue_info('nope')
select queue_name, consumer_name, lag >= '0', last_seen >= '0', last_tick, current_batch = {b3}, next_tick, pending_events from pgq.get_consumer_info()
select queue_name, consumer_name, last_tick, pending_events from pgq.get_consumer_info('tq')
select queue_name, consumer_name, last_tick, pending_events from pgq.get_consumer_info('tq', 'c2')
select count(*) from pgq.get_consumer_info('nope', 'c2')
update pgq.queue set queue_disable_insert = true where queue_name = 'tq'
select pgq.insert_event('tq', 'no', 'no')
select regexp_replace(pgq.current_event_table('tq'), '^.*\.', '')
set session_replication_role = replica
select pgq.insert_event('tq', 'replica', 'yes')
select regexp_replace(pgq.current_event_table('tq'), '^.*\.', '')
reset session_replication_role
update pgq.queue set queue_disable_insert = false, queue_per_tx_limit = 2 where queue_name = 'tq'
select regexp_replace(pgq.current_event_table('tq'), '^.*\.', '')
select pgq.current_event_table('nope')
begin
select pgq.insert_event('tq', 'l', '1')
select pgq.insert_event('tq', 'l', '2')
select pgq.insert_event('tq', 'l', '3')
rollback
begin
select pgq.insert_event('tq', 'l', '1')
select pgq.insert_event('tq', 'l', '2')
commit
select pgq.insert_event('tq', 'l', '3')
update pgq.queue set queue_per_tx_limit = null where queue_name = 'tq'
select pgq.force_tick('tq')
select pgq.force_tick('nope')
select pgq.ticker('tq') > 0
select pgq.ticker('nope')
select pgq.set_queue_config('tq2', 'external_ticker', 'true')
select pgq.ticker('tq2')
select pgq.ticker('tq2', 7, '2020-01-01 00:00:00+00', 40)
select tick_id, tick_time = '2020-01-01 00:00:00+00', tick_event_seq from pgq.tick where tick_queue = 2 order by 1
select pgq.seq_getval(queue_event_seq) from pgq.queue where queue_name = 'tq2'
select pgq.ticker('tq', 99, now(), 1)
select pgq.set_queue_config('tq2', 'ticker_paused', 'true')
select pgq.ticker('tq2', 8, now(), 41)
select pgq.set_queue_config('tq2', 'external_ticker', 'false')
select pgq.ticker('tq2')
select pgq.set_queue_config('tq2', 'ticker_paused', 'false')
select pgq.ticker()
select pgq.finish_batch({b3})
select * from pgq.next_batch_custom('tq', 'c2', '1 hour', null, null)
select batch_id is not null, prev_tick_id, cur_tick_id from pgq.next_batch_custom('tq', 'c2', null, 1, null)
select batch_id is not null, prev_tick_id, cur_tick_id from pgq.next_batch_custom('tq', 'c2', null, null, '1 hour')
b4 := select batch_id from pgq.next_batch_info('tq', 'c2')
select pgq.finish_batch({b4})
select * from pgq.next_batch_custom('tq', 'c2', null, 1000000, null)
select * from pgq.next_batch_custom('tq', 'c2', null, null, '1 hour')
select next_tick_id, next_tick_seq from pgq.find_tick_helper(1, 1, now() - interval '1 day', 0, 1, null)
select next_tick_id from pgq.find_tick_helper(1, 1, now(), 0, null, '1 hour')
select next_tick_id from pgq.find_tick_helper(1, 100000, now(), 0, 1, null)
create sequence public.s1
select pgq.seq_setval('s1', 10)
select pgq.seq_setval('public.s1', 5)
select pgq.seq_getval('s1')
select pgq.quote_fqname('a.B'), pgq.quote_fqname('x'), pgq.quote_fqname('s.t.u')
select pgq.upgrade_schema()
select pgq.grant_perms('tq')
select pgq.grant_perms('nope')
select pgq.tune_storage('tq'), pgq.tune_storage('nope')
create table public.perm_src (a int)
create table public.perm_dst (a int)
grant select, insert on public.perm_src to pgq_reader
select pgq._grant_perms_from('public', 'perm_src', 'public', 'perm_dst')
select grantee, privilege_type from information_schema.table_privileges where table_name = 'perm_dst' and grantee like 'pgq%' order by 1, 2
select * from pgq.maint_tables_to_vacuum()
select * from pgq.maint_operations() where func_name not like 'pgcascade.%'
select pgq.set_queue_config('tq2', 'rotation_period', '0')
select * from pgq.maint_operations() where func_name not like 'pgcascade.%'
select pgq.maint_rotate_tables_step1('tq2')
select pgq.maint_rotate_tables_step2()
select pgq.maint_rotate_tables_step1('nope')
select queue_name, queue_cur_table from pgq.queue order by 1
select pgq.set_queue_config('tq2', 'rotation_period', '2 hours')
update pgq.queue set queue_extra_maint = array['public.my_maint', 'public.other'] where queue_name = 'tq'
select * from pgq.maint_operations() where func_name not like 'pgcascade.%'
select pgq.unregister_consumer('tq', 'c1')
select pgq.unregister_consumer('tq', 'c1')
select pgq.unregister_consumer('nope', 'c1')
select co_name from pgq.consumer order by 1
select count(*) from pgq.retry_queue
select pgq.drop_queue('tq')
select pgq.drop_queue('nope')
select pgq.drop_queue('tq', true)
select queue_name from pgq.queue
select co_name from pgq.consumer
select pgq.create_queue('trg')
select pgq.set_queue_config('trg', 'ticker_max_lag', '0')
create table public.t (id int primary key, name text, val numeric, ts timestamptz, tsz timestamp, b bool, j json, arr int[], "Odd Col" text, f float8, n int)
create trigger l after insert or update or delete on public.t for each row execute procedure pgq.logutriga('trg')
create trigger s after insert or update or delete on public.t for each row execute procedure pgq.sqltriga('trg')
create trigger j after insert or update or delete on public.t for each row execute procedure pgq.jsontriga('trg')
create trigger r after truncate on public.t for each statement execute procedure pgq.logutriga('trg')
create trigger rj after truncate on public.t for each statement execute procedure pgq.jsontriga('trg')
insert into public.t values (1, 'a b&c=d/e~f', 1.50, '2020-01-02 03:04:05.678+02', '2020-01-02 03:04:05', true, '{"x": [1, 2]}', '{1,2}', 'ö''"\', 2.5, null)
insert into public.t values (2, '', -3, '2020-01-02 03:04:05+00', '2020-01-02 03:04:05.5', false, 'null', '{}', E'tab\there\nnl', -1e-5, 7)
update public.t set name = 'x', n = 5 where id = 1
update public.t set name = name where id = 2
update public.t set id = 3 where id = 2
delete from public.t where id = 1
truncate public.t
create table public.nk (a int, b text)
create trigger l after insert or update or delete on public.nk for each row execute procedure pgq.logutriga('trg')
insert into public.nk values (1, 'x')
update public.nk set b = 'y'
create table public.t2 (id int, k2 text, v text, w text, primary key (k2, id))
create trigger l after insert or update or delete on public.t2 for each row execute procedure pgq.logutriga('trg', 'ignore=w', 'backup')
create trigger s after insert or update or delete on public.t2 for each row execute procedure pgq.sqltriga('trg', 'ignore=w', 'pkey=id')
create trigger j after insert or update or delete on public.t2 for each row execute procedure pgq.jsontriga('trg', 'ignore=w', 'backup', 'when=v is not null')
insert into public.t2 values (1, 'k', 'v1', 'w1')
insert into public.t2 values (2, 'k', null, 'w1')
update public.t2 set w = 'w2'
update public.t2 set v = 'v2' where id = 1
delete from public.t2 where id = 1
create table public.t3 (id int primary key, v text)
create trigger x before insert on public.t3 for each row execute procedure pgq.logutriga('trg', 'SKIP', 'ev_extra3=v||''!''', 'ev_type=''custom''')
insert into public.t3 values (1, 'a')
select count(*) from public.t3
create trigger y after insert on public.t3 for each row execute procedure pgq.logutriga('trg', 'SKIP')
insert into public.t3 values (2, 'b')
drop trigger y on public.t3
create trigger z after insert on public.t3 for each row execute procedure pgq.sqltriga('trg', 'deny')
insert into public.t3 values (3, 'c')
drop trigger x on public.t3
drop trigger z on public.t3
create trigger y after insert on public.t3 for each row execute procedure pgq.logutriga()
insert into public.t3 values (4, 'd')
drop trigger y on public.t3
set session_replication_role = replica
insert into public.t (id, name) values (10, 'replica: trigger does not fire')
reset session_replication_role
select ev_id, ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4 from pgq.event_template where ev_extra1 is distinct from 'nothing' and ev_type is distinct from 'raw' and ev_id > 0 and ev_time > now() - interval '1 hour' and ev_txid > 0 order by ev_id
"""


def parse_script(script: str) -> list[tuple[str | None, str]]:
    steps = []
    for line in script.strip().splitlines():
        m = re.match(r"^(\w+) := (.*)$", line)
        steps.append((m.group(1), m.group(2)) if m else (None, line))
    return steps


def run_script(conninfo: str) -> list[tuple]:
    """Each step's outcome: ('rows', rows) or ('error', message), with the warnings it raised."""
    outcomes: list[tuple] = []
    saved: dict[str, str] = {}
    warnings: list[str] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.add_notice_handler(
            lambda d: (
                warnings.append(d.message_primary or "") if d.severity_nonlocalized == "WARNING" else None
            )
        )
        conn.execute("set timezone = 'UTC'; set datestyle = 'ISO, YMD'; set extra_float_digits = 1")
        for name, sql in parse_script(SCRIPT):
            sql = re.sub(r"\{(b\d+)\}", lambda m: saved[m.group(1)], sql)
            warnings.clear()
            try:
                cur = conn.execute(sql)
                rows = cur.fetchall() if cur.description else []
                if sql.startswith("fetch"):  # a batch cursor's rows: leave out ev_time and ev_txid
                    rows = [(r[0], *r[3:]) for r in rows]
                outcome: tuple = ("rows", [tuple(str(v) if v is not None else None for v in r) for r in rows])
                if name:
                    saved[name] = str(rows[0][0])
            except psycopg.Error as e:
                outcome = ("error", e.diag.message_primary)
            outcomes.append((sql, outcome, tuple(warnings)))
    return outcomes


def describe(expected: tuple, got: tuple) -> str:
    """One differing statement; of two row lists, only the rows that differ."""
    (sql, e_out, e_warn), (_, g_out, g_warn) = expected, got
    if e_out[0] == g_out[0] == "rows" and e_warn == g_warn:
        only_e = [r for r in e_out[1] if r not in g_out[1]]
        only_g = [r for r in g_out[1] if r not in e_out[1]]
        return (
            f"{sql}\n"
            + "".join(f"   only PgQ:       {r}\n" for r in only_e)
            + "".join(f"   only pgcascade: {r}\n" for r in only_g)
        )
    return f"{sql}\n   PgQ:       {e_out} {e_warn or ''}\n   pgcascade: {g_out} {g_warn or ''}"


@pytest.fixture
def real_and_compat(make_db):
    real, compat = make_db("a"), make_db("a")
    with real.connect() as conn:
        conn.execute("create extension pgq")
    with compat.connect() as conn:
        schema.install(conn, pgq_compat=True)
    return real, compat


def test_the_pgq_schema_answers_every_call_as_pgq_does(real_and_compat):
    real, compat = real_and_compat
    expected, got = run_script(real.connstr), run_script(compat.connstr)
    diffs = [describe(e, g) for e, g in zip(expected, got, strict=True) if e[1:] != g[1:]]
    assert not diffs, f"{len(diffs)} of {len(expected)} statements differ:\n" + "\n".join(diffs)
    # the script reached its end on both, with the capture triggers' events compared last
    assert expected[-1][1][0] == "rows" and len(expected[-1][1][1]) > 20


def test_what_differs_from_pgq_on_purpose(real_and_compat, tmp_path: Path, write_config):
    real, compat = real_and_compat
    with compat.connect() as conn:
        conn.execute("select pgq.create_queue('dq'), pgq.register_consumer('dq', 'c')")
        conn.execute("select pgq.insert_event('dq', 't', 'd'), pgcascade.ticker('dq')")
        batch = conn.execute("select pgq.next_batch('dq', 'c')").fetchone()[0]
        # a pgcascade batch reads every partition of its queue, PgQ's the current and the previous one
        tables = [r[0] for r in conn.execute("select * from pgq.batch_event_tables(%s)", (batch,))]
        assert tables == ["pgcascade.event_1_1", "pgcascade.event_1_2", "pgcascade.event_1_0"]
        for t in tables:
            assert conn.execute("select to_regclass(%s)", (t,)).fetchone()[0] is not None
        assert conn.execute("select pgq.current_event_table('dq')").fetchone()[0] == "pgcascade.event_1_0"
        # pgqd also runs pgcascade's upkeep: tick cleanup, the cascade's global watermark, partitions,
        # key-change triggers
        ops = conn.execute(
            "select * from pgq.maint_operations() where func_name like 'pgcascade.%'"
        ).fetchall()
        assert ops == [
            ("pgcascade.maint_global_watermark", "dq"),
            ("pgcascade.maint_tick_cleanup", "dq"),
            ("pgcascade.maint_capture_partitions", "dq"),
            ("pgcascade.maint_key_triggers", "dq"),
        ]
        # the queue is pgcascade's: its own API sees what PgQ's made
        assert (
            conn.execute("select count(*) from pgcascade.get_batch_events(%s)", (batch,)).fetchone()[0] == 1
        )
    # where a real PgQ lives, the compatibility schema is refused, on one line, and nothing changes
    ini = write_config("real", db=real.connstr, queue_name="dq")
    r = run_cli(ini, "install", "--pgq-compat")
    assert r.returncode == 2 and "real PgQ" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r
    assert real.scalar("select to_regnamespace('pgcascade')") is None
    assert real.scalar("select pgq.version()") == "3.5"


CONSUMER = textwrap.dedent(
    """
    import sys
    import pgq

    class Recorder(pgq.Consumer):
        # every event is recorded in the same transaction as finish_batch; events with an id
        # divisible by 7 are sent to the retry queue once and recorded when they come back
        def process_event(self, db, ev):
            if ev.id % 7 == 0 and not ev.retry:
                ev.tag_retry(0)
                return
            db.cursor().execute("insert into got (ev_id, data, retry) values (%s, %s, %s)",
                                (ev.id, ev.data, ev.retry))
            ev.tag_done()

    Recorder("recorder", "db", sys.argv[1:]).start()
    """
)


def test_skytools_consumer_reads_a_pgcascade_queue_ticked_by_pgqd_exactly_once(make_db, tmp_path: Path):
    db = make_db("a")
    with db.connect() as conn:
        schema.install(conn, pgq_compat=True)
        conn.execute("create table got (ev_id int8, data text, retry int4)")  # no key: a duplicate would show
        conn.execute("select pgq.create_queue('cq'), pgq.set_queue_config('cq', 'ticker_max_lag', '0.1')")
        conn.execute("select pgq.register_consumer('cq', 'recorder')")
    pgqd = subprocess.Popen(
        [
            "/usr/bin/pgqd",
            str(
                write_ini(
                    tmp_path / "pgqd.ini",
                    "pgqd",
                    base_connstr=db.cluster.connstr("postgres").rsplit(" dbname=", 1)[0],
                    initial_database="postgres",
                    database_list=db.name,
                    logfile=tmp_path / "pgqd.log",
                    pidfile=tmp_path / "pgqd.pid",
                    ticker_period=0.1,
                    retry_period=0.5,
                    maint_period=1,
                )
            ),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    script = tmp_path / "recorder.py"
    script.write_text(CONSUMER)
    ini = write_ini(
        tmp_path / "recorder.ini",
        "recorder",
        job_name="recorder",
        db=db.connstr,
        queue_name="cq",
        logfile=tmp_path / "recorder.log",
        pidfile=tmp_path / "recorder.pid",
        loop_delay=0.1,
    )

    def consumer() -> subprocess.Popen:
        return subprocess.Popen(
            [SYSTEM_PYTHON, str(script), str(ini)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    sent = 0
    recorder = consumer()
    try:
        with db.connect() as conn:
            for round_ in range(40):
                with conn.transaction():
                    for _ in range(25):
                        conn.execute("select pgq.insert_event('cq', 'row', %s)", (f"payload {sent}",))
                        sent += 1
                time.sleep(0.05)
                if round_ == 20:  # mid-stream, the consumer dies between two statements of a batch
                    recorder.send_signal(signal.SIGKILL)
                    recorder.wait()
                    recorder = consumer()

        def all_recorded() -> bool:
            return db.scalar("select count(*) from got") >= sent

        wait_until(all_recorded, timeout=60, what="the consumer records every event")
        time.sleep(1.5)  # a duplicate, if any, would land now
        with db.connect() as conn:
            rows = conn.execute("select data, count(*), max(retry) from got group by data").fetchall()
            oldest_tick = conn.execute("select min(tick_id) from pgq.tick").fetchone()[0]
            last_tick = conn.execute("select max(tick_id) from pgq.tick").fetchone()[0]
            retried = conn.execute("select count(*) from got where retry = 1").fetchone()[0]
            # an event came back from the retry queue exactly when its id asked for it
            misrouted = conn.execute(
                "select count(*) from got where (ev_id % 7 = 0) <> (retry is not distinct from 1)"
            ).fetchone()[0]
    finally:
        stop(recorder)
        stop(pgqd)
    assert {r[0] for r in rows} == {f"payload {i}" for i in range(sent)}
    assert all(r[1] == 1 for r in rows), [r for r in rows if r[1] != 1][:5]
    assert retried > sent // 10 and misrouted == 0  # retried events came back through pgqd's retry
    assert last_tick > 20, "pgqd ticks the queue"
    assert oldest_tick > 1, "pgqd's maintenance cleans up the ticks the consumer has passed"
