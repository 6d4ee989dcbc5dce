"""The README's main job: `pgcascade demo` on throwaway clusters ends with its own equality check."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import run_cli


def test_demo_runs_a_cascade_and_ends_equal():
    r = run_cli("demo", "--seconds", "8", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "check passed: the branch and the leaf equal the root" in r.stdout
    assert "DIFFERS" not in r.stdout
    work = re.search(r"clusters in (\S+)", r.stdout)
    assert work is not None, r.stdout[:500]
    assert not Path(work.group(1)).exists(), "a passed demo leaves no directory behind"
