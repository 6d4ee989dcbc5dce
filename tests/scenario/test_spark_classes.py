"""Spark's classes saved once per host (pipeline/classcache.py): the first session on a host
starts a process that writes the archive, and the next session's JVM maps it.

What a user would check: the archive appears in the configured directory with nothing left
beside it (no lock, no partial file, an empty conf directory), and the JVM of the next
command maps it - read by this test from /proc/PID/maps of that JVM, not from pgcascade.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SPARK_TEST_CONF

from pgcascade.dev.localcluster import wait_until

# a session as every command builds it, then what its JVM maps and the job's answer
SESSION = """
import json
import sys
from pathlib import Path
from pgcascade.core.config import load_config
from pgcascade.pipeline.session import build_session

spark = build_session(load_config(Path(sys.argv[1])))
jvm = spark.sparkContext._gateway.proc.pid
maps = Path(f"/proc/{jvm}/maps").read_text()
print(json.dumps(sorted({line.split()[-1] for line in maps.splitlines() if line.endswith(".jsa")})))
print(spark.range(1000).count())
"""


def session(ini: Path) -> tuple[list[str], str]:
    """The archives the session's JVM mapped, and its job's output."""
    # as a command starts: not with the SPARK_CONF_DIR an in-process session of this test
    # process set (another cache's: the archive would record another class path, and is not made)
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONF_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", SESSION, str(ini)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    mapped, count = out.stdout.splitlines()[-2:]
    return json.loads(mapped), count


def test_the_next_session_maps_the_classes_the_first_one_had_saved(tmp_path):
    cache = tmp_path / "classes"
    ini = tmp_path / "spark.ini"
    keys = {"job_name": "classes", "spark_master": "local[1]", "spark_class_cache": cache, **SPARK_TEST_CONF}
    ini.write_text("[pgcascade]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))

    mapped, count = session(ini)
    assert count == "1000"
    assert not [m for m in mapped if m.startswith(str(cache))], mapped  # none yet: being written

    def written() -> list[Path] | None:
        files = sorted(cache.iterdir())
        archives = [f for f in files if f.suffix == ".jsa"]
        return archives if archives and not [f for f in files if f.suffix in (".lock", ".part")] else None

    (archive,) = wait_until(written, 240, what="the class archive, written in the background")
    assert sorted(f.name for f in cache.iterdir()) == sorted([archive.name, "conf"])
    assert not list((cache / "conf").iterdir())

    mapped, count = session(ini)
    assert count == "1000"
    assert str(archive) in mapped, mapped
