"""A node unreachable over SSH where Ray starts on it or the Jobs API tunnels to it: a
PreflightError naming it (exit 3), no NodeError traceback; a spare is passed over; `launch down
--yes` forgets it, naming the nodes it could not stop Ray on."""

from __future__ import annotations

import json
import socket
import time

import pytest

from launcher.cli import main
from launcher.errors import EXIT_PREFLIGHT, PreflightError
from launcher.jobs import api, records
from launcher.orchestrate import ray_cluster
from launcher.spec import ClusterSpec


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections to it are refused
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


def _ghost_cluster(tmp_path) -> ClusterSpec:
    node = {"name": "ghost", "host": "127.0.0.2", "port": _closed_port()}
    ssh = {"connect_timeout_s": 3, "known_hosts": str(tmp_path / "known_hosts")}
    return ClusterSpec.model_validate({"nodes": [node], "ssh": ssh})


def test_starting_ray_on_an_unreachable_node_is_a_preflight_error_that_names_it(tmp_path):
    cluster = _ghost_cluster(tmp_path)
    start = time.monotonic()
    with pytest.raises(PreflightError) as err:
        ray_cluster._ray_cli(cluster, cluster.nodes[0], ["start", "--head"])
    assert time.monotonic() - start < 30
    assert "node 'ghost' (127.0.0.2)" in str(err.value) and "unreachable" in str(err.value)
    assert err.value.exit_code == EXIT_PREFLIGHT


@pytest.mark.parametrize("token", [True, False])
def test_the_jobs_tunnel_to_an_unreachable_head_is_a_preflight_error_that_names_it(
    tmp_path, token: bool
):
    with pytest.raises(PreflightError) as err, api._tunnel(_ghost_cluster(tmp_path), token=token):
        pytest.fail("the tunnel opened")
    assert "cannot reach the head node ghost (127.0.0.2) over SSH" in str(err.value)
    assert "unreachable" in str(err.value)


def test_launch_down_yes_forgets_a_bootstrapped_cluster_whose_head_is_gone(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("LAUNCHER_STATE_DIR", str(tmp_path / "state"))
    cluster = _ghost_cluster(tmp_path)
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(cluster.model_dump(mode="json")))
    records.save_cluster(cluster)  # what a `launch submit` left: Ray started there, since gone

    assert main(["down", "--cluster", str(path)]) == EXIT_PREFLIGHT  # not unasked
    assert "does not answer" in capsys.readouterr().err
    assert records.saved_cluster(cluster) is not None
    assert main(["down", "--cluster", str(path), "--yes"]) == EXIT_PREFLIGHT
    out = capsys.readouterr()
    assert "could not reach ghost: Ray may still run there" in out.err and "Stopped" not in out.out
    assert records.saved_cluster(cluster) is None  # forgotten all the same
    assert main(["down", "--cluster", str(path)]) == 0
    assert "nothing to stop" in capsys.readouterr().out
