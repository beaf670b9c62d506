"""~/.ssh/config read as OpenSSH does: aliases, Include, ProxyJump hops, precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.errors import SpecError
from launcher.remote import NodeError, tunnel_needed
from launcher.remote.route import route_to
from launcher.spec import load_cluster
from launcher.spec.cluster import NodeSpec, SSHSpec
from launcher.spec.sshconfig import lookup, parse_jump

CONFIG = """
Host login
  HostName 10.0.0.1
  User alice
  Port 2200
  IdentityFile ~/keys/login
  UserKnownHostsFile ~/kh/a ~/kh/b

Host gpu-*
  ProxyJump login
  User bob
  IdentityFile ~/keys/gpu

Host gpu-1
  HostName 10.1.0.11

Include conf.d/*.conf
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh/conf.d").mkdir(parents=True)
    (tmp_path / ".ssh/config").write_text(CONFIG)
    (tmp_path / ".ssh/conf.d/x.conf").write_text("Host bastion2\n  HostName 10.9.9.9\n")
    return tmp_path


def test_lookup_reads_blocks_first_value_wins_and_includes(home: Path) -> None:
    found = lookup("gpu-1", home / ".ssh/config")
    assert found.hostname == "10.1.0.11" and found.user == "bob" and found.port is None
    assert found.identity_files == (home / "keys/gpu",)
    assert found.proxy_jump == ("login",)
    login = lookup("login", Path("~/.ssh/config"))
    assert login.port == 2200 and login.known_hosts == (home / "kh/a", home / "kh/b")
    assert lookup("bastion2", home / ".ssh/config").hostname == "10.9.9.9"
    assert lookup("other", home / ".ssh/config").hostname == "other"
    assert lookup("other", None).proxy_jump == ()


def test_parse_jump_forms() -> None:
    assert parse_jump("login") == (None, "login", None)
    assert parse_jump("u@login:2222") == ("u", "login", 2222)
    assert parse_jump("ssh://u@[fe80::1]:22") == ("u", "fe80::1", 22)
    with pytest.raises(SpecError):
        parse_jump("login:ssh")


def test_route_merges_the_cluster_file_over_the_config(home: Path) -> None:
    ssh = SSHSpec()
    route = route_to(NodeSpec(name="g", host="gpu-1"), ssh)
    assert route.node.host == "10.1.0.11" and route.node.user == "bob" and route.node.port == 22
    [login] = route.jumps
    assert (login.name, login.host, login.port, login.user) == ("login", "10.0.0.1", 2200, "alice")
    assert login.known_hosts == (home / "kh/a", home / "kh/b")
    assert route.indirect and tunnel_needed(NodeSpec(name="g", host="gpu-1"), ssh)
    # What the cluster file sets wins: user, port and known_hosts.
    explicit = route_to(
        NodeSpec(name="g", host="gpu-1", port=2022, user="carol"),
        SSHSpec(known_hosts=home / "kh/mine"),
    )
    assert (explicit.node.port, explicit.node.user) == (2022, "carol")
    assert explicit.node.known_hosts == (home / "kh/mine",)
    # No config at all: the host as it is.
    bare = route_to(NodeSpec(name="g", host="gpu-1"), SSHSpec(config=None))
    assert bare.node.host == "gpu-1" and not bare.indirect


def test_a_proxyjump_loop_is_an_error(home: Path) -> None:
    (home / ".ssh/config").write_text("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n")
    with pytest.raises(NodeError, match="loops"):
        route_to(NodeSpec(name="a", host="a"), SSHSpec())


def test_loading_a_cluster_sets_each_alias_address(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    nodes = "- {name: a, host: gpu-1}\n- {name: b, host: gpu-2, address: 10.1.0.12}\n"
    path.write_text(f"nodes:\n{nodes}")
    cluster = load_cluster(path)
    assert [n.net_address for n in cluster.nodes] == ["10.1.0.11", "10.1.0.12"]
    assert cluster.nodes[0].host == "gpu-1"  # SSH still goes by the alias


def test_a_config_that_cannot_be_parsed_names_the_file(home: Path) -> None:
    (home / ".ssh/config").write_text("Host a\n  HostName\n")
    with pytest.raises(SpecError, match=r"\.ssh/config"):
        lookup("a", home / ".ssh/config")
