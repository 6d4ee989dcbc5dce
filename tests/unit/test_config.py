"""Typed config: every key declared once; bad values are one-line errors naming key and file."""

from pathlib import Path

import pytest

from pgcascade.core.config import JobConfig, known_keys, load_config
from pgcascade.core.errors import ConfigError


def ini(tmp_path: Path, body: str, section: str = "pgcascade") -> Path:
    p = tmp_path / "job.ini"
    p.write_text(f"[{section}]\njob_name = j\n{body}\n")
    return p


def test_defaults_when_only_job_name_is_set(tmp_path):
    cfg = load_config(ini(tmp_path, ""))
    assert cfg.job_name == "j"
    assert cfg.db is None and cfg.loop_delay is None
    assert cfg.worker.parallel_copies == 2 and cfg.worker.max_batch_events == 200000
    assert cfg.ticker.ticker_period == 0.02 and cfg.ticker.database_list == ()
    assert cfg.pipeline.spark_copy_min_rows == 5_000_000 and cfg.pipeline.spark_copy_streams is None
    assert cfg.pipeline.sink_path is None


def test_values_are_converted_to_their_types(tmp_path):
    cfg = load_config(
        ini(
            tmp_path,
            "parallel_copies = 4\nloop_delay = 0.5\ndatabase_list = a, b ,c\nsink_path = ~/lake\n"
            "spark_copy_min_rows = off\nlogfile = /tmp/%(job_name)s.log\nmaint_period = 1\n"
            "read_between_ticks = On",
        )
    )
    assert cfg.worker.read_between_ticks is True
    assert cfg.worker.parallel_copies == 4
    assert cfg.loop_delay == 0.5
    assert cfg.ticker.database_list == ("a", "b", "c")
    assert cfg.ticker.maint_period == 1.0
    assert cfg.pipeline.sink_path == "~/lake"  # a path or a URI: the lake expands it
    assert cfg.pipeline.spark_copy_min_rows is None
    assert cfg.logfile == Path("/tmp/j.log")


@pytest.mark.parametrize(
    "line, message",
    [
        ("parallel_copies = two", "parallel_copies = 'two': must be a whole number"),
        ("parallel_copies = 0", "parallel_copies = '0': must be at least 1"),
        (
            "loop_delay = soon",
            "loop_delay = 'soon': must be a number of seconds or a duration (500ms, 5min, 1h)",
        ),
        ("spark_copy_min_rows = many", "spark_copy_min_rows = 'many': must be a whole number, or off"),
        ("watermark_period = -1", "watermark_period = '-1': must be at least 0.01"),
        ("read_between_ticks = maybe", "read_between_ticks = 'maybe': must be on or off"),
    ],
)
def test_a_bad_value_is_one_line_naming_key_and_file(tmp_path, line, message):
    path = ini(tmp_path, line)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {message}"
    assert "\n" not in str(e.value)


def test_londiste2_section_and_key_names(tmp_path):
    cfg = load_config(
        ini(
            tmp_path,
            "subscriber_db = dbname=s\nprovider_db = dbname=p\npgq_queue_name = q",
            section="londiste",
        )
    )
    assert (cfg.db, cfg.provider_db, cfg.queue_name) == ("dbname=s", "dbname=p", "q")


def test_unknown_keys_are_kept_aside_and_spark_keys_keep_their_case(tmp_path):
    cfg = load_config(ini(tmp_path, "parralel_copies = 3\nspark.sql.shuffle.Partitions = 8"))
    assert cfg.unknown == {"parralel_copies": "3"}
    assert cfg.spark_conf == {"spark.sql.shuffle.Partitions": "8"}


@pytest.mark.parametrize(
    "body, message",
    [
        ("", r"no \[pgcascade\] section"),
        ("[pgcascade]\ndb = x\n", "job_name is missing"),
        ("[pgcascade\n", "cannot parse"),
    ],
)
def test_broken_files(tmp_path, body, message):
    p = tmp_path / "bad.ini"
    p.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_config(p)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.ini")


def test_every_key_is_declared_once_with_a_help_line():
    keys = known_keys()
    names = [k.name for k in keys]
    assert len(names) == len(set(names))
    assert all(k.help and k.type for k in keys)
    assert {
        "db",
        "queue_name",
        "parallel_copies",
        "ticker_period",
        "capture_commit_delay",
        "sink_path",
    } <= set(names)


def test_with_changes_leaves_the_original_alone(tmp_path):
    cfg = load_config(ini(tmp_path, "pidfile = /tmp/x.pid"))
    other = cfg.with_changes(pidfile=None)
    assert cfg.pidfile == Path("/tmp/x.pid") and other.pidfile is None
    assert isinstance(other, JobConfig)
