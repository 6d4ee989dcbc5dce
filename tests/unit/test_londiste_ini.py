"""A Londiste 3 job ini read as Skytools reads it (import-londiste finds the worker's pidfile
where Londiste writes it): %(name)s with Skytools' defaults, ${name} with config_format = 2,
[DEFAULT] keys, and one-line refusals."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pgcascade.cli.londiste3 import read_job
from pgcascade.core.errors import UserError


def ini(tmp_path: Path, text: str, name: str = "l_leaf.ini") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_percent_interpolation_with_skytools_defaults(tmp_path: Path) -> None:
    job = read_job(
        ini(
            tmp_path,
            "[londiste]\ndb = dbname=x\nqueue_name = q\npidfile = ~/pid/%(job_name)s.pid\n"
            "logfile = %(config_dir)s/%(service_name)s-%(host_name)s.log\n",
        )
    )
    assert job["job_name"] == "l_leaf"  # the file's name, as Skytools has it
    assert job["pidfile"] == "~/pid/l_leaf.pid"
    assert job["logfile"] == f"{tmp_path}/londiste-{socket.gethostname()}.log"


def test_an_explicit_job_name_defaults_and_config_format_2(tmp_path: Path) -> None:
    job = read_job(
        ini(
            tmp_path,
            "[DEFAULT]\nbase = /var/run/sky\n[londiste]\nconfig_format = 2\njob_name = leaf_job\n"
            "db = dbname=x\nqueue_name = q\npidfile = ${base}/${job_name}.pid\n",
        )
    )
    assert job["pidfile"] == "/var/run/sky/leaf_job.pid"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[londiste]\ndb = x\nqueue_name = q\npidfile = %(nowhere)s.pid\n", "nowhere"),
        ("[londiste]\nconfig_format = 3\ndb = x\nqueue_name = q\n", "config_format = 3"),
        ("[londiste]\ndb = x\n", "queue_name is not set"),
        ("no section\n", "l_leaf.ini"),
    ],
)
def test_refusals_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(UserError) as e:
        read_job(ini(tmp_path, text))
    assert message in str(e.value) and "\n" not in str(e.value)
