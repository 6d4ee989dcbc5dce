"""A warm Spark: a Spark Connect server that compare, repair, copy and compact attach to.

Spark's start-up (7-10 s on two cores) is paid once by `pgcascade CONFIG spark-server start`;
a config with `spark_remote = sc://127.0.0.1:15002` then attaches in about a second.  The
server runs PySpark's own sbin scripts with this interpreter for its Python workers, bound to
loopback, with its pid and log files in `spark_server_dir` (default ~/.pgcascade/spark-server).

Keys: spark_server_port (15002), spark_server_dir, spark_master (local[*]), spark.* (passed on).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pgcascade.core.config import JobConfig
from pgcascade.core.errors import RuntimeFailure
from pgcascade.pipeline.session import LOG4J, jdbc_jar, spark_settings


def server_dir(cfg: JobConfig) -> Path:
    d = cfg.pipeline.spark_server_dir.expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def port(cfg: JobConfig) -> int:
    return cfg.pipeline.spark_server_port


def environment(cfg: JobConfig) -> dict[str, str]:
    import pyspark

    d = server_dir(cfg)
    (d / "log4j2.properties").write_text(LOG4J)
    return {
        **os.environ,
        "SPARK_HOME": str(Path(pyspark.__file__).parent),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_PID_DIR": str(d),
        "SPARK_LOG_DIR": str(d),
        "SPARK_CONF_DIR": str(d),
    }


def listening(p: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", p)) == 0


def start(cfg: JobConfig, timeout: float = 60.0) -> str:
    p = port(cfg)
    url = f"sc://127.0.0.1:{p}"
    if listening(p):
        return url
    env = environment(cfg)
    d = server_dir(cfg)
    confs = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(p),
        "spark.jars": jdbc_jar(cfg),
        "spark.sql.warehouse.dir": str(d / "warehouse"),
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={d}",
        "spark.ui.enabled": "false",
        # commands share one session (see session.py): keep it while the server runs
        "spark.connect.session.manager.defaultSessionTimeout": "3650d",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        **spark_settings(cfg),
    }
    args = [str(Path(env["SPARK_HOME"]) / "sbin" / "start-connect-server.sh")]
    args += ["--master", cfg.pipeline.spark_master]
    for k, v in confs.items():
        args += ["--conf", f"{k}={v}"]
    subprocess.run(args, env=env, cwd=d, check=True, capture_output=True)
    deadline = time.monotonic() + timeout
    while not listening(p):
        if time.monotonic() > deadline:
            raise RuntimeFailure(
                f"Spark Connect server did not listen on port {p} within {timeout:.0f} s: see {d}"
            )
        time.sleep(0.2)
    warm_up(url)
    return url


def warm_up(url: str) -> None:
    """One small job in the shared session, so that its Python workers exist with pgcascade,
    psycopg and pyarrow imported: the first command does not pay their start-up (2-5 s)."""
    from pgcascade.pipeline.session import remote_session

    def task(batches):
        import psycopg  # noqa: F401

        import pgcascade.pipeline.compare
        import pgcascade.pipeline.copy  # noqa: F401

        yield from batches

    n = 2 * (os.cpu_count() or 1)  # at least one task per local core, each its own worker
    remote_session(url, "pgcascade warm-up").range(0, n, 1, n).mapInArrow(task, "id long").collect()


def stop(cfg: JobConfig) -> None:
    env = environment(cfg)
    subprocess.run(
        [str(Path(env["SPARK_HOME"]) / "sbin" / "stop-connect-server.sh")],
        env=env,
        cwd=server_dir(cfg),
        check=False,
        capture_output=True,
    )
    deadline = time.monotonic() + 30
    while listening(port(cfg)) and time.monotonic() < deadline:  # the JVM takes a moment to go
        time.sleep(0.2)
