"""The one place a SparkSession is built, from the job's `[pgcascade]` section.

Keys read (all optional):

    spark_master   Spark master URL; default local[*] (every core of this machine)
    spark_remote   sc://host:port of a running Spark Connect server: attach to a warm Spark
                   instead of starting one (7-10 s saved per command on two cores)
    jdbc_jar       the PostgreSQL JDBC driver; default /usr/share/java/postgresql.jar (Debian's
                   libpostgresql-jdbc-java); only JDBC reads need it, checksums use psycopg
    spark.*        passed to the builder unchanged (spark.executor.memory, spark.sql.shuffle...)

Why each setting (see notes on this machine): the driver binds to loopback in local mode
(SPARK_LOCAL_IP; spark.driver.host alone is not enough); Python workers run this interpreter
(PYSPARK_PYTHON), else `import psycopg` fails in tasks; warehouse and Derby files go to a
temporary directory, never the user's working directory.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from pgcascade.core.config import JobConfig
from pgcascade.core.errors import ConfigError, RuntimeFailure

log = logging.getLogger("pgcascade.pipeline")


# Spark's own log: errors only, to stderr (its INFO lines would bury our progress display)
LOG4J = """rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark: %p %c{1}: %m%n
"""


def jdbc_jar(cfg: JobConfig) -> str:
    """The JDBC driver's path; a clear error when it is not there."""
    path = cfg.pipeline.jdbc_jar
    if not path.expanduser().is_file():
        raise ConfigError(
            f"PostgreSQL JDBC driver not found at {path}: install libpostgresql-jdbc-java"
            " or set jdbc_jar = /path/to/postgresql.jar in the config"
        )
    return str(path.expanduser())


def spark_settings(cfg: JobConfig) -> dict[str, str]:
    """Every `spark.*` key of the section, as written (Spark's names are case-sensitive)."""
    return dict(cfg.spark_conf)


def _scratch_dir() -> str:
    d = tempfile.mkdtemp(prefix="pgcascade-spark-")
    atexit.register(shutil.rmtree, d, True)
    return d


def reachable(remote: str) -> None:
    """Fail at once when nothing listens at sc://host:port (the client would retry for minutes)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(remote.replace("sc://", "http://", 1))
    try:
        socket.create_connection((u.hostname or "127.0.0.1", u.port or 15002), timeout=3).close()
    except OSError as e:
        raise RuntimeFailure(
            f"no Spark Connect server at {remote} ({e.strerror or e}): start one with"
            " `pgcascade CONFIG spark-server start`, or remove spark_remote from the config"
        ) from None


def local_environment() -> None:
    """What a local driver and its Python workers need, before the JVM starts."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def remote_session(remote: str, app_name: str = "pgcascade"):
    """The shared session of the Spark Connect server at remote (sc://host:port)."""
    from pyspark.sql import SparkSession

    log.debug("attaching to Spark Connect at %s", remote)
    reachable(remote)
    # every command attaches to one shared server session: its Python workers (with psycopg,
    # pyarrow and pgcascade imported) are reused, where a new session would start its own (~2 s)
    shared = f"{remote.rstrip('/')}/;session_id={uuid.uuid5(uuid.NAMESPACE_URL, 'pgcascade:' + remote)}"
    try:
        return SparkSession.builder.remote(shared).appName(app_name).getOrCreate()
    except Exception:
        log.debug("shared Spark Connect session unavailable (expired?): a session of our own")
    try:
        return SparkSession.builder.remote(remote).appName(app_name).getOrCreate()
    except Exception as e:
        raise RuntimeFailure(
            f"cannot attach to Spark Connect at {remote}: {str(e).splitlines()[0]}"
        ) from None


def build_session(cfg: JobConfig, app_name: str = "pgcascade"):
    """A SparkSession for this job: Spark Connect when spark_remote is set, else a classic one."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigError("pyspark is not installed: pip install 'pgcascade' with its dependencies") from None
    remote = cfg.pipeline.spark_remote
    if remote:
        return remote_session(remote, app_name)
    local_environment()
    scratch = _scratch_dir()
    log4j = Path(scratch) / "log4j2.properties"
    log4j.write_text(LOG4J)
    os.environ.setdefault("SPARK_CONF_DIR", scratch)
    master = cfg.pipeline.spark_master
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.jars", jdbc_jar(cfg))
        .config("spark.sql.warehouse.dir", str(Path(scratch) / "warehouse"))
        .config(
            "spark.driver.extraJavaOptions",
            f"-Dderby.system.home={scratch} -Dlog4j2.configurationFile={log4j}",
        )
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.python.worker.reuse", "true")
    )
    if master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1"
        )
    for key, value in spark_settings(cfg).items():
        builder = builder.config(key, value)
    log.debug("starting Spark (%s)", master)
    try:
        spark = builder.getOrCreate()
    except Exception as e:
        raise RuntimeFailure(f"cannot start Spark ({master}): {str(e).splitlines()[0]}") from None
    spark.sparkContext.setLogLevel("ERROR")
    return spark
