"""The ini configuration: one `[pgcascade]` section per job, Londiste style.

    [pgcascade]
    job_name = ticker_main
    db = host=127.0.0.1 dbname=app
    logfile = ~/log/%(job_name)s.log
    pidfile = ~/pid/%(job_name)s.pid

Every key is declared once, below, as a field of a settings dataclass: its type, its default
and a one-line help (`pgcascade CONF config` lists them).  Values are converted and checked
when the file is loaded, so a bad value is a one-line ConfigError naming the key and the file,
never a traceback from the daemon that reads it later.  `%(job_name)s` interpolation works as
in Londiste; `~` is expanded.  The seed's Londiste 2 section `[londiste]` and its keys
(`provider_db`, `subscriber_db`, `pgq_queue_name`) are read too.  Keys this release does not
know are kept aside and shown by `config` as ignored, as Londiste ignores them; `spark.*` keys
go to Spark as given.
"""

from __future__ import annotations

import configparser
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgcascade.core.errors import ConfigError

SECTIONS = ("pgcascade", "londiste")
DURATION_UNITS = {
    **dict.fromkeys(("ms", "msec"), 0.001),
    **dict.fromkeys(("", "s", "sec", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
}
OFF_WORDS = ("off", "no", "false", "0")
# Londiste 2 names of keys (seed 000)
ALIASES = {"subscriber_db": "db", "pgq_queue_name": "queue_name"}


def parse_duration(text: str) -> float:
    """Seconds from `30`, `30s`, `500ms`, `5min`, `1h`, `2 days`; ValueError otherwise."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in DURATION_UNITS:
        raise ValueError(f"{text!r} is not a duration (examples: 30s, 500ms, 5min, 1h)")
    return float(m.group(1)) * DURATION_UNITS[m.group(2)]


def setting(default: Any, help: str, *, minimum: float | None = None) -> Any:
    """A config key: its default, its help line and the lowest value it accepts."""
    return field(default=default, metadata={"help": help, "minimum": minimum})


@dataclass(frozen=True)
class ConnectionSettings:
    """Every connection to PostgreSQL: how soon a dead network link is noticed (core/pgconn.py)."""

    tcp_keepalives_idle: int = setting(
        15, "seconds idle before TCP keepalive probes start (0: system default)", minimum=0
    )
    tcp_keepalives_interval: int = setting(
        5, "seconds between TCP keepalive probes (0: system default)", minimum=0
    )
    tcp_keepalives_count: int = setting(
        3, "unanswered probes that make a link dead (0: system default)", minimum=0
    )
    tcp_user_timeout: float = setting(
        60.0,
        "seconds sent data or probes may stay unacknowledged before the connection fails (0: system default)",
        minimum=0,
    )


@dataclass(frozen=True)
class TickerSettings:
    """The ticker daemon (pgqd's job): which databases, and how often (seconds)."""

    ticker_period: float = setting(
        0.02, "how often at the most each database is asked whether a queue needs a tick", minimum=0.001
    )
    retry_period: float = setting(1.0, "moving due retry events back into their queues", minimum=0.01)
    maint_period: float = setting(
        10.0, "rotation, tick cleanup, new partitions' capture triggers", minimum=0.01
    )
    vacuum_period: float = setting(300.0, "VACUUM of the small, often-updated queue tables", minimum=0.01)
    discover_period: float = setting(60.0, "looking for new databases with pgcascade installed", minimum=0.01)
    base_connstr: str = setting("", "connection string the database names of database_list are added to")
    database_list: tuple[str, ...] = setting(
        (), "databases to serve (comma-separated); default: db, else all"
    )
    initial_database: str = setting("postgres", "database the ticker lists the others from")


@dataclass(frozen=True)
class WorkerSettings:
    """The replay worker and its copy processes."""

    parallel_copies: int = setting(2, "initial copies running at once", minimum=1)
    max_batch_events: int = setting(
        200000, "a leaf that is behind merges ticks into batches of about this many events", minimum=1
    )
    watermark_period: float = setting(
        1.0, "seconds between reports of what this node still needs to its provider", minimum=0.01
    )
    apply_connections: int = setting(
        1,
        "a leaf applies a large batch's tables on this many connections at once, each committing"
        " its tables on its own (docs/replication.md)",
        minimum=1,
    )
    parallel_apply_min_events: int = setting(
        20000, "the smallest batch (events) applied on several connections", minimum=1
    )
    stream_chunk_events: int = setting(
        250000,
        "a larger batch is applied in chunks of this many events, each decoded by a second session"
        " while the one before is written (docs/replication.md)",
        minimum=1000,
    )
    apply_delay: float = setting(
        0.0,
        "a leaf applies each batch only once its tick is this old (30min, 1h): a delayed replica"
        " (docs/replication.md)",
        minimum=0,
    )
    pace_max: float = setting(
        0.02,
        "the longest wait before the batch after a small one while the host's CPUs are under"
        " pressure (0: never wait; docs/replication.md, paced batches)",
        minimum=0,
    )
    pace_pressure: int = setting(
        50,
        "the CPU pressure (percent of the time a task waited for a CPU) above which batches are paced",
        minimum=1,
    )
    pace_pressure_file: Path = setting(
        Path("/proc/pressure/cpu"), "the PSI file read (a cgroup's cpu.pressure: that group's pressure)"
    )
    read_between_ticks: bool = setting(
        False,
        "a leaf that keeps up, the only reader of its provider's queue, reads the changes committed"
        " up to its fetch instead of making a tick for each batch (docs/replication.md: off until"
        " its batch rate is governed)",
    )


@dataclass(frozen=True)
class CaptureSettings:
    """The root's logical capture daemon."""

    capture_commit_delay: float = setting(
        0.01, "seconds of source transactions gathered into one queue transaction", minimum=0
    )


@dataclass(frozen=True)
class PipelineSettings:
    """The Spark pipeline: compare, repair, Spark copy, lake sink."""

    spark_master: str = setting("local[*]", "Spark master URL (local mode by default)")
    spark_remote: str = setting("", "a Spark Connect server to attach to (sc://host:port)")
    spark_server_dir: Path = setting(
        Path("~/.pgcascade/spark-server"), "where spark-server keeps its pid and logs"
    )
    spark_server_port: int = setting(15002, "port of spark-server", minimum=1)
    spark_server_address: str = setting(
        "127.0.0.1", "the address spark-server listens on for commands (0.0.0.0: every interface)"
    )
    spark_executor_wait: float = setting(
        120.0, "seconds a command on a Spark cluster waits for an executor before it gives up", minimum=1
    )
    jdbc_jar: Path = setting(Path("/usr/share/java/postgresql.jar"), "the PostgreSQL JDBC driver")
    spark_class_cache: str = setting(
        "~/.cache/pgcascade/spark-classes",
        "where the Spark driver's classes are saved once for starts in half the time (off: not saved)",
    )
    spark_copy_min_rows: int | None = setting(
        5_000_000, "tables with at least this many rows copy as Spark tasks (off: never)", minimum=1
    )
    spark_copy_streams: int | None = setting(
        None,
        "ranges copied at once (default: half this host's cores in local mode, else the"
        " cluster's cores, within what the databases' connection slots allow)",
        minimum=1,
    )
    spark_copy_range_rows: int = setting(2_000_000, "rows per Spark copy range", minimum=1)
    compare_segment_rows: int = setting(250_000, "rows per compared key range (a Spark task)", minimum=1)
    compare_bucket_rows: int = setting(32, "rows per checksum bucket of a range", minimum=1)
    compare_max_segments: int = setting(4096, "most key ranges per table", minimum=1)
    sync_timeout: float = setting(
        10.0, "seconds the provider's tables may stay locked for a sync point", minimum=0.1
    )
    sink_path: str | None = setting(
        None, "the lake directory of the sink: a path, or a URI (file://, s3a://, hdfs://, gs://)"
    )
    sink_consumer: str = setting("", "the sink's consumer name (default: job_name)")


@dataclass(frozen=True)
class ServeSettings:
    """`serve`: the live page, /api/topology and the set's /metrics."""

    serve_port: int = setting(8432, "port of the page (serve --port overrides it)", minimum=1)
    serve_address: str = setting("127.0.0.1", "the address the page listens on (0.0.0.0: every interface)")
    serve_refresh: float = setting(2.0, "seconds between two readings of the set", minimum=0.2)


@dataclass(frozen=True)
class JobConfig:
    path: Path
    job_name: str
    db: str | None = setting(None, "connection string of this job's database")
    queue_name: str | None = setting(None, "the set (queue) this node belongs to")
    provider_db: str | None = setting(None, "Londiste 2: the provider's database")
    logfile: Path | None = setting(None, "log file of the daemons")
    pidfile: Path | None = setting(None, "pid file of the daemons (-d, -s, -k, -r need it)")
    loop_delay: float | None = setting(
        None, "most seconds a daemon waits between rounds (default: worker 1, capture 0.02)", minimum=0.001
    )
    metrics_port: int | None = setting(
        None, "serve Prometheus /metrics of the daemon on this port", minimum=1
    )
    metrics_address: str = setting("127.0.0.1", "the address /metrics listens on (0.0.0.0: every interface)")
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)
    ticker: TickerSettings = field(default_factory=TickerSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    serve: ServeSettings = field(default_factory=ServeSettings)
    spark_conf: dict[str, str] = field(default_factory=dict)  # spark.* keys, names as written
    unknown: dict[str, str] = field(default_factory=dict)  # keys this release ignores

    def with_changes(self, **changes: Any) -> JobConfig:
        return dataclasses.replace(self, **changes)


GROUPS: dict[str, type] = {
    "connection": ConnectionSettings,
    "ticker": TickerSettings,
    "worker": WorkerSettings,
    "capture": CaptureSettings,
    "pipeline": PipelineSettings,
    "serve": ServeSettings,
}


@dataclass(frozen=True)
class KeyInfo:
    name: str
    group: str
    type: str
    default: Any
    help: str


def _key_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def known_keys() -> list[KeyInfo]:
    """Every config key, in the order `config` lists them."""
    hints_of = {cls: typing.get_type_hints(cls) for cls in (JobConfig, *GROUPS.values())}
    out = [
        KeyInfo(f.name, "job", _type_name(hints_of[JobConfig][f.name]), f.default, f.metadata["help"])
        for f in _key_fields(JobConfig)
    ]
    for group, cls in GROUPS.items():
        out += [
            KeyInfo(f.name, group, _type_name(hints_of[cls][f.name]), f.default, f.metadata["help"])
            for f in _key_fields(cls)
        ]
    return out


def _type_name(tp: Any) -> str:
    base, optional = _unwrap(tp)
    name = {int: "integer", float: "seconds", str: "text", Path: "path", bool: "on or off"}.get(base, "list")
    return f"{name} or off" if optional and base is int else name


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """`int | None` -> (int, True); tuple[str, ...] -> (tuple, False)."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return _unwrap(inner[0])[0], True
    return (typing.get_origin(tp) or tp), False


def convert(name: str, text: str, tp: Any, minimum: float | None) -> Any:
    """The value of key `name` from its text; ValueError with what is wrong."""
    base, optional = _unwrap(tp)
    text = text.strip()
    if optional and (text == "" or (base is int and text.lower() in OFF_WORDS)):
        return None
    if base is tuple:
        return tuple(d.strip() for d in text.split(",") if d.strip())
    if base is Path:
        return Path(text).expanduser()
    if base is str:
        return text
    if base is bool:
        if text.lower() in ("on", "true", "yes", "1"):
            return True
        if text.lower() in ("off", "false", "no", "0"):
            return False
        raise ValueError("must be on or off")
    try:
        value = parse_duration(text) if base is float else base(text)
    except ValueError:
        what = "a whole number" if base is int else "a number of seconds or a duration (500ms, 5min, 1h)"
        raise ValueError(f"must be {what}" + (", or off" if optional and base is int else "")) from None
    if minimum is not None and value < minimum:
        raise ValueError(f"must be at least {minimum:g}")
    return value


def _fill(cls: type, values: dict[str, str], p: Path) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in _key_fields(cls):
        if f.name in values and values[f.name].strip() != "":
            try:
                kwargs[f.name] = convert(f.name, values[f.name], hints[f.name], f.metadata["minimum"])
            except ValueError as e:
                raise ConfigError(f"{p}: {f.name} = {values[f.name].strip()!r}: {e}") from None
    return cls(**kwargs) if cls is not JobConfig else kwargs


def _read_section(p: Path) -> tuple[str, dict[str, str]]:
    parser = configparser.ConfigParser(interpolation=configparser.BasicInterpolation())
    try:
        parser.read(p)
    except configparser.Error as e:
        raise ConfigError(f"{p}: cannot parse: {str(e).splitlines()[0]}") from None
    name = next((s for s in SECTIONS if parser.has_section(s)), None)
    if name is None:
        raise ConfigError(f"{p}: no [pgcascade] section")
    try:
        return name, dict(parser[name].items())
    except configparser.Error as e:
        raise ConfigError(f"{p}: {str(e).splitlines()[0]}") from None


def spark_keys(p: Path, raw: dict[str, str]) -> dict[str, str]:
    """Every `spark.*` key, as written (configparser lower-cases keys; Spark's are case-sensitive)."""
    out = {}
    for line in p.read_text().splitlines():
        key, sep, _value = line.partition("=")
        key = key.strip()
        if sep and key.lower().startswith("spark.") and key.lower() in raw:
            out[key] = raw[key.lower()].strip()
    return out


def load_config(path: str | Path) -> JobConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    section, raw = _read_section(p)
    for old, new in ALIASES.items():
        if raw.get(old) and not raw.get(new):
            raw[new] = raw[old]
    job_name = raw.get("job_name", "").strip()
    if not job_name:
        raise ConfigError(f"{p}: job_name is missing from [{section}]")
    known = {k.name for k in known_keys()} | set(ALIASES) | {"job_name"}
    return JobConfig(
        path=p,
        job_name=job_name,
        **_fill(JobConfig, raw, p),
        **{group: _fill(cls, raw, p) for group, cls in GROUPS.items()},
        spark_conf=spark_keys(p, raw),
        unknown={k: v for k, v in raw.items() if k not in known and not k.startswith("spark.")},
    )
