"""The `pgcascade` command as a user runs it: install and upgrade, queue administration, status,
and what every mistake looks like (one line on stderr, exit code 2 for usage/config/input errors,
1 for run-time failures, never a traceback, never a password).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psycopg
import pytest

from pgcascade.core import schema
from pgcascade.dev.localcluster import wait_until


def one_line(r) -> str:
    """The single line a failed command printed on stderr."""
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {r.stderr!r}"
    assert lines[0].startswith("pgcascade: "), lines[0]
    return lines[0]


def ok(r) -> str:
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr}"
    return r.stdout


def table_rows(text: str) -> list[list[str]]:
    """The body rows of a table `status` printed, as lists of cell texts."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def events_of_next_batch(connstr: str, queue: str, consumer: str) -> list[tuple]:
    """next_batch + get_batch_events + finish_batch; [] when there is no batch."""
    with psycopg.connect(connstr, autocommit=True) as conn:
        batch = conn.execute("select pgcascade.next_batch(%s, %s)", (queue, consumer)).fetchone()[0]
        if batch is None:
            return []
        rows = conn.execute(
            "select ev_id, ev_type, ev_data, ev_extra1 from pgcascade.get_batch_events(%s)", (batch,)
        ).fetchall()
        conn.execute("select pgcascade.finish_batch(%s)", (batch,))
        return rows


def insert_event(connstr: str, queue: str, data: str) -> int:
    with psycopg.connect(connstr, autocommit=True) as conn:
        return conn.execute("select pgcascade.insert_event(%s, 'cli', %s)", (queue, data)).fetchone()[0]


# --- install, queue administration, status -------------------------------------------------------------


def test_install_is_idempotent_and_status_shows_queues_and_consumers(make_db, write_config, cli):
    db = make_db()  # empty: no pgcascade yet
    cfg = write_config("cli", db=db.connstr)
    latest = schema.LATEST_VERSION

    assert ok(cli(cfg, "install")).strip() == f"pgcascade schema upgraded from version 0 to {latest}"

    assert ok(cli(cfg, "queue", "create", "q")).strip() == "queue q: created"
    assert ok(cli(cfg, "queue", "create", "q")).strip() == "queue q: exists already"
    assert ok(cli(cfg, "queue", "register", "q", "c")).strip() == "consumer c on q: registered"
    assert ok(cli(cfg, "queue", "register", "q", "c")).strip() == "consumer c on q: was registered already"
    ev = insert_event(db.connstr, "q", "kept across install")

    # a second install changes nothing but the functions: queue, consumer and event survive
    assert ok(cli(cfg, "install")).strip() == f"pgcascade schema is at version {latest}; functions refreshed"
    assert ok(cli(cfg, "install")).strip() == f"pgcascade schema is at version {latest}; functions refreshed"
    versions = [tuple(r) for r in db.connect().execute("select version, name from pgcascade.schema_version")]
    assert versions == [(m.version, m.name) for m in schema.migrations()]

    assert re.fullmatch(r"queue q: tick \d+", ok(cli(cfg, "queue", "tick", "q")).strip())
    assert events_of_next_batch(db.connstr, "q", "c") == [(ev, "cli", "kept across install", None)]

    ok(cli(cfg, "queue", "create", "other"))
    ok(cli(cfg, "queue", "register", "other", "c2"))
    ok(cli(cfg, "queue", "config", "other", "ticker_paused=true"))
    wide = {**os.environ, "COLUMNS": "200"}  # a wide terminal: rich wraps at 80 columns otherwise
    out = ok(cli(cfg, "status", env=wide))
    queues_part, consumers_part = re.split(r"^consumers\s*$", out, flags=re.M)
    assert queues_part.lstrip().startswith("queues")
    queue_rows = {r[0]: r for r in table_rows(queues_part)}
    assert set(queue_rows) == {"q", "other (paused)"}, out
    assert queue_rows["q"][6] == "1"  # one consumer
    assert {(r[0], r[1]) for r in table_rows(consumers_part)} == {("q", "c"), ("other", "c2")}, out

    # unregister and drop show up in status too
    assert ok(cli(cfg, "queue", "unregister", "other", "c2")).strip() == "consumer c2 on other: unregistered"
    assert ok(cli(cfg, "queue", "drop", "other")).strip() == "queue other: dropped"
    out = ok(cli(cfg, "status", env=wide))
    assert "other" not in out and "c2" not in out
    assert re.search(r"│ q\s+│", out)


def test_queue_config_sets_the_values(db, write_config, cli):
    cfg = write_config("qc", db=db.connstr)
    ok(cli(cfg, "queue", "create", "q"))
    out = ok(cli(cfg, "queue", "config", "q", "ticker_max_count=7", "queue_ticker_max_lag=2 seconds"))
    assert out.strip() == "queue q: ticker_max_count=7, queue_ticker_max_lag=2 seconds"
    row = (
        db.connect()
        .execute(
            "select queue_ticker_max_count, extract(epoch from queue_ticker_max_lag) from pgcascade.queue"
        )
        .fetchone()
    )
    assert tuple(row) == (7, 2)


def test_upgrade_from_version_1(make_db, write_config, cli):
    db = make_db()
    with db.connect() as conn:
        assert schema.install(conn, target=1, with_functions=False) == (0, 1)
    # version 1 only: no retry table, no functions
    assert db.scalar("select to_regclass('pgcascade.retry_queue')") is None
    assert db.scalar("select to_regproc('pgcascade.create_queue')") is None
    cfg = write_config("up", db=db.connstr)

    out = ok(cli(cfg, "install"))
    first, *notes = out.strip().splitlines()
    assert first == f"pgcascade schema upgraded from version 1 to {schema.LATEST_VERSION}"
    # crossing migration 12 tells where passwords live now (locations no longer hold them)
    assert len(notes) == 1 and "no longer carry passwords" in notes[0], notes
    versions = [tuple(r) for r in db.connect().execute("select version, name from pgcascade.schema_version")]
    assert versions == [(m.version, m.name) for m in schema.migrations()]
    assert [v for v, _ in versions] == list(range(1, schema.LATEST_VERSION + 1))

    # and a queue works end to end, retries included (migration 2's table)
    ok(cli(cfg, "queue", "create", "q"))
    ok(cli(cfg, "queue", "register", "q", "c"))
    ev = insert_event(db.connstr, "q", "after upgrade")
    ok(cli(cfg, "queue", "tick", "q"))
    with db.connect() as conn:
        batch = conn.execute("select pgcascade.next_batch('q', 'c')").fetchone()[0]
        assert batch is not None
        rows = conn.execute("select ev_id, ev_data from pgcascade.get_batch_events(%s)", (batch,)).fetchall()
        assert rows == [(ev, "after upgrade")]
        conn.execute("select pgcascade.event_retry(%s::int8, %s::int8, 0::int4)", (batch, ev))
        conn.execute("select pgcascade.finish_batch(%s)", (batch,))
        assert conn.execute("select count(*) from pgcascade.retry_queue").fetchone()[0] == 1
    # the next install is a no-op
    assert "functions refreshed" in ok(cli(cfg, "install"))


# --- usage, config and input errors: exit 2, one line ------------------------------------------------


def write_ini(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.ini"
    p.write_text(text)
    return p


CONFIG_ERRORS = {
    # name: (ini text or None for no file, args, expected fragment)
    "no config file": (None, ("{missing}", "status"), "config file not found"),
    "no config at all": (None, ("status",), "needs a config file"),
    "no section": ("[other]\njob_name = x\n", ("{ini}", "status"), "no [pgcascade] section"),
    "not an ini": ("just some text\n", ("{ini}", "status"), "cannot parse"),
    "no job_name": ("[pgcascade]\ndb = dbname=x\n", ("{ini}", "status"), "job_name is missing"),
    "no db": ("[pgcascade]\njob_name = x\n", ("{ini}", "status"), "db is not set"),
    "bad db string": (
        "[pgcascade]\njob_name = x\ndb = host=127.0.0.1 password=secret nosuchoption=1\n",
        ("{ini}", "install"),
        'invalid connection option "nosuchoption"',
    ),
    "bad number": (
        "[pgcascade]\njob_name = x\nticker_period = fast\n",
        ("ticker", "{ini}"),
        "ticker_period = 'fast': must be a number of seconds",
    ),
    "unknown verb": (
        "[pgcascade]\njob_name = x\n",
        ("{ini}", "frobnicate"),
        "No such command 'frobnicate'. (try: pgcascade --help)",
    ),
    "unknown queue verb": (
        "[pgcascade]\njob_name = x\n",
        ("{ini}", "queue", "frob"),
        "No such command 'frob'. (try: pgcascade queue --help)",
    ),
    "missing argument": ("[pgcascade]\njob_name = x\n", ("{ini}", "queue", "create"), "Missing argument"),
    "unknown option": ("[pgcascade]\njob_name = x\n", ("{ini}", "status", "--bogus"), "No such option"),
    "not KEY=VALUE": (
        "[pgcascade]\njob_name = x\n",
        ("{ini}", "queue", "config", "q", "x"),
        "expected KEY=VALUE",
    ),
    "-d without pidfile": (
        "[pgcascade]\njob_name = x\n",
        ("ticker", "{ini}", "-d"),
        "-d needs logfile and pidfile",
    ),
    "-s without pidfile": ("[pgcascade]\njob_name = x\n", ("ticker", "{ini}", "-s"), "pidfile is not set"),
    "--sync-watermark with a hole": (
        "[pgcascade]\njob_name = x\ndb = dbname=x\n",
        ("{ini}", "create-leaf", "l", "--provider", "dbname=y", "--sync-watermark", "a,,b"),
        "give node names separated by commas, each once",
    ),
    "unknown conflict policy": (
        "[pgcascade]\njob_name = x\ndb = dbname=x\nqueue_name = q\n",
        ("{ini}", "add-peer", "b", "--location", "dbname=y", "--conflict", "newest-wins"),
        "unknown conflict policy 'newest-wins'",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_and_usage_errors_exit_2_with_one_line(case, tmp_path, cli):
    text, args, fragment = CONFIG_ERRORS[case]
    ini = write_ini(tmp_path, text) if text is not None else None
    args = [a.format(ini=ini, missing=tmp_path / "missing.ini") for a in args]
    r = cli(*args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    line = one_line(r)
    assert fragment in line
    assert "secret" not in r.stdout + r.stderr
    assert r.stdout == ""


DB_INPUT_ERRORS = {
    "unknown parameter": (("queue", "config", "q", "badparam=1"), 'unknown queue parameter "badparam"'),
    "not an interval": (("queue", "config", "q", "ticker_max_lag=notaninterval"), "invalid input syntax"),
    "not an integer": (("queue", "config", "q", "ticker_max_count=abc"), "invalid input syntax"),
    "integer out of range": (("queue", "config", "q", "ticker_max_count=99999999999"), "out of range"),
    "not a boolean": (("queue", "config", "q", "ticker_paused=maybe"), "invalid input syntax"),
    "ntables shrinks": (("queue", "config", "q", "ntables=2"), "ntables can only grow"),
    "config of unknown queue": (("queue", "config", "nosuchqueue", "ticker_max_count=1"), "does not exist"),
    "register on unknown queue": (
        ("queue", "register", "nosuchqueue", "c"),
        'queue "nosuchqueue" does not exist',
    ),
    "unregister unknown consumer": (
        ("queue", "unregister", "q", "nosuch"),
        'consumer "nosuch" is not registered',
    ),
    "tick of unknown queue": (("queue", "tick", "nosuchqueue"), "does not exist"),
    "drop of unknown queue": (("queue", "drop", "nosuchqueue"), "does not exist"),
    "drop with consumers": (("queue", "drop", "q"), "registered consumer"),
    "empty queue name": (("queue", "create", ""), "must not be empty"),
    "tick of an externally ticked queue": (("queue", "tick", "ext"), "takes its ticks from its provider"),
}


@pytest.mark.parametrize("case", list(DB_INPUT_ERRORS))
def test_bad_input_to_the_database_exits_2_with_one_line(case, db, write_config, cli):
    cfg = write_config("bad", db=db.connstr)
    ok(cli(cfg, "queue", "create", "q"))
    ok(cli(cfg, "queue", "register", "q", "c"))
    ok(cli(cfg, "queue", "create", "ext"))
    ok(cli(cfg, "queue", "config", "ext", "external_ticker=true"))
    before = db.connect().execute("select * from pgcascade.queue order by queue_id").fetchall()
    args, fragment = DB_INPUT_ERRORS[case]
    r = cli(cfg, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert fragment in one_line(r)
    assert r.stdout == ""
    # nothing changed
    assert db.connect().execute("select * from pgcascade.queue order by queue_id").fetchall() == before
    assert db.scalar("select count(*) from pgcascade.tick") == 2  # the first tick of each queue
    assert db.scalar("select count(*) from pgcascade.subscription") == 1


def test_queue_config_is_all_or_nothing(db, write_config, cli):
    cfg = write_config("aon", db=db.connstr)
    ok(cli(cfg, "queue", "create", "q"))
    r = cli(cfg, "queue", "config", "q", "ticker_max_count=7", "ticker_max_lag=soon")
    assert r.returncode == 2
    assert "soon" in one_line(r)
    assert db.scalar("select queue_ticker_max_count from pgcascade.queue where queue_name = 'q'") == 500


# --- run-time failures: exit 1, one line, no password -------------------------------------------------


@pytest.mark.parametrize(
    "dbstr",
    [
        "host=127.0.0.1 port=1 user=postgres password=secret dbname=x",
        "postgresql://postgres:secret@127.0.0.1:1/x",
    ],
)
@pytest.mark.parametrize("verb", [("status",), ("install",), ("queue", "create", "q"), ("-v", "status")])
def test_unreachable_database_exits_1_with_one_line_and_no_password(dbstr, verb, tmp_path, cli):
    ini = write_ini(tmp_path, f"[pgcascade]\njob_name = x\ndb = {dbstr}\n")
    args = [verb[0], ini, *verb[1:]] if verb[0] == "-v" else [ini, *verb]
    r = cli(*args)
    assert r.returncode == 1, (r.stdout, r.stderr)
    line = one_line(r)
    assert "Connection refused" in line or "connection failed" in line
    assert "secret" not in r.stdout + r.stderr


def test_password_never_appears_in_output_or_log(tmp_path, write_config, cli, daemons):
    cfg = write_config(
        "pw", db="host=127.0.0.1 port=1 user=postgres password=s3cr3t dbname=app", ticker_period=0.05
    )
    log = tmp_path / "pw.log"
    outputs = []
    for args in ((cfg, "status"), (cfg, "install"), ("-v", cfg, "queue", "create", "q")):
        r = cli(*args)
        assert r.returncode == 1
        one_line(r)
        outputs += [r.stdout, r.stderr]
    # the ticker, verbose, logs its failures to connect
    p = daemons.start("-v", "ticker", cfg)
    wait_until(
        lambda: log.exists() and "retrying" in log.read_text(), 10, what="the ticker's connect failure"
    )
    r = cli("ticker", cfg, "-s")
    assert r.returncode == 0, r.stderr
    assert p.wait(timeout=10) == 0
    outputs += [p.output(), r.stdout, r.stderr]
    text = log.read_text()
    assert "db app: connection failed" in text
    assert all("s3cr3t" not in o for o in outputs), outputs
    assert "s3cr3t" not in text


def test_wrong_password_is_not_shown(private_cluster, tmp_path, write_config, cli, daemons):
    """A server that asks for a password: the failure says so, and the password given is not shown."""
    pc = private_cluster
    with pc.connect() as conn:
        conn.execute("create role pwuser login password 'right-one'")
        hba = conn.execute("show hba_file").fetchone()[0]
        # first match wins: pwuser must give a password, everybody else stays trusted
        old = Path(hba).read_text()
        Path(hba).write_text("host all pwuser 127.0.0.1/32 scram-sha-256\n" + old)
        conn.execute("select pg_reload_conf()")
    good = write_config(
        "good", db=f"host=127.0.0.1 port={pc.port} user=pwuser password=right-one dbname=postgres"
    )
    with pc.connect() as conn:
        conn.execute("grant create on database postgres to pwuser")
    wait_until(lambda: cli(good, "install").returncode == 0, 10, what="pwuser to log in with its password")

    cfg = write_config(
        "wrong", db=f"host=127.0.0.1 port={pc.port} user=pwuser password=s3cr3t dbname=postgres"
    )
    r = cli(cfg, "status")
    assert r.returncode == 1
    assert 'password authentication failed for user "pwuser"' in one_line(r)
    assert "s3cr3t" not in r.stdout + r.stderr

    p = daemons.start("-v", "ticker", cfg)
    log = tmp_path / "wrong.log"
    wait_until(
        lambda: log.exists() and "password authentication failed" in log.read_text(), 10, what="the log"
    )
    daemons.kill(p, signal.SIGTERM)
    assert "s3cr3t" not in log.read_text() + p.output()
