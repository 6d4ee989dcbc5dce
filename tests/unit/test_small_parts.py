"""Pure parts that need no server: roles, password redaction, key ranges, buckets, hooks."""

import logging
import os
import socket
import subprocess
import time

import pytest
from conftest import SECRET_DSNS
from psycopg.conninfo import conninfo_to_dict

from pgcascade.core.config import JobConfig, WorkerSettings
from pgcascade.core.daemon import LOG_FORMAT, RedactingFormatter
from pgcascade.core.errors import ConfigError, redact
from pgcascade.core.hooks import pause_point
from pgcascade.core.pgconn import has_secret, without_secrets
from pgcascade.core.privileges import grant_hint, quote_ident
from pgcascade.pgq.node import Node, NodeRole, NodeType
from pgcascade.pipeline import segments as sg
from pgcascade.pipeline.compare import diff_keys, range_buckets
from pgcascade.replica.delay import refuse_apply_delay
from pgcascade.replica.worker import batch_cap


def test_node_roles_follow_the_skytools_table():
    root, branch, leaf = (NodeRole(t) for t in NodeType)
    assert (root.captures_changes, root.has_queue, root.reads_provider_queue) == (True, True, False)
    assert (branch.copies_events, branch.has_queue, branch.reads_provider_queue) == (True, True, True)
    assert (leaf.has_queue, leaf.may_merge_ticks, leaf.copies_events) == (False, True, False)


def test_apply_delay_is_refused_but_on_a_leaf(tmp_path):
    delayed = JobConfig(tmp_path / "n.ini", "n", worker=WorkerSettings(apply_delay=3600.0))

    def node(node_type: NodeType, **extra) -> Node:
        return Node("q", "n1", node_type, "p", "n1", 7, False, None, **extra)

    refuse_apply_delay(delayed, node(NodeType.LEAF))
    refuse_apply_delay(JobConfig(tmp_path / "n.ini", "n"), node(NodeType.BRANCH))  # no delay set
    for refused, what in (
        (node(NodeType.BRANCH), "is a branch"),
        (node(NodeType.ROOT), "is a root"),
        (node(NodeType.LEAF, combined_queue="all"), "is a merge-leaf"),
        (node(NodeType.LEAF, peer_of="q_a"), "is a master"),
    ):
        with pytest.raises(ConfigError, match=f"apply_delay is for a leaf, and n1 {what}"):
            refuse_apply_delay(delayed, refused)


@pytest.mark.parametrize(
    "text, hidden",
    [
        ("host=h password=s3cret dbname=x", "s3cret"),
        ("host=h password='se cret' dbname=x", "se cret"),
        ("postgresql://u:s3cret@h/db", "s3cret"),
        ("PASSWORD = s3cret", "s3cret"),
        ("dbname=x PassWord=s3cret", "s3cret"),
        ("postgres://u:s3cret@h/db", "s3cret"),
    ],
)
def test_passwords_never_reach_a_log_line(text, hidden):
    assert hidden not in redact(text)
    assert "***" in redact(text)
    record = logging.LogRecord("pgcascade", logging.INFO, __file__, 1, "connecting to %s", (text,), None)
    assert hidden not in RedactingFormatter(LOG_FORMAT).format(record)


def test_log_lines_show_the_time_as_logging_does():
    mine, theirs = RedactingFormatter(LOG_FORMAT), logging.Formatter(LOG_FORMAT)
    start = time.time()
    for created in (start, start + 0.25, start + 0.999, start + 1.001, start + 3600.5, start):
        record = logging.LogRecord("pgcascade", logging.INFO, __file__, 1, "{count: 4}", None, None)
        record.created, record.msecs = created, int((created - int(created)) * 1000)
        assert mine.format(record) == theirs.format(record)


@pytest.mark.parametrize("dsn", SECRET_DSNS)
def test_a_stored_location_keeps_everything_but_the_password(dsn):
    stored = without_secrets(dsn)
    assert has_secret(dsn) and not has_secret(stored)
    assert "s3" not in stored and "k3y" not in stored
    kept = {k: v for k, v in conninfo_to_dict(dsn).items() if k not in ("password", "sslpassword")}
    assert conninfo_to_dict(stored) == kept
    assert without_secrets("host=h dbname=x") == "host=h dbname=x"  # untouched when there is none


def test_a_refused_daemon_is_told_the_grant_to_run():
    srr = 'permission denied to set parameter "session_replication_role"'
    assert (
        grant_hint(srr, "repl", 150000)
        == "as a superuser, GRANT SET ON PARAMETER session_replication_role TO repl"
    )
    assert "only superusers" in grant_hint(srr, "repl", 140000) and "ALTER ROLE repl SUPERUSER" in grant_hint(
        srr, "repl", 140000
    )
    assert "15+" in grant_hint(srr, "repl", 0)
    slot = "must be superuser or replication role to use replication slots"
    assert "ALTER ROLE repl REPLICATION" in grant_hint(slot, "repl", 150000)
    stream = "connection failed: ... FATAL:  must be superuser or replication role to start walsender"
    assert "ALTER ROLE repl REPLICATION" in grant_hint(stream, "repl", 150000)
    login = 'connection failed: ... FATAL:  permission denied for database "shop"'
    assert 'GRANT CONNECT ON DATABASE "shop" TO repl' in grant_hint(login, "repl", 150000)
    table = "permission denied for table pgbench_accounts"
    assert "ALTER TABLE pgbench_accounts OWNER TO repl" in grant_hint(table, "repl", 150000)
    assert "owner of schema pgcascade" in grant_hint("permission denied for schema pgcascade", "repl", 0)
    assert quote_ident("Repl Role") == '"Repl Role"' and quote_ident("repl_1") == "repl_1"


def test_cut_points_spread_a_sorted_sample_evenly_and_never_repeat_a_cut():
    keys = [[str(i)] for i in range(100)]
    assert sg.cut_points(keys, 4) == [["25"], ["50"], ["75"]]
    assert sg.cut_points([["a"]] * 50 + [["b"]] * 50, 4) == [["a"], ["b"]]
    assert sg.cut_points(keys[:2], 4) == []  # fewer keys than ranges: one range


def test_buckets_for_keeps_about_leaf_rows_per_bucket():
    assert sg.buckets_for(100, 32) == 64
    assert sg.buckets_for(250_000, 32) == 8192
    assert sg.buckets_for(10**9, 32) == 65536


def test_integer_buckets_cover_the_range_and_fall_back_to_hashes_on_overflow():
    b = range_buckets(64, ["1000"], ["2000"], (0, 5000))
    assert (b.count, b.base, b.width) == (64, 1000, 16)
    open_ended = range_buckets(64, None, None, (10, 20))
    assert open_ended.base == 10 and open_ended.width == 1
    assert range_buckets(64, None, None, None).width is None
    assert range_buckets(64, [str(-(2**62))], [str(2**62)], (0, 1)).width is None


def test_diff_keys_names_missing_extra_and_different_rows():
    prov = {(1,): "a", (2,): "b", (3,): "c"}
    sub = {(1,): "a", (2,): "x", (4,): "d"}
    assert sorted(diff_keys(prov, sub)) == [((2,), "different"), ((3,), "missing"), ((4,), "extra")]


def test_batches_stop_at_the_lowest_hand_over_tick_ahead():
    from pgcascade.replica.state import TableState
    from pgcascade.replica.tables import SubscriberTable

    def t(state):
        return SubscriberTable(
            "t", "t", ["id"], TableState.parse(state), None, None, None, False, False, None
        )

    assert batch_cap([t("ok"), t(None)], 10) is None
    assert batch_cap([t("wanna-sync:15"), t("wanna-sync:12"), t("ok")], 10) == 12
    assert batch_cap([t("wanna-sync:8")], 10) is None  # passed already: the worker hands over


def test_pause_points_cost_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv("PGCASCADE_PAUSE_AT", raising=False)
    started = time.monotonic()
    pause_point("in-copy", "t")
    monkeypatch.setenv("PGCASCADE_PAUSE_AT", "in-copy")
    monkeypatch.setenv("PGCASCADE_PAUSE_TABLE", "other")
    monkeypatch.setenv("PGCASCADE_PAUSE_SECONDS", "5")
    pause_point("in-copy", "t")  # another table
    assert time.monotonic() - started < 1


def test_parallel_apply_groups_joined_tables_and_spreads_the_heaviest_first():
    from pgcascade.replica.parallel import spread, table_groups

    groups = table_groups([("c", "a"), ("d", "c"), ("x", "nowhere")], ["a", "b", "c", "d", "e"])
    assert sorted(map(sorted, groups)) == [["a", "c", "d"], ["b"], ["e"]]
    weight = {"a": 10.0, "c": 5.0, "d": 0.0, "b": 12.0, "e": 4.0}
    assert spread(groups, weight, 2) == [["a", "c", "d"], ["b", "e"]]
    assert spread(groups, weight, 8) == [["a", "c", "d"], ["b"], ["e"]]


def test_column_lists_and_embedded_filters():
    from pgcascade.core.errors import UserError
    from pgcascade.replica import filters

    assert filters.parse_columns(" id, region ,amount") == ["id", "region", "amount"]
    for bad in ("id,,x", "id,id", ""):
        with pytest.raises(UserError):
            filters.parse_columns(bad)
    # a LIKE pattern's % must not become a placeholder where the statement has parameters
    plain = filters.embedded("(r ~~ 'e%'::text)").as_string(None)
    assert plain == "((r ~~ 'e%'::text))"
    assert filters.embedded("(r ~~ 'e%'::text)", with_params=True).as_string(None) == "((r ~~ 'e%%'::text))"


def test_every_connection_notices_a_dead_link_with_the_configs_tcp_settings(tmp_path):
    from psycopg.conninfo import conninfo_to_dict

    from pgcascade.core import pgconn
    from pgcascade.core.config import load_config
    from pgcascade.core.daemon import use_connection_settings

    ini = tmp_path / "n.ini"
    ini.write_text(
        "[pgcascade]\njob_name = n\ntcp_keepalives_idle = 2\ntcp_keepalives_count = 0\ntcp_user_timeout = 4.5\n"
    )
    try:
        use_connection_settings(load_config(ini))
        params = conninfo_to_dict(
            pgconn.with_session_options("host=h dbname=d keepalives_interval=9 options='-c work_mem=1MB'")
        )
        assert (
            params["keepalives"] == "1"
            and params["keepalives_idle"] == "2"
            and params["tcp_user_timeout"] == "4500"
        )
        assert params["keepalives_interval"] == "9"  # the string's own value wins
        assert "keepalives_count" not in params  # 0: the system's default
        # the server's end too, before the string's own options (a later -c wins); ours last
        assert params["options"] == (
            "-c tcp_keepalives_idle=2 -c tcp_keepalives_interval=5 -c tcp_user_timeout=4500"
            " -c work_mem=1MB -c datestyle=ISO,YMD -c intervalstyle=postgres -c pgcascade.auto_ddl=off"
        )
    finally:
        pgconn.configure(pgconn.TcpSettings())
    assert conninfo_to_dict(pgconn.with_session_options("dbname=d"))["tcp_user_timeout"] == "60000"


def test_a_dead_commands_spark_scratch_folder_is_swept_and_no_other(tmp_path):
    """A command killed mid-work leaves its folder; the next one removes it, and only it."""
    from pgcascade.pipeline.session import SCRATCH_OWNER, SCRATCH_PREFIX, sweep_scratch_dirs

    gone = subprocess.Popen(["true"])  # a process that has ended: its pid is free
    gone.wait()
    host = socket.gethostname()
    owners = {
        "dead": f"{host} {gone.pid}",
        "alive": f"{host} {os.getpid()}",
        "elsewhere": f"another-host {gone.pid}",
        "no-owner": None,
    }
    for name, owner in owners.items():
        d = tmp_path / f"{SCRATCH_PREFIX}{name}"
        (d / "blockmgr").mkdir(parents=True)
        if owner:
            (d / SCRATCH_OWNER).write_text(owner + "\n")
    (tmp_path / "unrelated").mkdir()
    assert sweep_scratch_dirs(tmp_path) == [tmp_path / f"{SCRATCH_PREFIX}dead"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [*(f"{SCRATCH_PREFIX}{n}" for n in ("alive", "elsewhere", "no-owner")), "unrelated"]
    )
