"""Paced batches: a one-way worker that yields the CPU while its host has none to spare.

A worker that keeps up asks for its next batch as soon as it has applied the last one, so under
load it makes hundreds of small batches a second, each with a fixed cost on three processes (the
fetch and its tick's commit on the provider, the apply on the subscriber, the worker's own
round trips).  While the host's CPUs have time to spare that cost is invisible and the lag stays
at the path's floor.  Once the application's processes queue for a CPU, every burst of the
path's makes their statements wait, and their throughput pays for it: TPC-B flat out on the
provider's host (issue 25's W1, two clients) lost a third of its transactions to the path in a
slow hour, where the capture triggers alone cost it 15 %.

The worker reads its host's CPU pressure (Linux PSI, `some`: the share of time at least one
runnable task waited for a CPU), smoothed over the last fraction of a second.  While it is above
`pace_pressure`, the worker waits before it asks for the batch after a small one - 2 ms at
first, half as long again at every reading that finds the pressure still high, up to
`pace_max` - so batches grow and their fixed cost is paid fewer times; below it (with a margin
either way, so that it does not flap) the wait halves at every reading until it is gone.  A
large batch has paid its fixed cost already and is never paced.  The lag grows by at most
`pace_max` while the host is saturated, and not at all otherwise.  Without PSI (another
system, a kernel without it) nothing is paced.  A worker on another host than its provider is
paced by its own host's pressure (pace_pressure_file may name a cgroup's cpu.pressure instead).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pgcascade.core.config import WorkerSettings

log = logging.getLogger("pgcascade.replay")

SAMPLE_SECONDS = 0.05  # the pressure is read at most this often
SMOOTHING = 0.3  # the weight of the newest reading in the smoothed pressure
MARGIN = 0.05  # pacing starts above pressure + MARGIN, eases below pressure - MARGIN
FIRST_PAUSE = 0.002
GROWTH = 1.5
SMALLEST_PAUSE = 0.001  # below it, easing stops pacing
SMALL_BATCH_EVENTS = 1000  # a larger batch is never paced


class CpuPressure:
    """The CPU pressure of the host (or of a cgroup): the share of time some task waited for a
    CPU, smoothed over the last readings; None where the PSI file cannot be read."""

    def __init__(self, path: Path):
        self.path = path
        self.at = time.monotonic()
        self.total = self.read_total()
        self.share: float | None = None if self.total is None else 0.0

    def read_total(self) -> int | None:
        """The `some` line's total: microseconds during which some task waited for a CPU."""
        try:
            with self.path.open("rb") as f:
                return int(f.readline().rsplit(b"total=", 1)[1])
        except (OSError, IndexError, ValueError):
            return None

    def sample(self, now: float) -> bool:
        """Read the pressure again if SAMPLE_SECONDS passed since the last reading: whether it did."""
        if self.total is None or now - self.at < SAMPLE_SECONDS:
            return False
        total = self.read_total()
        if total is None:
            self.share = self.total = None
            return False
        share = (total - self.total) / 1e6 / (now - self.at)
        self.share = SMOOTHING * share + (1 - SMOOTHING) * (self.share or 0.0)
        self.at, self.total = now, total
        return True


def next_pause(pause: float, share: float, pressure: float, most: float) -> float:
    """The wait before a small batch's successor, from the last one and the pressure read now."""
    if share >= pressure + MARGIN:
        return min(most, max(FIRST_PAUSE, pause * GROWTH))
    if share < pressure - MARGIN:
        return pause / 2 if pause / 2 >= SMALLEST_PAUSE else 0.0
    return pause


class Pacer:
    """A worker's pace: how long to wait before it asks for the batch after a small one."""

    def __init__(self, settings: WorkerSettings):
        self.most = settings.pace_max
        self.pressure = settings.pace_pressure / 100
        self.cpu = CpuPressure(settings.pace_pressure_file) if self.most > 0 else None
        self.pause = 0.0  # what the pressure calls for now
        self.due = 0.0  # the wait before the next fetch

    def after_batch(self, events: int) -> None:
        """A batch of `events` was applied: the wait before the next fetch."""
        if self.cpu is None:
            return
        if self.cpu.sample(time.monotonic()) and self.cpu.share is not None:
            was, self.pause = self.pause, next_pause(self.pause, self.cpu.share, self.pressure, self.most)
            if (was == 0) != (self.pause == 0):
                log.info(
                    "CPU pressure %.0f %%: %s",
                    100 * self.cpu.share,
                    f"small batches paced (up to {1000 * self.most:.0f} ms apart)"
                    if self.pause
                    else "small batches no longer paced",
                )
        self.due = self.pause if events < SMALL_BATCH_EVENTS else 0.0

    def wait(self) -> float:
        """Wait before the next fetch as the last batch calls for; the seconds waited."""
        due, self.due = self.due, 0.0
        if due > 0:
            time.sleep(due)
        return due
