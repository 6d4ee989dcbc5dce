"""status --check's verdict and --max-lag's durations, without a server."""

import click
import pytest

from pgcascade.cli.context import Duration
from pgcascade.monitor.report import check


@pytest.mark.parametrize(
    "text, seconds",
    [("30", 30.0), ("30s", 30.0), ("500ms", 0.5), ("5min", 300.0), ("2h", 7200.0), (" 1.5S ", 1.5)],
)
def test_durations(text, seconds):
    assert Duration().convert(text, None, None) == seconds


@pytest.mark.parametrize("text", ["soon", "5 parsecs", "-3s", "", "s"])
def test_bad_durations_are_usage_errors(text):
    with pytest.raises(click.BadParameter):
        Duration().convert(text, None, None)


def leaf(**extra):
    base = {"node": "l1", "type": "leaf", "provider": "root", "last_error": None}
    return {**base, "lag_seconds": 0.4, "ticks_behind": 1, "provider_reachable": True, **extra}


def test_check_is_ok_under_the_limit_and_critical_over_it():
    assert check(leaf(), 30.0).code == 0
    assert check(leaf(), 30.0).line == "OK l1 (leaf), lag 0.4 s"
    over = check(leaf(lag_seconds=45.0), 30.0)
    assert over.code == 2 and over.line == "CRITICAL l1 (leaf): lag 45.0 s over 30 s"
    assert check(leaf(lag_seconds=45.0), None).code == 0  # no limit given: lag alone is fine


def test_check_judges_a_delayed_leaf_by_its_lag_beyond_the_delay():
    delayed = leaf(lag_seconds=3605.2, apply_delay_seconds=3600.0, lag_beyond_delay_seconds=5.2)
    assert check(delayed, 30.0).line == "OK l1 (leaf), lag 3605.2 s (5.2 s beyond the 3600 s apply delay)"
    late = check({**delayed, "lag_seconds": 3645.0, "lag_beyond_delay_seconds": 45.0}, 30.0)
    assert (
        late.code == 2
        and late.line == "CRITICAL l1 (leaf): lag 45.0 s beyond the 3600 s apply delay over 30 s"
    )


def test_check_is_critical_on_errors_and_an_unreachable_provider():
    assert "unreachable" in check(leaf(provider_reachable=False, lag_seconds=None), 30.0).line
    assert check(leaf(lag_seconds=None), 30.0).code == 2  # lag unknown with a limit
    assert check(leaf(last_error="column x does not exist"), None).code == 2
    root = {"node": "r", "type": "root", "provider": None, "last_error": None, "capture": {"mode": "trigger"}}
    assert check(root, 5.0).code == 0
    root["capture"] = {"mode": "logical", "last_error": "slot missing"}
    assert check(root, 5.0).line == "CRITICAL r (root): capture error: slot missing"
    root["capture"]["slot_problem"] = "slot s was invalidated: run recover-slot"
    assert check(root, 5.0).line == "CRITICAL r (root): capture: slot s was invalidated: run recover-slot"


def daemon(role, running, needed, **extra):
    base = {"role": role, "running": running, "critical": needed and not running, "job": None, "host": None}
    return {
        **base,
        "pid": None,
        "started": None,
        "last_seen": None,
        "last_seen_seconds": None,
        "stopped": None,
        **extra,
    }


def test_check_is_critical_when_a_needed_daemon_is_not_running():
    seen = {"job": "l1", "host": "db2", "pid": 7, "last_seen": "2025-03-01T10:00:00+00:00"}
    killed = daemon("worker", False, True, last_seen_seconds=125.0, **seen)
    assert (
        check(leaf(daemons=[killed]), 30.0).line
        == "CRITICAL l1 (leaf): worker not running (last seen 2.1 min ago, pid 7 on db2, did not stop cleanly)"
    )
    stopped = daemon(
        "worker", False, True, last_seen_seconds=3.0, stopped="2025-03-01T10:00:00+00:00", **seen
    )
    assert check(leaf(daemons=[stopped]), None).line.endswith("(last seen 3.0 s ago, pid 7 on db2, stopped)")
    never = daemon("worker", False, True)
    assert (
        check(leaf(daemons=[never]), None).line
        == "CRITICAL l1 (leaf): worker not running (never started here)"
    )
    # not needed (a root's worker without peers, a ticker never seen here): not judged
    assert check(leaf(daemons=[daemon("ticker", False, False)]), None).code == 0
    running = daemon("worker", True, True, last_seen_seconds=0.4, **seen)
    assert check(leaf(daemons=[running]), 30.0).code == 0
