"""Triton kernels on CUDA: the MLP's bias and GELU (``bias_gelu``) and the LM head's softmax
cross-entropy (``softmax_xent_``). On CPU or without Triton the reference functions run.
"""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path below
    triton = None

# Tiles (rows × columns of y) and warps per program: the fastest of benchmarks/mlp_kernels.py.
FWD = {"BLOCK_M": 4, "BLOCK_N": 1024, "num_warps": 4}
BWD = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4}
# The loss kernel's chunk of columns and warps (``python benchmarks/loss_kernels.py --sweep``).
# L2: the second pass backwards, with cache hints (see ``_xent_kernel``).
XENT = {"BLOCK": 4096, "num_warps": 8, "L2": True}  # BLOCK None: the whole row in registers


def available(t: torch.Tensor) -> bool:
    """Whether the kernels run for this tensor: Triton importable and the tensor on CUDA (a
    test that ``torch.compile`` traces without a graph break)."""
    return triton is not None and t.is_cuda


def supported(device: torch.device) -> bool:
    """Whether to turn the kernels on for a device (the trainer asks once, eagerly): CUDA
    with Triton, compute capability 8.0 or above (Ampere and later; measured and tested on Hopper)."""
    return (
        triton is not None
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def bias_gelu(
    y: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """``F.gelu(y + bias, approximate=approximate)``, through the kernels where they run.

    ``bias`` (d_ff,) may be fp32 while ``y`` is bf16 (autocast): the sum is taken in fp32 and
    the bias's gradient is summed in fp32 and returned in its dtype."""
    if not available(y) or y.dim() < 2:
        return _reference(y, bias, approximate)
    shape = y.shape
    out = torch.ops.launcher.bias_gelu(y.reshape(-1, shape[-1]), bias, approximate == "tanh")
    return out.view(shape)


def softmax_xent_(logits: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """Each row's cross-entropy (fp32, (rows,)), and ``softmax - onehot(labels)`` written over
    ``logits`` (rows × columns, contiguous) in their dtype; columns from ``classes`` on are
    padding (probability 0, gradient 0). One read and one write of the logits, on CUDA only
    (``available``): ``launcher.train.loss.loss_and_dlogits`` is the reference."""
    return torch.ops.launcher.softmax_xent_(logits, labels, classes)


def _reference(y: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    if bias is not None:
        y = y + bias.to(y.dtype)
    return F.gelu(y, approximate=approximate)


if triton is not None:
    # Constants are literals in the kernels: 0.35355339 = 1/(2√2), 0.39894228 = 1/√(2π); the
    # tanh approximation is tanh(k·(x + c·x³)), k = √(2/π), c = 0.044715: 1.59576912 = 2k and
    # 0.21406445 = 2k·3c.

    @triton.jit
    def _erfc_scaled(z):
        """erfc(|z|/√2) = t·exp(-z²/2 + P(t)), t = 1/(1 + |z|/(2√2)): Numerical Recipes' erfcc,
        a Chebyshev fit with a relative error under 1.2e-7 everywhere (tails included)."""
        t = 1.0 / (1.0 + 0.35355339059327373 * tl.abs(z))
        p = 0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))
        p = -1.26551223 + t * (
            1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * p)))
        )
        return t * tl.exp(p - 0.5 * z * z)

    @triton.jit
    def _phi(z, TANH: tl.constexpr):
        """Φ(z), GELU's gate: GELU(z) = z·Φ(z)."""
        if TANH:  # 0.5·(1 + tanh(u)) = sigmoid(2u): no cancellation for negative u
            phi = 1.0 / (1.0 + tl.exp(-1.5957691216057308 * (z + 0.044715 * z * z * z)))
        else:
            half_tail = 0.5 * _erfc_scaled(z)  # Φ(-|z|), without 1 + erf's cancellation
            phi = tl.where(z < 0.0, half_tail, 1.0 - half_tail)
        return phi

    @triton.jit
    def _gelu_grad(z, TANH: tl.constexpr):
        """dGELU/dz = Φ(z) + z·Φ'(z)."""
        phi = _phi(z, TANH)
        if TANH:
            grad = phi + z * (1.5957691216057308 + 0.21406444881780076 * z * z) * phi * (1.0 - phi)
        else:
            grad = phi + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
        return grad

    @triton.jit
    def _tile(Y, B, M, N, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's tile of y + bias in fp32 (0 where masked): columns, offsets, mask, z."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        z = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        return cols, offs, mask, z

    @triton.jit
    def _fwd_kernel(
        Y,
        B,
        H,
        M,
        N,
        HAS_BIAS: tl.constexpr,
        TANH: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        _, offs, mask, z = _tile(Y, B, M, N, HAS_BIAS, BLOCK_M, BLOCK_N)
        tl.store(H + offs, (z * _phi(z, TANH)).to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_kernel(
        DH,
        Y,
        B,
        DY,
        DB_PART,
        M,
        N,
        HAS_BIAS: tl.constexpr,
        TANH: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        cols, offs, mask, z = _tile(Y, B, M, N, HAS_BIAS, BLOCK_M, BLOCK_N)
        dz = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32) * _gelu_grad(z, TANH)
        tl.store(DY + offs, dz.to(DY.dtype.element_ty), mask=mask)
        if HAS_BIAS:  # this tile's column sums; the launcher adds the tiles' rows
            tl.store(
                DB_PART + tl.program_id(0).to(tl.int64) * N + cols,
                tl.sum(dz, axis=0),
                mask=cols < N,
            )

    def _grid(m: int, n: int, config: dict[str, int]) -> tuple[int, int]:
        return triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"])

    def _launch_fwd(y: torch.Tensor, bias: torch.Tensor | None, tanh: bool) -> torch.Tensor:
        m, n = y.shape
        h = torch.empty_like(y)
        _fwd_kernel[_grid(m, n, FWD)](
            y, y if bias is None else bias, h, m, n, HAS_BIAS=bias is not None, TANH=tanh, **FWD
        )
        return h

    def _launch_bwd(
        dh: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, tanh: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, n = y.shape
        dy = torch.empty_like(y)
        grid = _grid(m, n, BWD)
        part = (
            dy if bias is None else torch.empty((grid[0], n), device=y.device, dtype=torch.float32)
        )
        _bwd_kernel[grid](
            dh,
            y,
            y if bias is None else bias,
            dy,
            part,
            m,
            n,
            HAS_BIAS=bias is not None,
            TANH=tanh,
            **BWD,
        )
        return dy, None if bias is None else part.sum(0).to(bias.dtype)

    @triton.jit
    def _xent_kernel(
        Z,
        LABELS,
        DZ,
        LOSS,
        N,
        CLASSES,
        BLOCK: tl.constexpr,
        ONE_PASS: tl.constexpr,
        L2: tl.constexpr,
    ):
        """One row of logits a program: its loss (log-sum-exp minus the label's logit) and
        ``softmax - onehot`` in place of the logits (DZ may be Z: each element is read before
        it is written). Columns from CLASSES to N are padding: probability 0, gradient 0."""
        row = tl.program_id(0).to(tl.int64)
        label = tl.load(LABELS + row)
        z_row, dz_row = Z + row * N, DZ + row * N
        target = tl.load(z_row + label).to(tl.float32)
        if ONE_PASS:  # the whole row in registers: read once, written once
            cols = tl.arange(0, BLOCK)
            z = tl.load(z_row + cols, mask=cols < CLASSES, other=float("-inf")).to(tl.float32)
            m = tl.max(z, axis=0)
            e = tl.exp(z - m)
            s = tl.sum(e, axis=0)
            p = e * (1.0 / s)
            tl.store(
                dz_row + cols,
                tl.where(cols == label, p - 1.0, p).to(DZ.dtype.element_ty),
                mask=cols < N,
            )
            lse = m + tl.log(s)
        else:  # an online max and sum over chunks, then a second pass that reads the row again
            # The second pass goes backwards, reading first what L2 likely still holds.
            m = tl.full([], float("-inf"), tl.float32)
            s = tl.zeros([], tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                z = tl.load(
                    z_row + cols,
                    mask=cols < CLASSES,
                    other=float("-inf"),
                    eviction_policy="evict_last" if L2 else "",
                ).to(tl.float32)
                m_new = tl.maximum(m, tl.max(z, axis=0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
                m = m_new
            lse = m + tl.log(s)
            chunks = tl.cdiv(N, BLOCK)
            for i in range(0, chunks):
                chunk = chunks - 1 - i if L2 else i
                cols = chunk * BLOCK + tl.arange(0, BLOCK)
                z = tl.load(
                    z_row + cols,
                    mask=cols < CLASSES,
                    other=float("-inf"),
                    eviction_policy="evict_first" if L2 else "",
                ).to(tl.float32)
                p = tl.exp(z - lse)
                tl.store(
                    dz_row + cols,
                    tl.where(cols == label, p - 1.0, p).to(DZ.dtype.element_ty),
                    mask=cols < N,
                    cache_modifier=".cs" if L2 else "",
                )
        tl.store(LOSS + row, lse - target)

    def _launch_xent(
        z: torch.Tensor,
        labels: torch.Tensor,
        classes: int,
        dz: torch.Tensor,
        config: dict | None = None,
    ) -> torch.Tensor:
        m, n = z.shape
        loss = torch.empty(m, device=z.device, dtype=torch.float32)
        config = dict(config or XENT)
        block = config.pop("BLOCK", None) or triton.next_power_of_2(n)
        config.setdefault("L2", True)
        _xent_kernel[(m,)](
            z, labels, dz, loss, n, classes, BLOCK=block, ONE_PASS=block >= n, **config
        )
        return loss

    @torch.library.custom_op("launcher::bias_gelu", mutates_args=())
    def _bias_gelu_op(y: torch.Tensor, bias: torch.Tensor | None, tanh: bool) -> torch.Tensor:
        return _launch_fwd(y.contiguous(), bias, tanh)

    @_bias_gelu_op.register_fake
    def _(y, bias, tanh):
        return torch.empty_like(y, memory_format=torch.contiguous_format)

    @torch.library.custom_op("launcher::bias_gelu_backward", mutates_args=())
    def _bias_gelu_backward_op(
        dh: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, tanh: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dy, db = _launch_bwd(dh.contiguous(), y.contiguous(), bias, tanh)
        # custom ops return tensors, not None: an empty one stands for "no bias"
        return dy, db if db is not None else dy.new_empty(0)

    @_bias_gelu_backward_op.register_fake
    def _(dh, y, bias, tanh):
        db = torch.empty_like(bias) if bias is not None else y.new_empty(0)
        return torch.empty_like(y, memory_format=torch.contiguous_format), db

    @torch.library.custom_op("launcher::softmax_xent_", mutates_args=("logits",))
    def _softmax_xent_op(logits: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
        if not logits.is_contiguous():  # written in place, row by row
            raise ValueError("softmax_xent_ needs contiguous logits")
        return _launch_xent(logits, labels.contiguous(), classes, logits)

    @_softmax_xent_op.register_fake
    def _(logits, labels, classes):
        return logits.new_empty(logits.shape[0], dtype=torch.float32)

    def _setup_context(ctx, inputs, output):
        y, bias, tanh = inputs
        ctx.save_for_backward(y, bias)
        ctx.tanh = tanh

    def _backward(ctx, dh):
        y, bias = ctx.saved_tensors
        dy, db = torch.ops.launcher.bias_gelu_backward(dh, y, bias, ctx.tanh)
        return dy, (db if bias is not None else None), None

    _bias_gelu_op.register_autograd(_backward, setup_context=_setup_context)
