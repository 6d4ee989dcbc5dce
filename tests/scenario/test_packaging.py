"""The built wheel on its own: installed (without the source tree) it carries its SQL files and
runs the demo; the systemd unit templates name real verbs and are valid for systemd."""

from __future__ import annotations

import configparser
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installed_alone_runs_the_demo(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = glob.glob(str(tmp_path / "dist" / "pgcascade-*.whl"))
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel],
        check=True,
        capture_output=True,
    )
    assert len(list((site / "pgcascade" / "sql").rglob("*.sql"))) == len(
        list((ROOT / "src/pgcascade/sql").rglob("*.sql"))
    )
    page = {p.name for p in (site / "pgcascade" / "monitor" / "page").iterdir()}
    assert page == {p.name for p in (ROOT / "src/pgcascade/monitor/page").iterdir()}  # serve's page
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the editable install of the checkout
    where = subprocess.run(
        [sys.executable, "-c", "import pgcascade; print(pgcascade.__file__)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(site)), where.stdout
    version = subprocess.run(
        [sys.executable, "-m", "pgcascade", "--version"], env=env, capture_output=True, text=True
    )
    assert "0.1.0" in version.stdout
    demo = subprocess.run(
        [sys.executable, "-m", "pgcascade", "demo", "--seconds", "6"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "check passed: the branch and the leaf equal the root" in demo.stdout


def test_systemd_units_run_real_daemons_and_stop_them_gently(tmp_path):
    units = sorted((ROOT / "packaging" / "systemd").glob("pgcascade-*@.service"))
    assert {u.name for u in units} == {
        f"pgcascade-{d}@.service" for d in ("worker", "ticker", "capture", "sink", "serve")
    }
    for unit in units:
        cfg = configparser.ConfigParser(interpolation=None, strict=False)
        cfg.read(unit)
        service = cfg["Service"]
        words = service["ExecStart"].split()
        daemon = unit.name.split("-", 1)[1].split("@")[0]
        assert daemon in words and "/etc/pgcascade/%i.ini" in words
        assert service["KillSignal"] == "SIGINT"  # systemctl stop = `-s`: the batch in hand finishes
        if daemon != "serve":  # serve re-reads nothing: no reload
            assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
        if shutil.which("systemd-analyze"):
            exe = str(Path(sys.executable).parent / "pgcascade")
            instance = tmp_path / unit.name.replace("@", "@job")
            instance.write_text(unit.read_text().replace("/usr/local/bin/pgcascade", exe))
            r = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True)
            problems = [line for line in (r.stdout + r.stderr).splitlines() if str(instance) in line]
            assert not problems, problems
