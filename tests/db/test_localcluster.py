"""The throwaway clusters of the demo, the benches and the tests (dev/localcluster.py)."""

from __future__ import annotations

import socket

import psycopg

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


def test_a_port_taken_after_it_was_chosen_moves_the_first_start_to_another(tmp_path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        cluster = new_cluster("scratch", basedir=tmp_path / "clusters", port=taken)
        try:
            assert cluster.port != taken
            with psycopg.connect(f"host=127.0.0.1 port={cluster.port} user=postgres dbname=postgres") as conn:
                assert conn.execute("show port").fetchone() == (str(cluster.port),)
            cluster.restart()  # and the port it moved to is the one it keeps
            assert cluster.is_running()
        finally:
            cluster.destroy()
