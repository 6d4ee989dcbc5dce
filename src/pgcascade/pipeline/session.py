"""The one place a SparkSession is built, from the job's `[pgcascade]` section.

Keys read (all optional):

    spark_master   Spark master URL; default local[*] (every core of this machine)
    spark_remote   sc://host:port of a running Spark Connect server: attach to a warm Spark
                   instead of starting one (7-10 s saved per command on two cores)
    spark_executor_wait  seconds to wait for an executor of a cluster before giving up (120)
    spark_class_cache  where the driver's classes are saved once, for starts in half the time
                   (classcache.py; off: not saved)
    jdbc_jar       the PostgreSQL JDBC driver; default /usr/share/java/postgresql.jar (Debian's
                   libpostgresql-jdbc-java); only JDBC reads need it, checksums use psycopg
    spark.*        passed to the builder unchanged (spark.executor.memory, spark.sql.shuffle...);
                   spark.pyspark.python names the executors' interpreter (default: this one),
                   spark.driver.host / spark.driver.bindAddress the driver's address

Why each setting (see notes on this machine): in local mode the driver binds to loopback
(SPARK_LOCAL_IP; spark.driver.host alone is not enough); on a cluster it binds and advertises
this host's address on the route to the master, which the executors reach.  Python workers run
the interpreter PYSPARK_PYTHON names (PySpark reads only the environment, not
spark.pyspark.python), else `import psycopg` fails in tasks.  pgcascade ships its own package
to the executors (addPyFile, or an artifact with Spark Connect), so workers need only the
third-party libraries.  Warehouse and Derby files go to a temporary directory, never the
user's working directory.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

import pgcascade
from pgcascade.core.config import JobConfig
from pgcascade.core.errors import ConfigError, RuntimeFailure
from pgcascade.pipeline import classcache

log = logging.getLogger("pgcascade.pipeline")
logging.getLogger("py4j").setLevel(logging.WARNING)  # its INFO lines at exit are not ours to show


# Spark's own log: errors only, to stderr (its INFO lines would bury our progress display),
# but its warnings about a cluster's resources ("Initial job has not accepted any resources",
# a master it cannot reach) are what a user waiting on a cluster needs to see
LOG4J = """rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark: %p %c{1}: %m%n
logger.scheduler.name = org.apache.spark.scheduler.TaskSchedulerImpl
logger.scheduler.level = warn
logger.deploy.name = org.apache.spark.deploy.client
logger.deploy.level = warn
logger.backend.name = org.apache.spark.scheduler.cluster
logger.backend.level = warn
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


SCRATCH_PREFIX = "pgcascade-spark-"
SCRATCH_OWNER = "owner"  # "host pid" of the command that made the folder


def _scratch_dir() -> str:
    """A scratch folder for this command's Spark, removed at exit; first, those of commands
    that died without their exit (a SIGKILL, a crash) are swept."""
    sweep_scratch_dirs(Path(tempfile.gettempdir()))
    d = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    Path(d, SCRATCH_OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    atexit.register(shutil.rmtree, d, True)
    return d


def sweep_scratch_dirs(parent: Path) -> list[Path]:
    """Remove the scratch folders under `parent` whose command is gone; the folders removed."""
    swept = []
    for d in parent.glob(SCRATCH_PREFIX + "*"):
        if _owner_gone(d / SCRATCH_OWNER):
            shutil.rmtree(d, ignore_errors=True)
            swept.append(d)
    return swept


def _owner_gone(owner: Path) -> bool:
    """Whether the folder's command was on this host and its process no longer exists (a folder
    without the file, or where /proc does not tell, is left alone)."""
    try:
        host, pid = [*owner.read_text().split(), "", ""][:2]
    except OSError:
        return False
    if host != socket.gethostname() or not pid.isdigit() or not Path("/proc/self").exists():
        return False
    return not Path(f"/proc/{pid}").exists()


def reachable(remote: str) -> None:
    """Fail at once when nothing listens at sc://host:port (the client would retry for minutes)."""
    u = urlparse(remote.replace("sc://", "http://", 1))
    try:
        socket.create_connection((u.hostname or "127.0.0.1", u.port or 15002), timeout=3).close()
    except OSError as e:
        raise RuntimeFailure(
            f"no Spark Connect server at {remote} ({e.strerror or e}): start one with"
            " `pgcascade CONFIG spark-server start`, or remove spark_remote from the config"
        ) from None


def is_local(master: str) -> bool:
    return master.startswith("local")


def master_endpoint(master: str) -> tuple[str, int] | None:
    """(host, port) of the first master of spark://h1:p1,h2:p2 or k8s://https://h:p; None for
    masters with no address (yarn: the cluster's configuration has it)."""
    m = re.match(r"(?:k8s://)?(\w+)://([^,/]+)", master)
    if not m:
        return None
    u = urlparse(f"{m.group(1)}://{m.group(2)}")
    default = 7077 if m.group(1) == "spark" else 443
    return (u.hostname, u.port or default) if u.hostname else None


def driver_address(master: str, conf: Mapping[str, str]) -> str | None:
    """The address executors reach this driver at: spark.driver.host when the config sets it,
    loopback in local mode, else this host's address on the route to the master."""
    if conf.get("spark.driver.host"):
        return conf["spark.driver.host"]
    if is_local(master):
        return "127.0.0.1"
    endpoint = master_endpoint(master)
    if endpoint is None:
        return None
    try:
        family, kind, _, _, addr = socket.getaddrinfo(*endpoint, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(addr)  # UDP: no packet is sent, the kernel only picks the route
            return str(s.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"spark_master {master}: cannot reach {endpoint[0]} ({e.strerror or e})") from None


def executor_python(conf: Mapping[str, str]) -> str:
    """The executors' interpreter: spark.pyspark.python, else $PYSPARK_PYTHON, else this one."""
    return conf.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON") or sys.executable


def driver_environment(master: str, conf: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(environment, spark.driver.* settings) a driver - ours, or a Spark Connect server's -
    needs before its JVM starts: the address to bind and advertise, the executors' Python."""
    host = driver_address(master, conf)
    bind = conf.get("spark.driver.bindAddress") or host
    env = {"PYSPARK_PYTHON": executor_python(conf), "PYSPARK_DRIVER_PYTHON": sys.executable}
    settings = {}
    if bind:
        env["SPARK_LOCAL_IP"] = bind
        settings["spark.driver.bindAddress"] = bind
    if host:
        settings["spark.driver.host"] = host
    return env, settings


@cache
def package_archive() -> Path:
    """pgcascade's own package as a zip for the executors, named by its content (a Spark
    Connect server keeps artifacts by name: a new release must not meet an old one)."""
    root = Path(pgcascade.__file__).parent
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    dest = Path(_scratch_dir()) / f"pgcascade-{digest.hexdigest()[:16]}.zip"
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            z.write(f, str(Path("pgcascade") / f.relative_to(root)))
    return dest


def ship_package(spark) -> None:
    """Put pgcascade on the executors' path: workers need only its third-party libraries."""
    archive = str(package_archive())
    if not is_connect(spark):
        spark.sparkContext.addPyFile(archive)
        return
    try:
        spark.addArtifacts(archive, pyfile=True)
    except Exception as e:  # the shared session has it already (same name, same content)
        if "exist" not in str(e).lower():
            raise RuntimeFailure(f"cannot ship pgcascade to Spark Connect: {first_line(e)}") from None


def is_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def master_of(spark) -> str:
    return str(spark.conf.get("spark.master", "local[*]"))


def probe_task(batches: Iterator) -> Iterator:
    """An executor's answer: its interpreter, once pgcascade's pipeline imports there."""
    import pyarrow as pa

    import pgcascade.pipeline.compare  # noqa: F401  (what the real tasks import)

    for b in batches:
        yield pa.RecordBatch.from_pydict({"python": [sys.executable] * b.num_rows})


def first_line(e: BaseException) -> str:
    """The line of a Spark error worth showing: a Python worker's own exception when there is
    one (not the JVM's wrapper), else the first line."""
    text = str(e)
    raised = re.findall(r"^(\w[\w.]*(?:Error|Exception)\b.*)$", text, re.MULTILINE)
    return raised[-1] if raised else (text.strip().splitlines() or [type(e).__name__])[0]


def await_executors(spark, wait: float) -> None:
    """On a cluster: one small task on an executor within `wait` seconds, or a one-line error.

    A master that grants no executor (no worker, too little memory, every core held by another
    application) would otherwise leave the command waiting with no word; a worker that lacks
    a library fails here, before any database is locked."""
    master = master_of(spark)
    if is_local(master):
        return
    outcome: dict[str, object] = {}

    def probe() -> None:
        try:
            outcome["python"] = spark.range(0, 1, 1, 1).mapInArrow(probe_task, "python string").first()[0]
        except Exception as e:  # reported by the caller
            outcome["error"] = e

    t = threading.Thread(target=probe, name="executor-probe", daemon=True)
    t.start()
    t.join(wait)
    if t.is_alive():
        _cancel_jobs(spark)
        raise RuntimeFailure(
            f"no Spark executor from {master} within {wait:.0f} s: check the master's page for a"
            " worker with free cores and the memory of spark.executor.memory, and that the workers"
            " reach this driver (spark.driver.host) and the databases"
        )
    if "error" in outcome:
        err = outcome["error"]
        assert isinstance(err, BaseException)
        raise RuntimeFailure(f"the executors of {master} cannot run pgcascade's tasks: {first_line(err)}")
    log.debug("executors of %s ready (Python %s)", master, outcome.get("python"))


def _cancel_jobs(spark) -> None:
    try:
        if is_connect(spark):
            spark.interruptAll()
        else:
            spark.sparkContext.cancelAllJobs()
    except Exception:  # the process exits next: nothing is left to cancel
        log.debug("could not cancel the probe job", exc_info=True)


def cluster_parallelism(spark) -> int:
    """The cores Spark runs tasks on: this host's in local mode, the executors' on a cluster."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    from pyspark.sql import functions as F

    # a range's default partition count is the default parallelism (no SparkContext here)
    parts = spark.range(0, 1 << 16).select(F.spark_partition_id().alias("p")).agg(F.max("p"))
    return int(parts.first()[0]) + 1


def remote_session(remote: str, app_name: str = "pgcascade"):
    """The shared session of the Spark Connect server at remote (sc://host:port)."""
    from pyspark.sql import SparkSession

    log.debug("attaching to Spark Connect at %s", remote)
    reachable(remote)
    # every command attaches to one shared server session: its Python workers (with psycopg,
    # pyarrow and pgcascade imported) are reused, where a new session would start its own (~2 s)
    shared = f"{remote.rstrip('/')}/;session_id={uuid.uuid5(uuid.NAMESPACE_URL, 'pgcascade:' + remote)}"
    try:
        spark = SparkSession.builder.remote(shared).appName(app_name).getOrCreate()
    except Exception:
        log.debug("shared Spark Connect session unavailable (expired?): a session of our own")
        try:
            spark = SparkSession.builder.remote(remote).appName(app_name).getOrCreate()
        except Exception as e:
            raise RuntimeFailure(f"cannot attach to Spark Connect at {remote}: {first_line(e)}") from None
    ship_package(spark)
    return spark


def build_session(cfg: JobConfig, app_name: str = "pgcascade"):
    """A SparkSession for this job, with executors ready: Spark Connect when spark_remote is
    set, else a classic one on spark_master."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigError("pyspark is not installed: pip install 'pgcascade' with its dependencies") from None
    wait = cfg.pipeline.spark_executor_wait
    remote = cfg.pipeline.spark_remote
    if remote:
        spark = remote_session(remote, app_name)
        await_executors(spark, wait)
        return spark
    conf = spark_settings(cfg)
    master = cfg.pipeline.spark_master
    env, driver = driver_environment(master, conf)
    os.environ.update(env)
    scratch = _scratch_dir()
    log4j = Path(scratch) / "log4j2.properties"
    log4j.write_text(LOG4J)
    cache = classcache.folder(cfg.pipeline.spark_class_cache)
    os.environ.setdefault("SPARK_CONF_DIR", str(classcache.conf_dir(cache or Path(scratch))))
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.jars", jdbc_jar(cfg))
        .config("spark.sql.warehouse.dir", str(Path(scratch) / "warehouse"))
        .config(
            "spark.driver.extraJavaOptions",
            f"-Dderby.system.home={scratch} -Dlog4j2.configurationFile={log4j}"
            f" {classcache.java_options(cache, conf)}",
        )
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.python.worker.reuse", "true")
    )
    for key, value in {**driver, **conf}.items():
        builder = builder.config(key, value)
    log.debug("starting Spark (%s)", master)
    try:
        spark = builder.getOrCreate()
    except Exception as e:
        raise RuntimeFailure(f"cannot start Spark ({master}): {first_line(e)}") from None
    ship_package(spark)
    await_executors(spark, wait)
    return spark
