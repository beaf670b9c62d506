"""Which interface each node's workers talk on, chosen from each node's route to the head
(docs/clusters.md, "The network the workers use"). Pure: it reads the probes."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from launcher.preflight.probe import interface_of


@dataclass(frozen=True)
class Route:
    """Where a node's workers bind: ``interface`` and its ``address``, and why (``source``)."""

    interface: str
    address: str
    master_ip: str  # the head's address as the other nodes reach it
    source: str
    head: str  # the head's name or address that was routed to

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def is_loopback(address: str | None) -> bool:
    """True for 127.0.0.0/8 and ::1 (Debian's 127.0.1.1 included); False for a name or None."""
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def route_cell(probe: Mapping[str, Any]) -> str | None:
    """The preflight table's cell: ``eth0 198.18.0.11``, or the route's error."""
    route = probe.get("route")
    if not isinstance(route, dict):
        return None
    if "error" in route:
        return f"error: {route['error']}"
    return f"{route.get('interface') or '?'} {route.get('address')}"


def choose_routes(
    probes: Mapping[str, Mapping[str, Any]], *, origin: str
) -> tuple[dict[str, Route], dict[str, str]]:
    """Each node's interface towards the head, and the nodes for which none fits (→ why).
    ``probes`` holds each node's ``route`` and ``interfaces``, the head first; the head binds
    where the first other node reaches it, every other node on its route there."""
    routed = {n: p for n, p in probes.items() if isinstance(p.get("route"), dict)}
    if not routed:
        return {}, {}
    head = next(iter(probes))
    problems: dict[str, str] = {}
    for node, probe in routed.items():
        route = probe["route"]
        if "error" in route:
            problems[node] = f"no route to the head ({route.get('to', '?')}): {route['error']}"
        elif node != head and is_loopback(route.get("resolved")):
            problems[node] = (
                f"the head's name {route.get('to')} resolves to {route['resolved']} (loopback) "
                "here; set the head's address: in cluster.yaml to an address the nodes reach it on"
            )
    # The head's address as the first other node resolves it, else as the head itself does.
    resolved = {n: p["route"].get("resolved") for n, p in routed.items() if n not in problems}
    own = resolved.pop(head, None)
    master_ip = next((a for a in resolved.values() if a), own)
    if not master_ip:
        return {}, problems
    routes: dict[str, Route] = {}
    for node, probe in routed.items():
        if node in problems:
            continue
        route = probe["route"]
        if node == head:
            holder = _holder(master_ip, probe.get("interfaces"))
            if holder is not None:
                why = f"{origin}: the head's interface holding {master_ip}"
                routes[node] = Route(holder, master_ip, master_ip, why, route.get("to", ""))
                continue
            if len(routed) > 1 and is_loopback(route.get("address")):
                problems[node] = (
                    f"no interface here holds {master_ip}, the address the other nodes reach "
                    f"the head on; set GLOO_SOCKET_IFNAME in the head's env"
                )
                continue
        if not route.get("interface"):
            problems[node] = f"no interface holds {route.get('address')}, the route's address"
            continue
        why = f"{origin}: the route from {node} to {master_ip}"
        routes[node] = Route(
            route["interface"], route["address"], master_ip, why, route.get("to", "")
        )
    return routes, problems


def _holder(address: str, interfaces: Any) -> str | None:
    if not isinstance(interfaces, dict) or "error" in interfaces:
        return None
    return interface_of(address, {n: a for n, a in interfaces.items() if isinstance(a, list)})
