"""Starting Ray over SSH on a node that cannot be reached: a PreflightError naming the node (exit 3),
not a NodeError traceback, so a spare that fails this way is passed over and the first attempt's
nodes stop the launch with one paragraph."""

from __future__ import annotations

import socket
import time

import pytest

from launcher.errors import EXIT_PREFLIGHT, PreflightError
from launcher.orchestrate import ray_cluster
from launcher.spec import ClusterSpec


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections to it are refused
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


def test_an_unreachable_node_is_a_preflight_error_that_names_it(tmp_path):
    cluster = ClusterSpec.model_validate({
        "nodes": [{"name": "ghost", "host": "127.0.0.2", "port": _closed_port()}],
        "ssh": {"connect_timeout_s": 3, "known_hosts": str(tmp_path / "known_hosts")}})
    start = time.monotonic()
    with pytest.raises(PreflightError) as err:
        ray_cluster._ray_cli(cluster, cluster.nodes[0], ["start", "--head"])
    assert time.monotonic() - start < 30
    assert "node 'ghost' (127.0.0.2)" in str(err.value) and "unreachable" in str(err.value)
    assert err.value.exit_code == EXIT_PREFLIGHT
