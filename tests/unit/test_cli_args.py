"""The command line without a database: argv rewriting, usage and config errors, `config`."""

import contextlib

import pytest

from pgcascade.cli.main import is_user_sqlstate, main, rewrite_argv

VERBS = {"ticker", "demo", "config", "status"}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["job.ini", "status"], ["--config", "job.ini", "status"]),
        (["-v", "job.ini", "worker", "-d"], ["-v", "--config", "job.ini", "worker", "-d"]),
        (["-q", "-v", "a.ini", "tables"], ["-q", "-v", "--config", "a.ini", "tables"]),
        (["ticker", "t.ini", "-s"], ["ticker", "t.ini", "-s"]),
        (["demo", "--seconds", "5"], ["demo", "--seconds", "5"]),
        (["--help"], ["--help"]),
        ([], []),
    ],
)
def test_the_config_comes_first_as_in_londiste(argv, expected):
    assert rewrite_argv(argv, VERBS) == expected


def test_user_sqlstates():
    assert is_user_sqlstate("P0002") and is_user_sqlstate("22P02") and is_user_sqlstate("55000")
    assert not is_user_sqlstate("08006") and not is_user_sqlstate(None) and not is_user_sqlstate("42P01")


def run(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_bad_config_value_exits_2_with_one_line(tmp_path, capsys):
    p = tmp_path / "w.ini"
    p.write_text("[pgcascade]\njob_name = w\ndb = dbname=x\nqueue_name = q\nparallel_copies = lots\n")
    code, _, err = run([str(p), "status"], capsys)
    assert code == 2
    assert err == f"pgcascade: {p}: parallel_copies = 'lots': must be a whole number\n"


def test_unknown_verb_and_missing_file_are_usage_errors(tmp_path, capsys):
    code, _, err = run([str(tmp_path / "nope.ini"), "status"], capsys)
    assert code == 2 and "config file not found" in err and err.count("\n") == 1
    p = tmp_path / "j.ini"
    p.write_text("[pgcascade]\njob_name = j\n")
    code, _, err = run([str(p), "frobnicate"], capsys)
    assert code == 2 and "No such command" in err and err.count("\n") == 1


def test_config_lists_every_key_with_its_value_and_hides_passwords(tmp_path, capsys):
    p = tmp_path / "j.ini"
    p.write_text(
        "[pgcascade]\njob_name = j\ndb = host=h password=s3cret\nmax_batch_events = 5000\ntypo_key = 1\n"
    )
    code, out, _ = run([str(p), "config"], capsys)
    assert code == 0
    assert "s3cret" not in out and "password=***" in out
    assert "max_batch_events" in out and "= 5000" in out
    assert "typo_key" in out and "ignored" in out
    code, out, _ = run(["config"], capsys)  # without a file: the keys and their defaults
    assert "parallel_copies" in out and "default 2" in out


def test_every_verb_is_in_the_table_that_loads_it_and_nowhere_else():
    import importlib
    import pkgutil

    import pgcascade.cli as cli_pkg
    from pgcascade.cli.main import VERBS, module_verbs

    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(cli_pkg.__path__):
        module = importlib.import_module(f"pgcascade.cli.{info.name}")
        if hasattr(module, "COMMANDS"):
            for verb in module_verbs(module):
                assert verb not in found, f"{verb} in {found.get(verb)} and {info.name}"
                found[verb] = info.name
    assert found == VERBS


def test_completion_knows_the_verbs_after_the_config(monkeypatch, capsys, tmp_path):
    p = tmp_path / "j.ini"
    p.write_text("[pgcascade]\njob_name = j\n")
    for words, cword, expected in [
        (f"pgcascade {p} add-", 2, ["add-peer", "add-seq", "add-table"]),
        (f"pgcascade {p} add-table --al", 3, ["--all", "--allow-local-writes"]),
        ("pgcascade tick", 1, ["ticker"]),
    ]:
        monkeypatch.setenv("_PGCASCADE_COMPLETE", "bash_complete")
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", str(cword))
        with contextlib.suppress(SystemExit):  # completion ends with exit 0
            main([])
        out = capsys.readouterr().out
        assert [line.split(",", 1)[1] for line in out.splitlines()] == expected, words
