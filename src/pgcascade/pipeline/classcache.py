"""Spark's classes saved once per host, so that a command's driver JVM starts in half the time.

A local Spark driver loads thousands of classes before its first job, and on two cores that
is most of the 15-30 s a compare or a Spark copy spends starting.  The JDK's dynamic
class-data sharing (JDK 13+) saves the classes a JVM loaded, as it exits, in an archive that
later JVMs map instead of loading them again: measured here (a local session and its first job,
idle host, alternated), 6.2-6.9 s instead of 11.5-13.2, the JVM's CPU 7.0-7.7 s instead of
12.5-14.5.

The first command on a host that finds no archive starts, beside itself, a short process that
starts Spark with the same settings, runs a small job and exits, its JVM writing the archive
(~40 s in the background, once); the command itself goes on as before.  The archive holds
the classes of one JVM and one class path: its name is a digest of the java binary, pyspark's
version and jars and the driver's own settings (spark.driver.*).  An archive the JVM cannot
use is ignored, its warnings silenced (-Xshare:auto).  Archives not used for PRUNE_DAYS are
removed when a new one is written.  Executors on a cluster start as before;
`spark_class_cache = off` turns this off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("pgcascade.pipeline")

SILENT = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
STALE_WRITER_SECONDS = 600  # a writer this old is dead (its lock is taken over)
PRUNE_DAYS = 30


def folder(setting: str) -> Path | None:
    """The archives' directory (made if missing); None when the setting is off or it cannot
    be made."""
    if setting.strip().lower() in ("", "off"):
        return None
    path = Path(setting).expanduser()
    try:
        conf_dir(path)
    except OSError as e:
        log.debug("no Spark class archive in %s: %s", path, e)
        return None
    return path


def conf_dir(base: Path) -> Path:
    """An empty SPARK_CONF_DIR under `base` (no spark-defaults.conf of the host's).  Spark
    puts it on the driver's class path, which an archive holds by name: every command with
    archives in `base` uses this one."""
    path = base / "conf"
    path.mkdir(parents=True, exist_ok=True)
    return path


def java_options(cache: Path | None, conf: Mapping[str, str]) -> str:
    """The driver JVM's options that map the archive in `cache` (None: none); without an
    archive, none, and a process that writes one is started."""
    if cache is None or not archivable(cache):
        return ""
    try:
        archive = cache / f"{identity(conf)}.jsa"
        if archive.is_file():
            os.utime(archive)  # (used: kept by prune)
            return f"-XX:SharedArchiveFile={archive} {SILENT}"
        start_writer(archive, conf)
    except OSError as e:
        log.debug("no Spark class archive in %s: %s", cache, e)
    return ""


def archivable(cache: Path) -> bool:
    """Whether the driver's class path is the archive's: Spark puts SPARK_CONF_DIR on it (ours
    unless the environment names another) and any Hadoop or YARN configuration directory."""
    ours = str(cache / "conf")  # (made by folder())
    if os.environ.get("SPARK_CONF_DIR", ours) != ours:
        return False
    return not any(os.environ.get(v) for v in ("HADOOP_CONF_DIR", "YARN_CONF_DIR", "SPARK_DIST_CLASSPATH"))


def identity(conf: Mapping[str, str]) -> str:
    """A digest of what the archive depends on: the JVM, Spark's jars, the driver's settings."""
    import pyspark

    java = Path(os.environ.get("JAVA_HOME", ""), "bin", "java")
    java = java if java.is_file() else Path(shutil.which("java") or "java")
    jars = Path(pyspark.__file__).parent / "jars"
    parts = [str(java.resolve()), _stamp(java), pyspark.__version__]
    parts += sorted(p.name for p in jars.glob("*.jar")) if jars.is_dir() else []
    parts += [f"{k}={v}" for k, v in sorted(driver_settings(conf).items())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def driver_settings(conf: Mapping[str, str]) -> dict[str, str]:
    """The settings of the driver's JVM (its memory, options, class path)."""
    return {k: v for k, v in conf.items() if k.startswith("spark.driver.")}


def _stamp(path: Path) -> str:
    try:
        st = path.resolve().stat()
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}"


def start_writer(archive: Path, conf: Mapping[str, str]) -> None:
    """Start the process that writes the archive, unless one is at it."""
    lock = archive.with_suffix(".lock")
    if not take(lock):
        return
    writer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pgcascade.pipeline.classcache",
            str(archive),
            json.dumps(driver_settings(conf)),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not the command's: a Ctrl-C or a kill of it leaves the writer be
    )
    lock.write_text(f"{socket.gethostname()} {writer.pid}\n")
    log.debug("saving Spark's classes in %s for the next commands (pid %d)", archive, writer.pid)


def take(lock: Path) -> bool:
    """Whether this process may start the writer (the lock is free, or its writer died)."""
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            if not stale(lock):
                return False
            with contextlib.suppress(OSError):
                lock.unlink()
    return False


def stale(lock: Path) -> bool:
    """A writer's lock that outlived it: its process is gone, or it is too old to be at work."""
    try:
        host, pid = [*lock.read_text().split(), "", ""][:2]
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age > STALE_WRITER_SECONDS:
        return True
    if host != socket.gethostname() or not pid.isdigit():
        return False  # (just taken, its pid not written yet; or another host's)
    return not Path(f"/proc/{pid}").exists()


def write(archive: Path, settings: dict[str, str]) -> None:
    """Start a local Spark with the driver's settings, run a small job, and let its JVM write
    the archive as it exits; move it in place."""
    part = archive.with_name(f"{archive.stem}.{os.getpid()}.part")
    scratch = Path(tempfile.mkdtemp(prefix="pgcascade-spark-classes-"))
    try:
        if train(scratch, settings, part) == 0 and part.is_file() and part.stat().st_size > 0:
            part.replace(archive)
            prune(archive.parent, keep=archive)
    finally:
        with contextlib.suppress(OSError):
            part.unlink()
        with contextlib.suppress(OSError):
            archive.with_suffix(".lock").unlink()
        shutil.rmtree(scratch, ignore_errors=True)


def train(scratch: Path, settings: dict[str, str], part: Path) -> int | None:
    """Run the small job on a JVM that writes its classes to `part` at exit; its exit code."""
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession

    os.environ.update(
        SPARK_CONF_DIR=str(conf_dir(part.parent)),  # the commands': the same class path
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
    )
    extra = f"{settings.get('spark.driver.extraJavaOptions', '')} -XX:ArchiveClassesAtExit={part} {SILENT}"
    builder = SparkSession.builder.master("local[1]").appName("pgcascade class archive")
    for key, value in {
        **settings,
        "spark.driver.extraJavaOptions": extra,
        "spark.ui.enabled": "false",
    }.items():
        builder = builder.config(key, value)
    try:
        spark = builder.config("spark.sql.warehouse.dir", str(scratch / "warehouse")).getOrCreate()
        rows = spark.range(10_000).repartition(2)  # the pipeline's kind of work: Arrow batches
        mapped = rows.mapInArrow(lambda batches: batches, rows.schema)
        mapped.groupBy((mapped.id % 7).alias("k")).count().collect()
        spark.stop()
    finally:  # the archive is written as the JVM exits: wait for it
        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()  # the gateway exits at the end of its input
    return None if proc is None else proc.wait(timeout=300)


def prune(folder: Path, keep: Path) -> None:
    """Remove the archives not used for PRUNE_DAYS (another JVM's, an older Spark's)."""
    cutoff = time.time() - PRUNE_DAYS * 86400
    for old in folder.glob("*.jsa"):
        with contextlib.suppress(OSError):
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()


if __name__ == "__main__":
    write(Path(sys.argv[1]), json.loads(sys.argv[2]))
