"""A leaf paces its small batches while its host's CPUs are under pressure, and only then.

The pressure is what the worker reads from its PSI file (pace_pressure_file): here a file this
test writes as Linux writes /proc/pressure/cpu, its total growing by 90 % of the time passed,
then by none.  Under pressure the worker waits pace_max before the batch after a small one,
so its batches come fewer and larger; without, it asks again at once.  Either way the leaf's
rows equal the root's (checked outside pgcascade), each applied once."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from test_replication import PGBENCH_TABLES, assert_applied_once, bench_replica, pgbench  # noqa: F401

PACE_MAX = 0.04  # below the ticker's 50 ms max lag, as the default 20 ms is


class PressureFile(threading.Thread):
    """A PSI file whose `some` total grows by `share` of the time passed."""

    def __init__(self, path: Path, share: float):
        super().__init__(daemon=True)
        self.path, self.share, self.total = path, share, 0
        self.stopped = threading.Event()
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={self.total}\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        )
        tmp.replace(self.path)  # never read half written

    def run(self) -> None:
        last = time.monotonic()
        while not self.stopped.wait(0.01):
            now = time.monotonic()
            self.total += int(self.share * (now - last) * 1e6)
            last = now
            self.write()


def batches(log: str) -> list[str]:
    return re.findall(r"\{count: \d+.*\}", log)


def load_batches(r, seconds: int) -> list[str]:
    """The stats lines of the batches that applied `seconds` of pgbench at 100 tps."""
    before = len(r.log())
    load = pgbench(r.root, "-R", "100", "-T", str(seconds))
    assert load.wait(timeout=60 + seconds) == 0, load.stderr.read()
    r.wait_sync()
    return batches(r.log()[before:])


def test_small_batches_are_paced_only_while_the_cpus_are_under_pressure(bench_replica):
    r = bench_replica
    psi = PressureFile(r.tmp / "cpu.pressure", 0.9)
    psi.start()
    try:
        r.ini("leaf", r.leaf, pace_max=PACE_MAX, pace_pressure_file=psi.path)
        r.start_ticker()
        r.start_worker()
        r.wait_sync()
        load_batches(r, 2)  # (the pressure is read after batches: the wait grows meanwhile)
        assert "small batches paced" in r.log()
        paced = load_batches(r, 4)
        waits = [float(w) for line in paced for w in re.findall(r"paced: ([\d.]+)", line)]
        assert waits and max(waits) == PACE_MAX, paced[-5:]
        psi.share = 0.0
        load_batches(r, 2)  # (the wait eases meanwhile)
        assert "small batches no longer paced" in r.log()
        unpaced = load_batches(r, 4)
        assert not [line for line in unpaced if "paced" in line], unpaced[-5:]
        # the same load: fewer batches while paced (at most one every PACE_MAX, ~4 transactions)
        assert 2 * len(paced) < len(unpaced), (len(paced), len(unpaced))
    finally:
        psi.stopped.set()
    r.assert_equal(*PGBENCH_TABLES)
    assert_applied_once(r)
