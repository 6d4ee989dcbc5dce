"""The ini configuration: one `[pgcascade]` section per job, Londiste style.

    [pgcascade]
    job_name = ticker_main
    db = host=127.0.0.1 dbname=app
    logfile = ~/log/%(job_name)s.log
    pidfile = ~/pid/%(job_name)s.pid

`%(job_name)s` interpolation works as in Londiste; `~` is expanded.  The seed's Londiste 2
section name `[londiste]` and keys (`provider_db`, `subscriber_db`, `pgq_queue_name`) are read too.
A config mistake raises ConfigError with one line that says what to fix.
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass, field
from pathlib import Path

from pgcascade.core.errors import ConfigError

SECTIONS = ("pgcascade", "londiste")


@dataclass
class TickerSettings:
    """How the ticker daemon serves its databases (seconds)."""

    ticker_period: float = 0.02  # how often each database is asked whether a queue needs a tick
    retry_period: float = 1.0  # moving due retry events back into their queues
    maint_period: float = 10.0  # rotation and tick cleanup
    vacuum_period: float = 300.0  # VACUUM of the small, often-updated queue tables
    discover_period: float = 60.0  # looking for new databases with pgcascade installed


@dataclass
class JobConfig:
    path: Path
    job_name: str
    db: str | None = None
    queue_name: str | None = None
    provider_db: str | None = None
    logfile: Path | None = None
    pidfile: Path | None = None
    loop_delay: float = 1.0
    # the ticker serves `db`, the databases in `database_list` (names joined to base_connstr),
    # or every database with pgcascade installed that it finds through initial_database.
    base_connstr: str = ""
    database_list: list[str] = field(default_factory=list)
    initial_database: str = "postgres"
    ticker: TickerSettings = field(default_factory=TickerSettings)
    raw: dict[str, str] = field(default_factory=dict)


def _float(section: configparser.SectionProxy, key: str, default: float) -> float:
    value = section.get(key)
    if value is None or value.strip() == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{key} = {value!r}: must be a number of seconds") from None


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def load_config(path: str | Path) -> JobConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    parser = configparser.ConfigParser(interpolation=configparser.BasicInterpolation())
    try:
        parser.read(p)
    except configparser.Error as e:
        raise ConfigError(f"{p}: cannot parse: {str(e).splitlines()[0]}") from None
    name = next((s for s in SECTIONS if parser.has_section(s)), None)
    if name is None:
        raise ConfigError(f"{p}: no [pgcascade] section")
    section = parser[name]
    try:
        raw = dict(section.items())
    except configparser.Error as e:
        raise ConfigError(f"{p}: {str(e).splitlines()[0]}") from None
    job_name = raw.get("job_name", "").strip()
    if not job_name:
        raise ConfigError(f"{p}: job_name is missing from [{name}]")
    dblist = [d.strip() for d in raw.get("database_list", "").split(",") if d.strip()]
    return JobConfig(
        path=p,
        job_name=job_name,
        db=raw.get("db") or raw.get("subscriber_db") or None,
        queue_name=raw.get("queue_name") or raw.get("pgq_queue_name") or None,
        provider_db=raw.get("provider_db") or None,
        logfile=_path(raw.get("logfile")),
        pidfile=_path(raw.get("pidfile")),
        loop_delay=_float(section, "loop_delay", 1.0),
        base_connstr=raw.get("base_connstr", ""),
        database_list=dblist,
        initial_database=raw.get("initial_database", "postgres"),
        ticker=TickerSettings(
            **{k: _float(section, k, v) for k, v in TickerSettings().__dict__.items()}  # type: ignore[arg-type]
        ),
        raw=raw,
    )
