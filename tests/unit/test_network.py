"""Choosing the workers' interface from each node's route to the head (pure), the plan's use
of it, and the rendezvous check's own sockets on this machine."""

from __future__ import annotations

import socket

import pytest
from fixtures.fake_launch import cpu_job

from launcher.orchestrate.plan import master_address, plan
from launcher.orchestrate.reach import Listener, reach
from launcher.preflight import NodeFacts
from launcher.preflight.network import Route, choose_routes, is_loopback, route_cell
from launcher.preflight.parity import evaluate
from launcher.preflight.probe import interface_of
from launcher.spec import ClusterSpec, JobSpec, NodeSpec
from launcher.util import free_port

IFACES_HEAD = {"lo": ["127.0.0.1"], "eth0": ["198.18.0.10"], "docker0": ["172.17.0.1"]}
IFACES_1 = {"lo": ["127.0.0.1"], "ens5": ["198.18.0.11"]}


def probe(route: dict, interfaces: dict) -> dict:
    return {"route": route, "interfaces": interfaces}


def head_probe(resolved: str = "127.0.1.1", address: str = "127.0.1.1") -> dict:
    """The head resolves its own name to Debian's 127.0.1.1: its route goes through lo."""
    route = {"to": "gpu01", "resolved": resolved, "address": address, "interface": "lo"}
    return probe(route, IFACES_HEAD)


def node_probe(resolved: str = "198.18.0.10") -> dict:
    route = {"to": "gpu01", "resolved": resolved, "address": "198.18.0.11", "interface": "ens5"}
    return probe(route, IFACES_1)


def test_the_head_binds_where_the_others_reach_it_not_where_its_name_resolves():
    routes, problems = choose_routes({"a": head_probe(), "b": node_probe()}, origin="preflight")
    assert problems == {}
    assert routes["a"].interface == "eth0" and routes["a"].address == "198.18.0.10"
    assert routes["b"].interface == "ens5" and routes["b"].address == "198.18.0.11"
    assert {r.master_ip for r in routes.values()} == {"198.18.0.10"}
    assert routes["a"].source.startswith("preflight: ") and routes["b"].head == "gpu01"


def test_a_node_that_resolves_the_head_to_loopback_is_named():
    routes, problems = choose_routes(
        {"a": head_probe(), "b": node_probe(resolved="127.0.1.1")}, origin="agent"
    )
    assert "b" in problems and "loopback" in problems["b"] and "address:" in problems["b"]


def test_a_route_error_and_a_head_holding_no_such_address_are_named():
    broken = probe({"to": "gpu01", "error": "gaierror: Name or service not known"}, IFACES_1)
    routes, problems = choose_routes({"a": head_probe(), "b": broken}, origin="preflight")
    assert "b" in problems and "Name or service not known" in problems["b"]
    # the head's view alone (the other failed) is loopback: no interface to choose there
    assert "a" not in routes

    elsewhere = {**node_probe(), "route": {**node_probe()["route"], "resolved": "203.0.113.5"}}
    routes, problems = choose_routes({"a": head_probe(), "b": elsewhere}, origin="preflight")
    assert "203.0.113.5" in problems["a"] and "GLOO_SOCKET_IFNAME" in problems["a"]


def test_nodes_without_a_route_section_are_left_out():
    assert choose_routes({"a": {"interfaces": IFACES_HEAD}}, origin="preflight") == ({}, {})


def test_loopback_and_cells():
    assert is_loopback("127.0.1.1") and is_loopback("::1")
    assert not is_loopback("198.18.0.10") and not is_loopback("gpu01") and not is_loopback(None)
    assert route_cell(node_probe()) == "ens5 198.18.0.11"
    assert route_cell({"route": {"error": "boom"}}) == "error: boom"
    assert route_cell({}) is None
    assert interface_of("198.18.0.10", IFACES_HEAD) == "eth0"
    assert interface_of("10.9.9.9", IFACES_HEAD) is None


def test_the_preflight_table_shows_the_route_and_fails_a_loopback_node():
    base = {"launcher": {"path": "/x", "hash": "h"}}
    probes = {
        "a": {"node": "a", **base, **head_probe()},
        "b": {"node": "b", **base, **node_probe("127.0.1.1")},
    }
    report = evaluate(probes, deep=False)
    assert not report.ok and "b" in report.bad_nodes
    assert "route to head" in report.table() and "ens5 198.18.0.11" in report.table()
    relaxed = evaluate(probes, deep=False, policies={"route_to_head": "warn"})
    assert relaxed.ok and relaxed.warnings


def cluster(head: dict | None = None) -> ClusterSpec:
    b = {"name": "b", "host": "gpu02", "env": {"NCCL_SOCKET_IFNAME": "ib0"}}
    return ClusterSpec.model_validate(
        {"nodes": [{"name": "a", "host": "gpu01", **(head or {})}, b]}
    )


def routed() -> dict[str, NodeFacts]:
    routes, _ = choose_routes({"a": head_probe(), "b": node_probe()}, origin="preflight")
    return {n: NodeFacts(gpus=0, route=r) for n, r in routes.items()}


def make(job_spec: JobSpec, spec: ClusterSpec, facts=None, **kw):
    return plan(job_spec, spec, facts, run_id="t-1", master_port=29400, launcher_env={}, **kw)


def test_the_plan_sets_gloo_interface_and_master_address_from_the_routes():
    p = make(cpu_job(), cluster(), routed())
    a, b = p.nodes
    assert a.env["GLOO_SOCKET_IFNAME"] == "eth0" and b.env["GLOO_SOCKET_IFNAME"] == "ens5"
    assert a.env_sources["GLOO_SOCKET_IFNAME"].startswith("preflight: ")
    assert "NCCL_SOCKET_IFNAME" not in a.env  # NCCL's own choice is left alone
    assert b.env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert p.master_addr == "198.18.0.10" and "--master-addr" in a.argv
    assert a.argv[a.argv.index("--master-addr") + 1] == "198.18.0.10"
    record = p.to_json()
    assert record["master_addr_source"] == "gpu01 as the other nodes resolve it"
    assert record["nodes"][1]["route"]["interface"] == "ens5"
    assert record["nodes"][1]["env_sources"]["GLOO_SOCKET_IFNAME"].startswith("preflight")


def test_what_the_user_set_wins():
    job = cpu_job({"env": {"GLOO_SOCKET_IFNAME": "bond0"}})
    p = make(job, cluster({"address": "10.1.1.1"}), routed())
    assert {n.env["GLOO_SOCKET_IFNAME"] for n in p.nodes} == {"bond0"}
    assert p.nodes[0].env_sources["GLOO_SOCKET_IFNAME"] != "preflight"
    assert p.master_addr == "10.1.1.1" and p.master_addr_source.startswith("cluster.yaml")


def test_one_node_and_no_routes_change_nothing():
    single = ClusterSpec.model_validate({"nodes": [{"name": "a", "host": "localhost"}]})
    p = make(cpu_job(), single, {"a": NodeFacts(gpus=0, route=routed()["a"].route)})
    assert "GLOO_SOCKET_IFNAME" not in p.nodes[0].env and p.master_addr == "localhost"
    p = make(cpu_job(), cluster())
    assert "GLOO_SOCKET_IFNAME" not in p.nodes[0].env and p.master_addr == "gpu01"


def test_master_address_keeps_an_ip_host():
    route = Route("eth0", "10.0.0.1", "10.9.9.9", "preflight: x", "10.0.0.1")
    expected = ("10.0.0.1", "cluster.yaml (the head's host)")
    assert master_address(NodeSpec(name="a", host="10.0.0.1"), {"a": route}) == expected


@pytest.mark.processes  # `ip -j addr`
def test_reach_connects_to_a_listener_and_names_what_fails():
    port = free_port()
    listener = Listener(port)
    try:
        assert reach("127.0.0.1", port, None, 2.0) is None
        assert reach("127.0.0.1", port, "lo", 2.0) is None
        missing = reach("127.0.0.1", port, "nosuch9", 2.0)
        assert missing and "GLOO_SOCKET_IFNAME=nosuch9 names no interface" in missing
    finally:
        listener.close()
    loopback = reach("198.18.0.10", port, "lo", 2.0)
    assert loopback and "GLOO_SOCKET_IFNAME=lo: lo (127.0.0.1) is loopback" in loopback
    refused = reach("127.0.0.1", port, "lo", 2.0)
    assert refused and f"127.0.0.1:{port} from lo (127.0.0.1)" in refused
    # the port is free again for torchrun's store once the check is over
    with socket.socket() as again:
        again.bind(("", port))


@pytest.mark.parametrize("spec", ["", "   "])
def test_reach_without_a_named_interface_uses_the_kernels_route(spec):
    port = free_port()
    listener = Listener(port)
    try:
        assert reach("127.0.0.1", port, spec or None, 2.0) is None
    finally:
        listener.close()
