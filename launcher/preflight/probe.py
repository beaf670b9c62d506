"""The node probe: what this machine has, as one JSON document on stdout.

Self-contained: the launcher sends this file to each node and runs it with the node's own
interpreter, so it imports only the standard library (and torch in ``--deep``).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CORE_PACKAGES = ("torch", "ray", "launcher")
LOADED_LIB_PREFIXES = ("libcudnn", "libnccl", "libcudart")
NVIDIA_SMI_FIELDS = ("index", "name", "driver_version", "memory.total", "uuid", "pci.bus_id")
COMMAND_TIMEOUT_S = 15.0
TORCH_BUILD_NAMES = ("__version__", "cuda", "hip", "git_version")  # read from torch/version.py
# What counts as code when the user's working directory is hashed: sources and configs (.json and
# .yaml included); other files, data among them, are not read.
SOURCE_SUFFIXES = (".py", ".pyi", ".pyx", ".pxd", ".sh", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp")
CODE_SUFFIXES = (*SOURCE_SUFFIXES, ".yaml", ".yml", ".toml", ".json", ".cfg", ".ini")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe", description="This node's environment as JSON.")
    add = parser.add_argument
    add("--deep", action="store_true", help="also import torch and exercise CUDA/cuDNN/NCCL")
    add("--packages", default="", help="comma-separated extra packages to report versions of")
    add("--deep-timeout", type=float, default=120.0, help="seconds the deep part may take")
    add("--gpus-needed", type=int, default=0, help="GPUs the job needs on this node (recorded)")
    add("--nccl-socket-ifname", help="the workers' NCCL_SOCKET_IFNAME (recorded)")
    add("--route-to", help="the head's address: report the route to it")
    add("--workdir", help="the user's working directory: report and hash it")
    add("--script", help="the user's script, relative to --workdir")
    add("--exclude", default="[]", help="gitignore-style patterns (JSON) left out of the hash")
    args = parser.parse_args(argv)
    started = time.monotonic()
    packages = [p.strip() for p in args.packages.split(",") if p.strip()]

    report: dict[str, Any] = {
        "request": {
            "deep": args.deep,
            "packages": packages,
            "gpus_needed": args.gpus_needed,
            "nccl_socket_ifname": args.nccl_socket_ifname,
            "route_to": args.route_to,
        },
    }
    report["hostname"] = _safe(socket.gethostname)
    report["os"] = _safe(os_info)
    report["python"] = _safe(python_info)
    report["packages"] = _safe(lambda: package_versions([*CORE_PACKAGES, *packages]))
    report["launcher"] = _safe(launcher_info)
    report["torch_build"] = _safe(torch_build)
    report["bytecode"] = _safe(torch_bytecode)
    report["nvidia"] = _safe(nvidia_info)
    report["interfaces"] = _safe(interfaces)
    report["disk"] = _safe(disk_free)
    if args.route_to:
        report["route"] = _safe(lambda: route_to(args.route_to))
    if args.workdir:
        patterns = json.loads(args.exclude)
        report["user_code"] = _safe(
            lambda: user_code_info(Path(args.workdir), args.script, patterns)
        )
    report["deep"] = run_with_timeout(deep_info, args.deep_timeout) if args.deep else None
    report["elapsed_s"] = round(time.monotonic() - started, 3)
    report["time"] = time.time()  # last, so the launcher can measure clock skew on receipt
    print(json.dumps(report, sort_keys=True), flush=True)
    return 0


# -- torch-free facts ------------------------------------------------------------------------


def os_info() -> dict[str, Any]:
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        pretty = None
    return {
        "system": platform.system(),
        "kernel": platform.release(),
        "distro": pretty,
        "machine": platform.machine(),
    }


def python_info() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "venv": sys.prefix != sys.base_prefix,
    }


def package_versions(names: list[str]) -> dict[str, str | None]:
    """Installed distribution versions; None where not installed. Nothing is imported."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def launcher_info() -> dict[str, Any] | None:
    """Where ``import launcher`` would load from and a hash of its .py files (without importing
    it). ``python -`` puts the current folder first on ``sys.path``: that entry is left out."""
    saved = sys.path[:]
    if sys.path and sys.path[0] == "":  # the current directory that ``python -`` put first
        del sys.path[0]
    try:
        spec = importlib.util.find_spec("launcher")
    finally:
        sys.path[:] = saved
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        return None
    root = Path(spec.origin).parent
    return {"path": str(root), "hash": tree_hash(root)}


def torch_build() -> dict[str, Any] | None:
    """torch's build facts (CUDA version) read from torch/version.py without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    out: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in TORCH_BUILD_NAMES:
                    out[target.id.strip("_")] = node.value.value
    return out


def torch_bytecode() -> dict[str, Any] | None:
    """Whether Python finds torch compiled to bytecode, or may write it on the first import."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    cached = Path(importlib.util.cache_from_source(spec.origin))
    folder = next(p for p in cached.parents if p.exists())  # where Python would write it
    return {
        "site": str(Path(spec.origin).parents[1]),
        "cached": cached.is_file(),
        "writable": not sys.dont_write_bytecode and os.access(folder, os.W_OK),
    }


def tree_hash(root: Path) -> str:
    """``files_hash`` of every .py file under ``root``."""
    files = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    return files_hash(root, [p.relative_to(root).as_posix() for p in files])


def user_code_info(workdir: Path, script: str | None, exclude: list[str]) -> dict[str, Any]:
    """Whether the workdir and script exist here, and the hash of the workdir's code files."""
    out: dict[str, Any] = {"workdir": str(workdir), "exists": workdir.is_dir(), "script": script}
    if script is not None:
        out["script_exists"] = (workdir / script).is_file()
    if out["exists"]:
        code = [rel for rel, _ in walk_tree(workdir, exclude) if rel.endswith(CODE_SUFFIXES)]
        out["code_files"] = len(code)
        out["code_hash"] = files_hash(workdir, code)
    return out


def walk_tree(root: Path, exclude: list[str]) -> list[tuple[str, int]]:
    """(relative POSIX path, size) of every file under ``root`` that ``exclude`` keeps, sorted;
    links to folders are not followed."""
    excluded = exclude_matcher(exclude)
    out: list[tuple[str, int]] = []
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root).as_posix()
        prefix = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = sorted(d for d in dirs if not excluded(prefix + d, True))
        for name in files:
            rel = prefix + name
            path = Path(folder) / name
            if excluded(rel, False) or not path.is_file():
                continue
            out.append((rel, path.stat().st_size))
    return sorted(out)


def files_hash(root: Path, relpaths: list[str]) -> str:
    """sha256 over the given files' relative paths and contents, in sorted order."""
    digest = hashlib.sha256()
    for rel in sorted(relpaths):
        digest.update(rel.encode() + b"\0")
        digest.update((root / rel).read_bytes() + b"\0")
    return digest.hexdigest()


def exclude_matcher(patterns: list[str]) -> Callable[[str, bool], bool]:
    """``excluded(relative_posix_path, is_dir)`` for gitignore-style ``patterns``, as
    docs/running.md ("Excludes") describes them."""
    compiled = []
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        body = pattern.rstrip("/")
        anchored = "/" in body
        regex = _glob_regex(body.lstrip("/"))
        compiled.append((re.compile(("^" if anchored else "^(?:.*/)?") + regex + "$"), dir_only))

    def excluded(rel: str, is_dir: bool) -> bool:
        return any(rx.match(rel) and (is_dir or not dir_only) for rx, dir_only in compiled)

    return excluded


# A glob's wildcards as regexes, the longest first: ``**`` crosses folders, ``*`` and ``?`` do not.
GLOB_REGEX = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}


def _glob_regex(glob: str) -> str:
    out, i = [], 0
    while i < len(glob):
        token = next((t for t in GLOB_REGEX if glob.startswith(t, i)), None)
        if token is not None:
            out.append(GLOB_REGEX[token])
            i += len(token)
        elif glob[i] == "[" and "]" in glob[i + 1 :]:
            end = glob.index("]", i + 1)
            inner = re.sub("^!", "^", glob[i + 1 : end])  # [!ab]: not a or b
            out.append("[" + inner.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return "".join(out)


def nvidia_info() -> dict[str, Any]:
    """Driver version and GPUs from nvidia-smi, else NVML; empty on machines without NVIDIA GPUs."""
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"]
        proc = subprocess.run(query, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit {proc.returncode}"]
            return {"source": "nvidia-smi", "driver": None, "gpus": [], "error": tail[-1]}
        rows = [
            dict(zip(NVIDIA_SMI_FIELDS, (c.strip() for c in line.split(",")), strict=False))
            for line in proc.stdout.strip().splitlines()
        ]
        gpus = [
            {
                "index": int(row["index"]),
                "name": row["name"],
                "memory_mib": _to_int(row.get("memory.total")),
                "uuid": row.get("uuid"),
                "bus_id": row.get("pci.bus_id"),
            }
            for row in rows
        ]
        driver = rows[0].get("driver_version") if rows else None
        return {"source": "nvidia-smi", "driver": driver, "gpus": gpus}
    return _nvml_info()


def _nvml_info() -> dict[str, Any]:
    none: dict[str, Any] = {"source": None, "driver": None, "gpus": []}  # a CPU machine
    # No NVIDIA kernel driver loaded, or no nvidia-ml-py (optional) to ask it.
    if not os.path.exists("/proc/driver/nvidia") or importlib.util.find_spec("pynvml") is None:
        return none
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return none
    except pynvml.NVMLError as err:
        return {"source": "nvml", "driver": None, "gpus": [], "error": str(err)}
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                {
                    "index": i,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20,
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "bus_id": _text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                }
            )
        return {"source": "nvml", "driver": driver, "gpus": gpus}
    finally:
        pynvml.nvmlShutdown()


def interfaces() -> dict[str, list[str]]:
    """Interface name → IPv4 addresses, from ``ip -j addr`` or, without iproute2, ioctls."""
    ip = shutil.which("ip")
    if ip:
        proc = subprocess.run(
            [ip, "-j", "addr"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
        if proc.returncode == 0 and proc.stdout.strip():
            out: dict[str, list[str]] = {}
            for link in json.loads(proc.stdout):
                addrs = [a["local"] for a in link.get("addr_info", []) if a.get("family") == "inet"]
                out[link["ifname"]] = addrs
            return out
    return _interfaces_ioctl()


def _interfaces_ioctl() -> dict[str, list[str]]:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15])
                )
                out[name] = [socket.inet_ntoa(packed[20:24])]
            except OSError:
                out[name] = []
    return out


def route_to(host: str) -> dict[str, Any]:
    """The interface and address through which this machine reaches ``host`` (IPv4): the source
    address the kernel picks for a UDP socket connected there (nothing is sent)."""
    resolved = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((resolved, 9))
        address = sock.getsockname()[0]
    return {
        "to": host,
        "resolved": resolved,
        "address": address,
        "interface": interface_of(address, interfaces()),
    }


def interface_of(address: str, found: dict[str, list[str]]) -> str | None:
    """The interface that holds ``address`` (``interfaces()``'s map), or None."""
    return next((name for name, addrs in found.items() if address in addrs), None)


def disk_free() -> dict[str, Any]:
    return {
        label: {"path": path, "free_gib": round(shutil.disk_usage(path).free / 2**30, 1)}
        for label, path in (("home", os.path.expanduser("~")), ("tmp", tempfile.gettempdir()))
    }


# -- the deep part (torch) ---------------------------------------------------------------------


def deep_info(progress: dict[str, str]) -> dict[str, Any]:
    """CUDA, cuDNN and NCCL as this interpreter's torch really sees them."""
    progress["stage"] = "import torch"
    started = time.monotonic()
    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "import_s": round(time.monotonic() - started, 2),
    }
    progress["stage"] = "CUDA initialisation"
    available = torch.cuda.is_available()
    out["cuda_available"] = available
    out["device_count"] = torch.cuda.device_count() if available else 0
    props = [torch.cuda.get_device_properties(i) for i in range(out["device_count"])]
    out["devices"] = [
        {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1),
        }
        for p in props
    ]
    progress["stage"] = "cuDNN"
    cudnn_available = torch.backends.cudnn.is_available()
    out["cudnn"] = {
        "available": cudnn_available,
        "enabled": torch.backends.cudnn.enabled,
        "version": _version_int(torch.backends.cudnn.version()) if cudnn_available else None,
    }
    out["conv"] = _safe(lambda: _time_conv(torch)) if available else None
    progress["stage"] = "NCCL"
    out["nccl"] = (
        _safe(lambda: ".".join(str(v) for v in torch.cuda.nccl.version())) if available else None
    )
    out["loaded_libs"] = loaded_libraries()
    return out


def _time_conv(torch: Any) -> dict[str, Any]:
    """One 3x3 convolution, timed with cuDNN and with PyTorch's native kernels (fp32, no TF32)."""
    x = torch.randn(16, 64, 56, 56, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda")

    def timed(enabled: bool) -> tuple[float, Any]:
        with torch.backends.cudnn.flags(
            enabled=enabled, benchmark=False, deterministic=False, allow_tf32=False
        ):
            for _ in range(3):
                y = torch.nn.functional.conv2d(x, w, padding=1)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                y = torch.nn.functional.conv2d(x, w, padding=1)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / 10, y

    cudnn_s, y_cudnn = timed(True)
    native_s, y_native = timed(False)
    return {
        "shape": "16x64x56x56 * 64x64x3x3",
        "cudnn_ms": round(cudnn_s * 1e3, 3),
        "native_ms": round(native_s * 1e3, 3),
        "speedup": round(native_s / cudnn_s, 2) if cudnn_s > 0 else None,
        "max_abs_diff": float((y_cudnn - y_native).abs().max()),
    }


def loaded_libraries() -> dict[str, list[str]]:
    """The libcudnn/libnccl/libcudart files mapped into this process (from /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    # address perms offset dev inode [path]: the last field, where there are six
    paths = {fields[5] for line in maps.splitlines() if len(fields := line.split(maxsplit=5)) == 6}
    return {
        prefix: sorted(p for p in paths if os.path.basename(p).startswith(prefix))
        for prefix in LOADED_LIB_PREFIXES
    }


def run_with_timeout(
    fn: Callable[[dict[str, str]], dict[str, Any]], timeout_s: float
) -> dict[str, Any]:
    """Run ``fn`` in a daemon thread; after ``timeout_s`` report where it was stuck instead."""
    progress = {"stage": "start"}
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(progress)
        except BaseException as err:  # noqa: BLE001 - any failure becomes part of the report
            result["value"] = {"error": f"{type(err).__name__}: {err}", "stage": progress["stage"]}

    thread = threading.Thread(target=target, name="deep-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return {
            "error": f"timed out after {timeout_s:g} s during {progress['stage']}",
            "stage": progress["stage"],
        }
    return result["value"]


# -- helpers -----------------------------------------------------------------------------------


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one broken section must not lose the others
        return {"error": f"{type(err).__name__}: {err}"}


def _version_int(v: int | None) -> str | None:
    """cuDNN's integer version (90100, or 8902 before 9) as ``major.minor.patch``."""
    if v is None:
        return None
    if v >= 90000:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def _to_int(text: str | None) -> int | None:
    try:
        return int(float(text)) if text is not None else None
    except ValueError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


if __name__ == "__main__":
    code = main()
    # A deep-probe thread stuck in a driver call must not keep the process alive.
    os._exit(code)
