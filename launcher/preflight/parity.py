"""Judge node probes: compare fields under per-field policies, run the other checks, and
render the fields × nodes table and the verdict. Pure.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from launcher.errors import PreflightError, SpecError
from launcher.preflight.network import Route, choose_routes, route_cell

FAIL_MARK = "✗"
WARN_MARK = "!"
MARKS = {"fail": FAIL_MARK, "warn": WARN_MARK}
LEGEND = f"{FAIL_MARK} differs from the other nodes or fails a check · {WARN_MARK} warning only"
CELL_WIDTH = 30
CLOCK_SKEW_WARN_S = 5.0
CUDNN_MIN_SPEEDUP = 1.1
# Minimum NVIDIA driver for the torch build's CUDA, by major.minor, else by major (NVIDIA's
# minor-version-compatibility floors).
MIN_DRIVER = {"11.0": "450.36.06", "11": "450.80.02", "12": "525.60.13", "13": "580.65.06"}
NOT_INSTALLED = "not installed"
POLICIES = ("exact", "minor", "major", "warn", "ignore")


@dataclass(frozen=True)
class FieldDef:
    """A row of the table: how to read it from a probe and how to compare it."""

    key: str
    label: str
    policy: str
    extract: Callable[[dict[str, Any]], Any]
    deep: bool = False


# What gets past a failed check; a mismatch (and any other check) can be relaxed instead.
CHECK_HINTS = {
    "gpus_needed": "lower resources.nproc_per_node, use nodes with enough GPUs, or train on "
    "the CPU (--set resources.device=cpu)",
    "launcher_importable": "install the launcher in the node's Python (nodes[].python names it)",
    "user_code_present": "put the workdir where the node sees it, or use entrypoint.sync: auto",
    "nccl_socket_ifname": "set NCCL_SOCKET_IFNAME to interfaces the nodes have, or leave it unset",
    "driver_min": "update the node's driver, or install a torch built for an older CUDA",
}
RELAX_HINT = (
    "relax a field's policy in cluster.yaml (parity.policies, e.g. {torch: warn}), or launch "
    "with --skip-parity"
)


@dataclass(frozen=True)
class Problem:
    node: str
    key: str
    severity: str  # "fail" | "warn"
    message: str


@dataclass
class Row:
    field: FieldDef
    policy: str
    values: dict[str, Any]  # node → value (reachable nodes)
    marks: dict[str, str] = dataclasses.field(default_factory=dict)  # node → "fail" | "warn"
    reference: Any = None


def _get(*path: str) -> Callable[[dict[str, Any]], Any]:
    """The value at ``path`` in a probe: None where a part is missing or failed on the node;
    a value that is itself a failure (``{"error": ...}``, e.g. NCCL's version where torch has
    no NCCL) becomes its text, so that the row shows it and compares it."""

    def extract(probe: dict[str, Any]) -> Any:
        value: Any = probe
        for part in path:
            if not isinstance(value, dict) or "error" in value:
                return None
            value = value.get(part)
        if isinstance(value, dict) and "error" in value:
            return f"error: {value['error']}"
        return value

    return extract


def _package(name: str) -> Callable[[dict[str, Any]], Any]:
    def extract(probe: dict[str, Any]) -> Any:
        packages = probe.get("packages")
        if not isinstance(packages, dict) or "error" in packages or name not in packages:
            return None
        return packages[name] if packages[name] is not None else NOT_INSTALLED

    return extract


def _gpu_models(probe: dict[str, Any]) -> str | None:
    gpus = _get("deep", "devices")(probe) or _get("nvidia", "gpus")(probe) or []
    return " + ".join(sorted({gpu["name"] for gpu in gpus})) or None


def _launcher_hash(probe: dict[str, Any]) -> str | None:
    digest = _get("launcher", "hash")(probe)
    return digest[:12] if digest else None


def _user_code(probe: dict[str, Any]) -> str | None:
    """The hash of the job's workdir (``entrypoint.sync: false``), or why there is none."""
    code = probe.get("user_code")
    if not isinstance(code, dict) or "error" in code:
        return None
    return code["code_hash"][:12] if code.get("exists") else "missing"


def _disk(probe: dict[str, Any]) -> str | None:
    free = _get("disk", "home", "free_gib")(probe)
    return f"{free:g} GiB" if isinstance(free, int | float) else None


def _skew(probe: dict[str, Any]) -> str | None:
    skew = probe.get("clock_skew_s")
    return f"{skew:+.2f} s" if isinstance(skew, int | float) else None


FIELDS: tuple[FieldDef, ...] = (
    FieldDef("hostname", "hostname", "ignore", _get("hostname")),
    FieldDef("os", "os", "ignore", _get("os", "distro")),
    FieldDef("kernel", "kernel", "ignore", _get("os", "kernel")),
    FieldDef("python", "python", "minor", _get("python", "version")),
    FieldDef("torch", "torch", "exact", _package("torch")),
    FieldDef("cuda", "cuda (torch build)", "exact", _get("torch_build", "cuda")),
    FieldDef("ray", "ray", "exact", _package("ray")),
    FieldDef("launcher", "launcher", "exact", _package("launcher")),
    FieldDef("launcher_hash", "launcher code", "exact", _launcher_hash),
    FieldDef("user_code", "user code (workdir)", "exact", _user_code),
    FieldDef("driver", "driver", "major", _get("nvidia", "driver")),
    FieldDef("gpu", "gpu model", "exact", _gpu_models),
    FieldDef("gpus", "gpus", "ignore", lambda p: gpu_count(p)),
    FieldDef(
        "cuda_available", "cuda available", "exact", _get("deep", "cuda_available"), deep=True
    ),
    FieldDef("cudnn", "cudnn", "exact", _get("deep", "cudnn", "version"), deep=True),
    FieldDef("nccl", "nccl", "exact", _get("deep", "nccl"), deep=True),
    FieldDef("route", "route to head", "ignore", route_cell),
    FieldDef("clock", "clock skew", "ignore", _skew),
    FieldDef("disk", "free disk (home)", "ignore", _disk),
)
# The checks besides the fields, with their default policy (cluster.yaml's parity.policies).
CHECKS = {
    "deep_probe": "exact",  # the deep (torch) probe ran
    "launcher_importable": "exact",  # with the node's python
    "user_code_present": "exact",  # the workdir and script exist on the node (sync: false)
    "cudnn_working": "exact",  # available, enabled, loaded and computing where CUDA is
    "cudnn_speedup": "exact",  # at least CUDNN_MIN_SPEEDUP x faster than native kernels
    "driver_min": "exact",  # the driver is new enough for torch's CUDA build
    "gpus_needed": "exact",  # the node has the GPUs the job (or cluster.yaml) asks for
    "nccl_socket_ifname": "exact",  # NCCL_SOCKET_IFNAME names an interface of the node
    "route_to_head": "exact",  # a route to the head that is not loopback
    "clock_skew": "warn",  # within CLOCK_SKEW_WARN_S of the launcher's clock
    "bytecode": "warn",  # torch compiled to bytecode, or Python may write it
}


# -- the report ----------------------------------------------------------------------------------


@dataclass
class PreflightReport:
    """Every node's probe (or error record), judged. See ``evaluate``."""

    probes: dict[str, dict[str, Any]]
    rows: list[Row]
    problems: list[Problem]
    deep: bool
    field_keys: frozenset[str] = frozenset()
    routes: dict[str, Route] = dataclasses.field(default_factory=dict)

    @property
    def nodes(self) -> list[str]:
        return list(self.probes)

    @property
    def errors(self) -> dict[str, dict[str, str]]:
        """Nodes that could not be probed → {kind, message}."""
        return {n: p["error"] for n, p in self.probes.items() if is_error_record(p)}

    @property
    def failures(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "fail"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warn"]

    @property
    def ok(self) -> bool:
        return not self.errors and not self.failures

    def gpus(self, node_name: str) -> int:
        """GPUs the node reported (what torch sees after a deep probe); 0 on CPU or failed nodes."""
        return gpu_count(self.probes[node_name])

    @property
    def bad_nodes(self) -> list[str]:
        bad = set(self.errors) | {p.node for p in self.failures}
        return [n for n in self.nodes if n in bad]

    @property
    def verdict(self) -> str:
        """One line: ``parity OK: 3 nodes agree`` or ``parity FAILED: <every bad node, why>``."""
        n = len(self.nodes)
        if self.ok:
            line = f"parity OK: {n} nodes agree" if n != 1 else "parity OK: 1 node checked"
            if self.warnings:
                warned = self._node_summaries(self.warnings, with_errors=False)
                line += f" (warnings: {'; '.join(warned)})"
            return line
        return "parity FAILED: " + "; ".join(self._node_summaries(self.failures, with_errors=True))

    def _node_summaries(self, problems: list[Problem], *, with_errors: bool) -> list[str]:
        out = []
        for node in self.nodes:
            if with_errors and node in self.errors:
                err = self.errors[node]
                out.append(f"{node} {err['kind']}: {err['message']}")
                continue
            mine = [p for p in problems if p.node == node]
            diffs = [p.message for p in mine if p.key in self.field_keys]
            checks = [p.message for p in mine if p.key not in self.field_keys]
            parts = (["differs in " + ", ".join(diffs)] if diffs else []) + checks
            if parts:
                out.append(f"{node}{'' if diffs else ':'} " + "; ".join(parts))
        return out

    def table(self) -> str:
        """The fields × nodes table (odd cells marked), a legend, and the verdict line."""
        headers = ["field", "policy", *self.nodes]
        body: list[list[str]] = []
        status = ["status", ""]
        for node in self.nodes:
            err = self.errors.get(node)
            status.append(_wrap(f"{FAIL_MARK} {err['kind']}: {err['message']}") if err else "ok")
        body.append(status)
        for row in self.rows:
            cells = [row.field.label, row.policy]
            for node in self.nodes:
                mark = f" {MARKS[row.marks[node]]}" if node in row.marks else ""
                cells.append(_wrap(_display(row.values[node]) + mark) if node in row.values else "")
            body.append(cells)
        checks = ["checks", ""]
        for node in self.nodes:
            mine = [p for p in self.problems if p.node == node and p.key not in self.field_keys]
            lines = "\n".join(_wrap(f"{MARKS[p.severity]} {p.message}") for p in mine) or "ok"
            checks.append("" if node in self.errors else lines)
        body.append(checks)
        return "\n".join([tabulate(body, headers=headers, tablefmt="simple"), LEGEND, self.verdict])

    def to_json(self) -> dict[str, Any]:
        """Everything in the table, machine-readable: cells carry ``value`` and ``mark``."""
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "deep": self.deep,
            "nodes": self.nodes,
            "errors": self.errors,
            "fields": [
                {
                    "field": row.field.key,
                    "label": row.field.label,
                    "policy": row.policy,
                    "reference": row.reference,
                    "cells": {
                        n: {"value": row.values[n], "mark": row.marks.get(n)} for n in row.values
                    },
                }
                for row in self.rows
            ],
            "problems": [p.__dict__ for p in self.problems],
            "probes": self.probes,
        }

    def save(self, directory: Path) -> None:
        """``directory/<node>.json`` per node and ``directory/parity.txt``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for node, probe in self.probes.items():
            (directory / f"{node}.json").write_text(
                json.dumps(probe, indent=2, sort_keys=True) + "\n"
            )
        (directory / "parity.txt").write_text(self.table() + "\n")

    def raise_for_failure(self) -> None:
        """Raise PreflightError (exit 3) naming every bad node, unless all is well."""
        if self.ok:
            return
        bad = self.bad_nodes
        raise PreflightError(
            f"Preflight failed on {len(bad)} of {len(self.nodes)} nodes ({', '.join(bad)}): "
            + "; ".join(self._node_summaries(self.failures, with_errors=True))
            + f". {self.hints()}; `launch check` shows the full table."
        )

    def hints(self) -> str:
        """What can get past this preflight's failures, for the failures it has."""
        hints = ["Fix those nodes"] if self.errors else []
        hints += [CHECK_HINTS.get(problem.key, RELAX_HINT) for problem in self.failures]
        text = "; or ".join(dict.fromkeys(hints)) or "Fix those nodes"
        return text[0].upper() + text[1:]


# -- evaluation -----------------------------------------------------------------------------------


def evaluate(
    probes: dict[str, dict[str, Any]],
    *,
    packages: Sequence[str] = (),
    policies: dict[str, str] | None = None,
    deep: bool = True,
) -> PreflightReport:
    """Compare the probes (node order = dict order, the head first) and run the checks."""
    resolved = resolve_policies(policies or {}, packages)
    fields = field_defs(packages)
    reachable = {n: p for n, p in probes.items() if not is_error_record(p)}
    rows: list[Row] = []
    problems: list[Problem] = []
    for fdef in fields:
        if fdef.deep and not deep:
            continue
        values = {n: fdef.extract(p) for n, p in reachable.items()}
        if all(v is None for v in values.values()):
            continue  # e.g. GPU rows on a CPU cluster: nothing to compare
        row = Row(fdef, resolved[fdef.key], values)
        _mark_row(row, problems)
        rows.append(row)
    for node, probe in reachable.items():
        problems.extend(_checks(node, probe, resolved, deep))
    routes, unrouted = choose_routes(probes, origin="preflight")
    if resolved["route_to_head"] != "ignore":
        severity = "warn" if resolved["route_to_head"] == "warn" else "fail"
        problems += [Problem(n, "route_to_head", severity, m) for n, m in unrouted.items()]
    order = {n: i for i, n in enumerate(probes)}
    problems.sort(key=lambda p: order[p.node])
    return PreflightReport(
        probes, rows, problems, deep, frozenset(f.key for f in fields), routes=routes
    )


def field_defs(packages: Sequence[str]) -> list[FieldDef]:
    """The built-in fields, then one exact field per listed package (core packages skipped)."""
    fields = list(FIELDS)
    known = {f.key for f in fields}
    for name in packages:
        if name not in known:
            fields.append(FieldDef(name, name, "exact", _package(name)))
            known.add(name)
    return fields


def resolve_policies(overrides: dict[str, str], packages: Sequence[str] = ()) -> dict[str, str]:
    """Defaults merged with cluster.yaml's ``parity.policies``; an unknown key is a SpecError
    (a kernel package this run does not check is not unknown)."""
    from launcher.spec.job import KERNEL_PACKAGES

    resolved = {f.key: f.policy for f in field_defs(packages)}
    resolved.update(CHECKS)
    for key, policy in overrides.items():
        if key not in resolved and key not in KERNEL_PACKAGES:
            close = difflib.get_close_matches(key, list(resolved), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SpecError(
                f"unknown field {key!r}.{hint} Known fields and checks: {', '.join(resolved)}",
                field="parity.policies",
            )
        if policy not in POLICIES:
            raise SpecError(
                f"{key}: {policy!r} is not a policy; use one of {', '.join(POLICIES)}",
                field="parity.policies",
            )
        if key in resolved:  # not a kernel package that this run leaves unchecked
            resolved[key] = policy
    return resolved


def version_key(value: Any, policy: str) -> Any:
    """What must be equal under ``policy``: the whole value, major.minor, or the major part."""
    if value is None or policy not in ("minor", "major"):
        return value
    parts = str(value).split("+")[0].split(".")
    return ".".join(parts[: 2 if policy == "minor" else 1])


def _mark_row(row: Row, problems: list[Problem]) -> None:
    if row.policy == "ignore" or len(row.values) < 2:
        return
    keys = {n: version_key(v, row.policy) for n, v in row.values.items()}
    counts = Counter(keys.values())
    # the most common key; where tied, the head's (max keeps the first, the head comes first)
    ref_key = max(keys.values(), key=counts.__getitem__)
    row.reference = next(row.values[n] for n, k in keys.items() if k == ref_key)
    severity = "warn" if row.policy == "warn" else "fail"
    for node, key in keys.items():
        if key != ref_key:
            row.marks[node] = severity
            shown = f"{_display(row.values[node])} vs {_display(row.reference)}"
            problems.append(Problem(node, row.field.key, severity, f"{row.field.label} ({shown})"))


def _checks(
    node: str, probe: dict[str, Any], policies: dict[str, str], deep: bool
) -> list[Problem]:
    problems: list[Problem] = []

    def found(key: str, message: str) -> None:
        policy = policies.get(key, "exact")
        if policy != "ignore":
            problems.append(Problem(node, key, "warn" if policy == "warn" else "fail", message))

    request = probe.get("request") or {}
    found_deep = probe.get("deep")
    dp: dict[str, Any] = found_deep if isinstance(found_deep, dict) else {}
    deep_ok = isinstance(found_deep, dict) and "error" not in dp
    if deep and not deep_ok:
        found("deep_probe", f"deep probe failed: {dp.get('error', 'no deep section in the probe')}")
    if probe.get("launcher") is None:
        python = _get("python", "executable")(probe) or "the node's python"
        found(
            "launcher_importable", f"the launcher is not importable with {python}; install it there"
        )
    code = probe.get("user_code")
    if isinstance(code, dict):
        if "error" in code:
            found("user_code_present", f"could not read the workdir: {code['error']}")
        elif not code.get("exists"):
            found(
                "user_code_present",
                f"workdir {code['workdir']} does not exist here; put the "
                f"code on the shared filesystem or use entrypoint.sync: auto",
            )
        elif code.get("script") and not code.get("script_exists"):
            found(
                "user_code_present",
                f"script {code['script']} is missing from {code['workdir']} here",
            )
    if deep_ok and dp.get("cuda_available"):
        for message in _cudnn_problems(dp):
            found("cudnn_working", message)
        speedup = (dp.get("conv") or {}).get("speedup")
        if isinstance(speedup, int | float) and speedup < CUDNN_MIN_SPEEDUP:
            found("cudnn_speedup", f"cuDNN gives no speed-up ({speedup:g}x over native kernels)")
    driver = _get("nvidia", "driver")(probe)
    cuda = (dp.get("cuda_build") if deep_ok else None) or _get("torch_build", "cuda")(probe)
    minimum = min_driver(cuda)
    if driver and minimum and _vtuple(driver) < _vtuple(minimum):
        found(
            "driver_min",
            f"driver {driver} is below {minimum}, the minimum for torch's CUDA {cuda}; "
            f"update the driver or use a torch built for an older CUDA",
        )
    needed = request.get("gpus_needed") or 0
    have = gpu_count(probe)
    if needed and have < needed and (deep_ok or not deep):
        found("gpus_needed", f"needs {needed} GPU{'s' if needed != 1 else ''}, has {have}")
    ifname = request.get("nccl_socket_ifname")
    interfaces = _get("interfaces")(probe)  # not a dict where the probe failed there
    if ifname and isinstance(interfaces, dict) and not nccl_ifname_matches(ifname, interfaces):
        found(
            "nccl_socket_ifname",
            f"NCCL_SOCKET_IFNAME={ifname} names no interface here (has {', '.join(sorted(interfaces))})",
        )
    skew = probe.get("clock_skew_s")
    if isinstance(skew, int | float) and abs(skew) > CLOCK_SKEW_WARN_S:
        found("clock_skew", f"clock is {skew:+.1f} s off the launcher's")
    code = probe.get("bytecode")
    if isinstance(code, dict) and code.get("cached") is False and code.get("writable") is False:
        python = _get("python", "executable")(probe) or "python"
        found(
            "bytecode",
            "torch has no compiled bytecode and Python may not write it "
            "(PYTHONDONTWRITEBYTECODE, or a read-only install): every process compiles "
            f"torch's source again, seconds per start; compile it once with "
            f"`{python} -m compileall -q -j 0 {code.get('site')}`",
        )
    return problems


def _cudnn_problems(dp: dict[str, Any]) -> list[str]:
    cudnn = dp.get("cudnn") or {}
    if not cudnn.get("available"):
        return ["CUDA works but cuDNN is not available to torch"]
    if not cudnn.get("enabled"):
        return ["cuDNN is disabled (torch.backends.cudnn.enabled is False)"]
    conv = dp.get("conv") or {}
    if "error" in conv:
        return [f"a cuDNN convolution failed: {conv['error']}"]
    out = []
    if not (dp.get("loaded_libs") or {}).get("libcudnn"):
        out.append("no libcudnn was loaded after a convolution")
    diff = conv.get("max_abs_diff")
    if isinstance(diff, int | float) and diff > 1e-2:
        out.append(f"cuDNN and native convolutions disagree (max abs diff {diff:g})")
    return out


# -- small pure helpers ------------------------------------------------------------------------


def is_error_record(probe: dict[str, Any]) -> bool:
    return isinstance(probe.get("error"), dict) and "kind" in probe["error"]


def error_record(node: str, host: str, kind: str, message: str) -> dict[str, Any]:
    """What ``probes`` holds for a node that could not be probed."""
    return {"node": node, "host": host, "error": {"kind": kind, "message": message}}


def gpu_count(probe: dict[str, Any]) -> int:
    """GPUs usable on the node: torch's count after a deep probe, else nvidia-smi's; 0 if unknown
    (an error record included)."""
    dp = probe.get("deep")
    if isinstance(dp, dict) and "error" not in dp:
        return int(dp.get("device_count") or 0)
    return len(_get("nvidia", "gpus")(probe) or [])


def min_driver(cuda: str | None) -> str | None:
    """The minimum driver for a CUDA version (``12.8`` → ``525.60.13``); None when unknown."""
    parts = str(cuda).split(".")
    return MIN_DRIVER.get(".".join(parts[:2])) or MIN_DRIVER.get(parts[0])


def nccl_ifname_matches(spec: str, interfaces: dict[str, Any]) -> bool:
    """NCCL_SOCKET_IFNAME semantics: comma-separated prefixes, ``=`` exact, ``^`` excludes."""
    exclude = spec.startswith("^")
    exact = spec.removeprefix("^").startswith("=")
    patterns = [p for p in spec.removeprefix("^").removeprefix("=").split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    if exclude:
        return any(not hit(name) for name in interfaces if name != "lo")
    return any(hit(name) for name in interfaces)


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int("".join(filter(str.isdigit, part)) or 0) for part in str(version).split("."))


def _display(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "—" if value is None else str(value)


def _wrap(text: str) -> str:
    return textwrap.fill(text, CELL_WIDTH, break_on_hyphens=False) or text
