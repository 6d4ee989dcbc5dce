"""The queue demo: a throwaway cluster, the ticker daemon, writers, a consumer and live status.

It shows the queue doing its job and then checks it: every event written by a committed
transaction was consumed exactly once, none from a rolled-back one.
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from pgcascade.core import pgconn, schema
from pgcascade.core.errors import RuntimeFailure
from pgcascade.dev.demo import clean_up
from pgcascade.dev.localcluster import new_cluster
from pgcascade.monitor.status import queue_tables
from pgcascade.pgq import queue as q
from pgcascade.pgq.consumer import Batch, Consumer

QUEUE = "demo_queue"
CONSUMER = "demo_consumer"


class Writer(threading.Thread):
    """Writes events in transactions of 1-50 events; one in ten transactions rolls back."""

    def __init__(self, connstr: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.connstr, self.stop = connstr, stop
        self.committed: list[int] = []

    def run(self) -> None:
        with pgconn.connect(self.connstr) as conn:
            while not self.stop.is_set():
                n = random.randint(1, 50)
                ids = [q.insert_event(conn, QUEUE, "demo", f"payload {i}") for i in range(n)]
                if random.random() < 0.1:
                    conn.rollback()
                else:
                    conn.commit()
                    self.committed.extend(ids)
                time.sleep(0.002)


class CountingConsumer(Consumer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []
        self.batches = 0

    def process_batch(self, batch: Batch) -> None:
        ids = [ev.ev_id for ev in batch.events()]
        self.seen.extend(ids)
        self.batches += 1


def run_queue_demo(seconds: float = 20.0, keep: bool = False) -> None:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="pgcascade-demo-"))
    console.print(f"[bold]pgcascade demo[/bold] in {workdir}")
    cluster = new_cluster("demo", basedir=workdir / "clusters")
    connstr = cluster.create_database("demo")
    console.print(f"cluster on port {cluster.port}, database demo")
    with pgconn.connect(connstr, autocommit=True) as conn:
        schema.install(conn)
        q.create_queue(conn, QUEUE)
        q.register_consumer(conn, QUEUE, CONSUMER)
    conf = workdir / "ticker.ini"
    conf.write_text(
        "[pgcascade]\njob_name = demo_ticker\n"
        f"db = {connstr}\nlogfile = {workdir}/%(job_name)s.log\npidfile = {workdir}/%(job_name)s.pid\n"
    )
    ticker = subprocess.Popen([sys.executable, "-m", "pgcascade", "-q", "ticker", str(conf)])
    stop = threading.Event()
    writers = [Writer(connstr, stop) for _ in range(2)]
    consumer = CountingConsumer(connstr, QUEUE, CONSUMER)
    consumer_thread = threading.Thread(target=consumer.run, kwargs={"max_idle": 0.2}, daemon=True)
    passed = False
    try:
        for w in writers:
            w.start()
        consumer_thread.start()
        with (
            pgconn.connect(connstr, autocommit=True) as conn,
            Live(console=console, refresh_per_second=4) as live,
        ):
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                written = sum(len(w.committed) for w in writers)
                header = Text(
                    f"{time.monotonic() - started:4.0f}s  committed events: {written}  consumed: "
                    f"{len(consumer.seen)} in {consumer.batches} batches"
                )
                live.update(Group(header, queue_tables(conn)))
                time.sleep(0.5)
            stop.set()
            for w in writers:
                w.join()
            committed = sorted(i for w in writers for i in w.committed)
            deadline = time.monotonic() + 15
            while len(consumer.seen) < len(committed) and time.monotonic() < deadline:
                live.update(
                    Group(Text(f"catching up: {len(consumer.seen)}/{len(committed)}"), queue_tables(conn))
                )
                time.sleep(0.2)
        if sorted(consumer.seen) != committed:
            raise RuntimeFailure(
                f"demo check FAILED: {len(committed)} events committed, {len(consumer.seen)} consumed"
            )
        console.print(
            f"[green]check passed[/green]: {len(committed)} committed events consumed exactly once "
            f"in {consumer.batches} batches; rolled-back events never delivered"
        )
        passed = True
    finally:
        stop.set()
        consumer.stop()
        consumer_thread.join(timeout=10)
        consumer.close()
        ticker.send_signal(2)
        ticker.wait(timeout=30)
        if keep:
            console.print(f"cluster left running: psql '{connstr}'")
        else:
            cluster.destroy()
            clean_up(console, workdir, passed)
