"""The throwaway clusters of the demo, the benches and the tests (dev/localcluster.py)."""

from __future__ import annotations

from pgcascade.dev.localcluster import new_cluster


def test_a_cluster_made_in_a_temporary_directory_leaves_nothing_once_destroyed() -> None:
    cluster = new_cluster("scratch")
    with cluster.connect() as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    base = cluster.basedir
    assert base.is_dir()
    cluster.destroy()
    assert not base.exists()


def test_a_given_base_directory_stays(tmp_path) -> None:
    cluster = new_cluster("scratch", basedir=tmp_path / "clusters")
    cluster.destroy()
    assert (tmp_path / "clusters").is_dir() and not cluster.datadir.exists()
