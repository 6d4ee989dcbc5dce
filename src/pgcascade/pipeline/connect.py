"""A warm Spark: a Spark Connect server that compare, repair, copy and compact attach to.

Spark's start-up (7-10 s on two cores) is paid once by `pgcascade CONFIG spark-server start`;
a config with `spark_remote = sc://127.0.0.1:15002` then attaches in about a second.  The
server runs PySpark's own sbin scripts, with its pid and log files in `spark_server_dir`
(default ~/.pgcascade/spark-server).  Its driver binds and advertises the address the
executors reach (see session.driver_environment); its Python workers run spark.pyspark.python.

On a cluster a server that holds executors between commands would keep every core from the
other applications: unless the config sets spark.cores.max or spark.dynamicAllocation.*, it
runs with dynamic allocation (executors come with the work and go after a minute idle).

Keys: spark_server_port (15002), spark_server_address (127.0.0.1), spark_server_dir,
spark_master (local[*]), spark.* (passed on).
"""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import time
from pathlib import Path

from pgcascade.core.config import JobConfig
from pgcascade.core.errors import RuntimeFailure
from pgcascade.pipeline.session import LOG4J, driver_environment, is_local, jdbc_jar, spark_settings

# the pid file spark-daemon.sh writes for the server (instance 1)
PID_FILE = "spark-{user}-org.apache.spark.sql.connect.service.SparkConnectServer-1.pid"


def server_dir(cfg: JobConfig) -> Path:
    d = cfg.pipeline.spark_server_dir.expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def port(cfg: JobConfig) -> int:
    return cfg.pipeline.spark_server_port


def spark_home() -> Path:
    """pip's pyspark is a whole Spark: its bin/ and sbin/ scripts run the server (and the tests'
    standalone master and workers)."""
    import pyspark

    return Path(pyspark.__file__).parent


def environment(cfg: JobConfig) -> tuple[dict[str, str], dict[str, str]]:
    """(the server's environment, its spark.driver.* settings)."""
    d = server_dir(cfg)
    (d / "log4j2.properties").write_text(LOG4J)
    driver_env, driver_conf = driver_environment(cfg.pipeline.spark_master, spark_settings(cfg))
    env = {
        **os.environ,
        **driver_env,
        "SPARK_HOME": str(spark_home()),
        "SPARK_PID_DIR": str(d),
        "SPARK_LOG_DIR": str(d),
        "SPARK_CONF_DIR": str(d),
    }
    return env, driver_conf


def client_address(cfg: JobConfig) -> str:
    """Where this host's commands reach the server (a wildcard binding is reached on loopback)."""
    address = cfg.pipeline.spark_server_address
    return "127.0.0.1" if address in ("0.0.0.0", "::", "") else address


def listening(cfg: JobConfig) -> bool:
    try:
        socket.create_connection((client_address(cfg), port(cfg)), timeout=0.5).close()
        return True
    except OSError:
        return False


def server_pid(cfg: JobConfig) -> int | None:
    """The pid of the server this config started, if it still runs."""
    f = server_dir(cfg) / PID_FILE.format(user=os.environ.get("USER") or getpass.getuser())
    try:
        pid = int(f.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


def sharing_settings(cfg: JobConfig) -> dict[str, str]:
    """On a cluster: dynamic allocation, unless the config caps the server's cores itself."""
    conf = spark_settings(cfg)
    if is_local(cfg.pipeline.spark_master) or "spark.cores.max" in conf:
        return {}
    if any(k.startswith("spark.dynamicAllocation.") for k in conf):
        return {}
    return {
        "spark.dynamicAllocation.enabled": "true",
        "spark.dynamicAllocation.shuffleTracking.enabled": "true",
        "spark.dynamicAllocation.executorIdleTimeout": "60s",
    }


def start(cfg: JobConfig, timeout: float = 60.0) -> str:
    p = port(cfg)
    url = f"sc://{client_address(cfg)}:{p}"
    if listening(cfg):
        if server_pid(cfg) is not None:
            return url
        raise RuntimeFailure(
            f"port {p} is in use by another program, not by a Spark Connect server of"
            f" {server_dir(cfg)}: set spark_server_port to a free port"
        )
    env, driver_conf = environment(cfg)
    d = server_dir(cfg)
    confs = {
        "spark.connect.grpc.binding.address": cfg.pipeline.spark_server_address,
        "spark.connect.grpc.binding.port": str(p),
        "spark.jars": jdbc_jar(cfg),
        "spark.sql.warehouse.dir": str(d / "warehouse"),
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={d}",
        "spark.ui.enabled": "false",
        # commands share one session (see session.py): keep it while the server runs
        "spark.connect.session.manager.defaultSessionTimeout": "3650d",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        **driver_conf,
        **sharing_settings(cfg),
        **spark_settings(cfg),
    }
    args = [str(Path(env["SPARK_HOME"]) / "sbin" / "start-connect-server.sh")]
    args += ["--master", cfg.pipeline.spark_master]
    for k, v in confs.items():
        args += ["--conf", f"{k}={v}"]
    subprocess.run(args, env=env, cwd=d, check=True, capture_output=True)
    deadline = time.monotonic() + timeout
    while not listening(cfg):
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
    from pgcascade.pipeline.session import cluster_parallelism, remote_session

    def task(batches):
        import psycopg  # noqa: F401

        import pgcascade.pipeline.compare
        import pgcascade.pipeline.copy  # noqa: F401

        yield from batches

    spark = remote_session(url, "pgcascade warm-up")
    n = 2 * cluster_parallelism(spark)  # at least one task per core, each its own Python worker
    spark.range(0, n, 1, n).mapInArrow(task, "id long").collect()


def stop(cfg: JobConfig) -> None:
    env, _ = environment(cfg)
    subprocess.run(
        [str(Path(env["SPARK_HOME"]) / "sbin" / "stop-connect-server.sh")],
        env=env,
        cwd=server_dir(cfg),
        check=False,
        capture_output=True,
    )
    deadline = time.monotonic() + 30
    while listening(cfg) and time.monotonic() < deadline:  # the JVM takes a moment to go
        time.sleep(0.2)
