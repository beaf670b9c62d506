"""The blocks' weight gradients as one batched product per linear, at the end of the backward:
an inductor post-grad pass and a cuBLAS pointer-array batched op.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from collections import defaultdict
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

# cuBLAS's enums (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_DATA_TYPE = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT
_ALIGN = 16  # bytes, what the tensor-core kernels read


@torch.library.custom_op("launcher::batched_wgrad", mutates_args=())
def batched_wgrad(dys: list[torch.Tensor], xs: list[torch.Tensor]) -> torch.Tensor:
    """``out[i] = dys[i]ᵀ · xs[i]`` for every i: dys[i] (tokens, n), xs[i] (tokens, k), all of
    one shape and dtype; returns (len(dys), n, k) in that dtype."""
    out = _empty_stack(dys, xs)
    if not _cublas_batched(dys, xs, out):
        for i, (dy, x) in enumerate(zip(dys, xs, strict=True)):
            torch.mm(dy.t(), x, out=out[i])
    return out


@batched_wgrad.register_fake
def _(dys, xs):
    return _empty_stack(dys, xs)


def _arg(node: torch.fx.Node, i: int) -> torch.fx.Node:
    """The ``i``-th argument of a node the pass matched, which is a node."""
    arg = node.args[i]
    assert isinstance(arg, torch.fx.Node)
    return arg


def _empty_stack(dys: list[torch.Tensor], xs: list[torch.Tensor]) -> torch.Tensor:
    """The op's output, unfilled: (len(dys), n, k) in dys' dtype, on their device."""
    return dys[0].new_empty((len(dys), dys[0].shape[1], xs[0].shape[1]))


def _row_major(ts: list[torch.Tensor]) -> int | None:
    """The one leading dimension of these 2-D row-major tensors, or None where they differ,
    one is not row-major (rows at least as long as the tensor is wide), or one is not aligned
    for cuBLAS's tensor-core kernels."""
    lds = {t.stride(0) for t in ts}
    if len(lds) != 1 or any(t.stride(1) != 1 or t.data_ptr() % _ALIGN for t in ts):
        return None
    ld = lds.pop()
    return ld if ld >= ts[0].shape[1] and ld * ts[0].element_size() % _ALIGN == 0 else None


def _cublas_batched(dys: list[torch.Tensor], xs: list[torch.Tensor], out: torch.Tensor) -> bool:
    """One ``cublasGemmBatchedEx`` call for every product, or False where it does not apply."""
    if (
        not out.is_cuda
        or out.dtype not in _DATA_TYPE
        or out.data_ptr() % _ALIGN
        or {(t.dtype, t.device) for t in (*dys, *xs)} != {(out.dtype, out.device)}
        or len({t.shape for t in dys}) != 1
        or len({t.shape for t in xs}) != 1
    ):
        return False
    ld_dy, ld_x = _row_major(dys), _row_major(xs)
    if ld_dy is None or ld_x is None or (lib := _cublas()) is None:
        return False
    tokens, n = dys[0].shape
    k = xs[0].shape[1]
    count = len(dys)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    kind = _DATA_TYPE[out.dtype]
    with torch.cuda.device(out.device):  # the handle, the stream and the table: the tensors' GPU
        table = _pointer_table([t.data_ptr() for t in (*xs, *dys, *out.unbind(0))], out.device)
        step = table.element_size() * count
        # Column-major, as cuBLAS sees row-major memory: out[i]ᵀ (k × n, ld k) = xs[i]ᵀ (k ×
        # tokens, ld ld_x, as it lies) · dys[i] (n × tokens, ld ld_dy, transposed).
        status = lib.cublasGemmBatchedEx(
            torch.cuda.current_blas_handle(),
            _OP_N,
            _OP_T,
            k,
            n,
            tokens,
            ctypes.byref(one),
            table.data_ptr(),
            kind,
            ld_x,
            table.data_ptr() + step,
            kind,
            ld_dy,
            ctypes.byref(zero),
            table.data_ptr() + 2 * step,
            kind,
            k,
            count,
            _COMPUTE_32F,
            _GEMM_DEFAULT,
        )
    if status != 0:
        raise RuntimeError(f"cublasGemmBatchedEx failed with cuBLAS status {status}")
    return True


def _pointer_table(pointers: list[int], device: torch.device) -> torch.Tensor:
    """The pointers in device memory, written by kernels that carry them as arguments: a CUDA
    graph that captures this replays the same values, and nothing waits on the host."""
    table = torch.zeros(len(pointers), dtype=torch.int64, device=device)
    torch._foreach_add_(list(table.unbind(0)), pointers)
    return table


@functools.cache
def _cublas() -> ctypes.CDLL | None:
    """The cuBLAS library torch has loaded (found in this process's memory map), with
    ``cublasGemmBatchedEx``'s signature; None where there is none, or more than one copy (the
    handle is torch's, so the library must be torch's)."""
    torch.cuda.current_blas_handle()  # loads cuBLAS
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
    except OSError:
        return None
    if len(paths) != 1:
        return None
    lib = ctypes.CDLL(paths.pop())
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.cublasGemmBatchedEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i, i]
    lib.cublasGemmBatchedEx.restype = i
    return lib


class WeightGradBatching(CustomGraphPass):
    """Inductor's post-grad pass that batches the weight gradients (module docstring).

    ``groups`` counts the groups rewritten over the graphs it has seen (a test's handle)."""

    def __init__(self) -> None:
        self.groups = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        output = next(n for n in graph.nodes if n.op == "output")
        found: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if (key := _weight_grad_key(node, output)) is not None:
                found[key].append(node)
        for nodes in found.values():
            if len(nodes) < 2:
                continue
            with graph.inserting_before(output):
                dys = [_arg(_arg(node, 0), 0) for node in nodes]
                xs = [_arg(node, 1) for node in nodes]
                stacked = graph.call_function(torch.ops.launcher.batched_wgrad.default, (dys, xs))
                stacked.meta["val"] = _empty_stack(
                    [n.meta["val"] for n in dys], [n.meta["val"] for n in xs]
                )
                for i, node in enumerate(nodes):
                    picked = graph.call_function(aten.select.int, (stacked, 0, i))
                    picked.meta["val"] = node.meta["val"]
                    node.replace_all_uses_with(picked)
            for node in nodes:
                transposed = _arg(node, 0)
                graph.erase_node(node)
                if not transposed.users:
                    graph.erase_node(transposed)
            self.groups += 1

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


def _weight_grad_key(node: torch.fx.Node, output: torch.fx.Node) -> tuple | None:
    """(shapes, dtype) of ``node`` where it is mm(dYᵀ, X) in bf16 or fp16, with dY and X 2-D,
    whose only user is the graph's output; else None."""
    if node.target is not aten.mm.default or set(node.users) != {output}:
        return None
    transposed, x = node.args
    if (
        not isinstance(transposed, torch.fx.Node)
        or transposed.target is not aten.permute.default
        or not isinstance(perm := transposed.args[1], list | tuple)
        or list(perm) != [1, 0]
        or not isinstance(x, torch.fx.Node)
        or not isinstance(dy := transposed.args[0], torch.fx.Node)
    ):
        return None
    found = [n.meta.get("val") for n in (dy, x, node)]
    vals = [v for v in found if isinstance(v, torch.Tensor) and v.dim() == 2]
    if len(vals) < 3 or not all(isinstance(d, int) for v in vals for d in v.shape):
        return None  # static shapes only
    if {v.dtype for v in vals} != {vals[2].dtype} or vals[2].dtype not in _DATA_TYPE:
        return None
    return tuple(vals[0].shape), tuple(vals[1].shape), vals[2].dtype
