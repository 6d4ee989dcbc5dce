"""A delayed replica (apply_delay): a leaf that applies the root's changes a fixed time late.

The delay is measured outside pgcascade: a heartbeat row on the root gets the root's clock
(`clock_timestamp()`) every 100 ms, and the leaf's copy of it, read with the same clock (one
machine), says how far behind the leaf is."""

from __future__ import annotations

import itertools
import json
import threading
import time

from conftest import table_checksum

from pgcascade.dev.localcluster import wait_until

DELAY = 5.0


def heartbeat_lag(leaf) -> float:
    """Seconds between now and the root's newest heartbeat that the leaf holds."""
    with leaf.connect() as conn:
        return conn.execute(
            "select extract(epoch from clock_timestamp() - ts)::float8 from heartbeat"
        ).fetchone()[0]


def status(r) -> dict:
    return json.loads(r.cli("leaf", "status", "--json").stdout)


def test_a_delayed_leaf_stays_its_delay_behind_and_catches_up_after_it(replica) -> None:
    r = replica
    with r.root.connect() as conn:
        conn.execute("create table heartbeat (id int primary key, ts timestamptz not null)")
        conn.execute("insert into heartbeat values (1, clock_timestamp())")
        conn.execute("create table items (id int primary key, n int not null)")
        conn.execute("insert into items select i, 0 from generate_series(1, 1000) i")
    r.ini("root", r.root, apply_delay="5s")
    r.setup(["heartbeat", "items"])
    refused = r.cli("root", "worker", check=False)  # a root feeds others: no delay there
    assert refused.returncode == 2 and "apply_delay is for a leaf" in refused.stderr, refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr
    r.start_ticker()
    r.start_worker()
    r.wait_sync(timeout=60)  # copied without a delay: a table's copy hands over one delay late
    r.ini("leaf", r.leaf, apply_delay="5s")
    r.cli("leaf", "worker", "-r")  # the delay is taken on reload
    wait_until(lambda: r.leaf.scalar("select apply_delay from pgcascade.node"), timeout=30, what="the reload")
    assert status(r)["apply_delay_seconds"] == DELAY
    short = r.cli("leaf", "wait-sync", "--timeout", "3", check=False)
    assert short.returncode == 2 and "applies changes 5 s late (apply_delay)" in short.stderr, short.stderr

    stop = threading.Event()

    def beat() -> None:
        with r.root.connect() as conn:
            while not stop.is_set():
                conn.execute("update heartbeat set ts = clock_timestamp() where id = 1")
                time.sleep(0.1)

    def write() -> None:  # the application's writes, about 50 transactions a second
        with r.root.connect() as conn:
            for i in itertools.count(1001):
                if stop.is_set():
                    return
                with conn.transaction():
                    conn.execute("insert into items values (%s, 0)", (i,))
                    conn.execute("update items set n = n + 1 where id = %s", (i % 1000 + 1,))
                time.sleep(0.02)

    threads = [threading.Thread(target=beat), threading.Thread(target=write)]
    for t in threads:
        t.start()
    try:
        time.sleep(DELAY + 1)
        lags = []
        for _ in range(12):
            lags.append(heartbeat_lag(r.leaf))
            time.sleep(0.25)
        assert min(lags) >= DELAY and max(lags) <= DELAY + 2, lags
        check = r.cli("leaf", "status", "--check", "--max-lag", "1.5")
        assert "s beyond the 5 s apply delay" in check.stdout, check.stdout

        # paused, the lag beyond the delay grows and --check says so; resumed, it goes back
        r.cli("leaf", "pause")
        assert "apply delay: 5.0 s, lag beyond it:" in r.cli("leaf", "status").stdout
        time.sleep(1.5)
        late = r.cli("leaf", "status", "--check", "--max-lag", "1.5", check=False)
        assert late.returncode == 2 and "beyond the 5 s apply delay over 1.5 s" in late.stdout, late.stdout
        r.cli("leaf", "resume")
        wait_until(lambda: heartbeat_lag(r.leaf) < DELAY + 2, timeout=20, what="the leaf to catch up")
        lags = []
        for _ in range(8):
            lags.append(heartbeat_lag(r.leaf))
            time.sleep(0.25)
        assert min(lags) >= DELAY and max(lags) <= DELAY + 2, lags
    finally:
        stop.set()
        for t in threads:
            t.join()

    # the writes stopped: the leaf still shows the past, until the delay has passed
    assert table_checksum(r.leaf, "heartbeat") != table_checksum(r.root, "heartbeat")
    started = time.monotonic()
    r.cli("leaf", "wait-sync", "--timeout", "60")
    assert time.monotonic() - started >= DELAY, "wait-sync returned before the delay passed"
    r.assert_equal("items", "heartbeat")
    assert table_checksum(r.leaf, "items")[0] > 1100, "the writes were few"
