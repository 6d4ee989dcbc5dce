"""The worker's pace (replica/pacing.py): how the wait before a small batch's successor follows
the CPU pressure, and how the pressure is read from a PSI file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pgcascade.core.config import WorkerSettings
from pgcascade.replica import pacing
from pgcascade.replica.pacing import FIRST_PAUSE, CpuPressure, Pacer, next_pause


def psi(total_us: int) -> str:
    """A /proc/pressure/cpu as Linux writes it."""
    return (
        f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total_us}\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )


def test_the_wait_grows_to_its_most_under_pressure_holds_near_it_and_eases_to_none():
    pause, seen = 0.0, []
    for _ in range(10):
        pause = next_pause(pause, 0.8, 0.5, 0.02)
        seen.append(pause)
    assert seen[0] == FIRST_PAUSE
    assert seen == sorted(seen) and seen[-1] == 0.02  # grows, never past its most
    assert next_pause(0.01, 0.52, 0.5, 0.02) == 0.01  # within the margin: unchanged
    assert next_pause(0.01, 0.48, 0.5, 0.02) == 0.01
    for _ in range(10):
        pause = next_pause(pause, 0.2, 0.5, 0.02)
    assert pause == 0.0
    assert next_pause(0.0, 0.5, 0.5, 0.02) == 0.0  # not paced until above the margin


def test_pressure_is_the_share_of_time_read_between_two_samples(tmp_path: Path):
    f = tmp_path / "cpu.pressure"
    f.write_text(psi(1_000_000))
    cpu = CpuPressure(f)
    assert cpu.share == 0.0
    assert not cpu.sample(cpu.at + pacing.SAMPLE_SECONDS / 2)  # too soon: not read
    f.write_text(psi(1_000_000 + 90_000))  # 90 ms waited in 100 ms
    assert cpu.sample(cpu.at + 0.1)
    assert cpu.share == pytest.approx(pacing.SMOOTHING * 0.9)


def test_no_psi_file_means_no_pacing(tmp_path: Path):
    cpu = CpuPressure(tmp_path / "absent")
    assert cpu.share is None and not cpu.sample(time.monotonic() + 1)
    pacer = Pacer(WorkerSettings(pace_pressure_file=tmp_path / "absent"))
    pacer.after_batch(1)
    assert pacer.wait() == 0.0


def test_only_small_batches_wait_and_pace_max_0_reads_nothing(tmp_path: Path, monkeypatch):
    f = tmp_path / "cpu.pressure"
    f.write_text(psi(0))
    pacer = Pacer(WorkerSettings(pace_pressure_file=f, pace_max=0.01))
    assert pacer.cpu is not None
    clock = [pacer.cpu.at]
    monkeypatch.setattr(pacing.time, "monotonic", lambda: clock[0])
    for i in range(1, 20):  # fully pressed: every task waited all the time
        clock[0] += 0.1
        f.write_text(psi(int(i * 100_000)))
        pacer.after_batch(10)
    assert pacer.due == pacer.pause == 0.01
    pacer.after_batch(pacing.SMALL_BATCH_EVENTS)
    assert pacer.due == 0.0  # a large batch paid its fixed cost already
    assert Pacer(WorkerSettings(pace_pressure_file=f, pace_max=0)).cpu is None
