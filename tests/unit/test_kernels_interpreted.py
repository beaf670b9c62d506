"""The Triton kernels (``launcher.train.fused``, ``launcher.train.optim``) under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, set in a subprocess); it truncates casts to bf16, so bf16
results are compared to one bf16 step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`

SCRIPT = r"""
import torch, torch.nn.functional as F
from launcher.train import fused
from launcher.train.loss import linear_cross_entropy, loss_and_dlogits

from fixtures.numerics import ulp_bf16

torch.manual_seed(0)

# the loss kernel: both forms, padded and unpadded, fp32 (tight) and bf16 (one step)
for rows, cols, classes in [(5, 300, 300), (7, 320, 301), (3, 1000, 1000)]:
    for dtype in (torch.float32, torch.bfloat16):
        z = (torch.randn(rows, cols) * 3).to(dtype)
        labels = torch.randint(0, classes, (rows,))
        want_loss, want = loss_and_dlogits(z, labels, classes if classes < cols else None)
        for config in ({"BLOCK": 64, "num_warps": 4}, {"BLOCK": None, "num_warps": 4}):
            got = z.clone()
            loss = fused._launch_xent(got, labels, classes, got, config)  # in place
            torch.testing.assert_close(loss.mean(), want_loss, rtol=1e-6, atol=1e-6)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            else:
                assert ((got.float() - want.float()).abs() <= ulp_bf16(want.float())).all()
            assert (got[:, classes:] == 0).all()

# bias + GELU, fp32, ragged shapes, with and without the bias
for approximate in ("none", "tanh"):
    for bias in (True, False):
        y = torch.randn(37, 200) * 4
        b = torch.randn(200) if bias else None
        g = torch.randn(37, 200)
        h = fused._launch_fwd(y, b, approximate == "tanh")
        dy, db = fused._launch_bwd(g, y, b, approximate == "tanh")
        yr = y.clone().requires_grad_()
        br = None if b is None else b.clone().requires_grad_()
        want = fused._reference(yr, br, approximate)
        want.backward(g)
        torch.testing.assert_close(h, want.detach(), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(dy, yr.grad, rtol=2e-5, atol=2e-5)
        if bias:
            torch.testing.assert_close(db, br.grad, rtol=2e-5, atol=1e-4)

# the LM head through the custom op, eager and compiled, against the head without the kernel
fused.available = lambda t: True
x = torch.randn(64, 32, requires_grad=True)
w = (torch.randn(100, 32) * 0.1).requires_grad_()
labels = torch.randint(0, 100, (64,))
def head(kernels, compiled):
    fn = lambda: linear_cross_entropy(x, w, None, labels, kernels)
    if compiled:
        fn = torch.compile(fn)
    with torch.autocast("cpu", torch.bfloat16):
        loss = fn()
    return (loss.detach(), *torch.autograd.grad(loss, (x, w)))
want = head(False, False)
for compiled in (False, True):
    for name, a, b in zip(("loss", "dx", "dw"), head(True, compiled), want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3, msg=name)

# bf16 weights' AdamW (launcher.train.optim): the gradients' norm (_sumsq_kernel, _norm_kernel)
# and the update (_adamw_kernel, a pointer table of bf16 gradients) against the torch reference;
# ragged shapes (partial last blocks), two groups, clipped and unclipped steps
from fixtures.optim_cases import bf16_grads, build
shapes = [(37, 5), (2000,), (3, 1030), (7,)]
params, masters, opt = build(shapes, seed=1, kernels=True)
ref_params, ref_masters, ref_opt = build(shapes, seed=1, kernels=False)
initial = masters.master.clone()
for step in range(1, 4):
    for p, q, g in zip(params, ref_params, bf16_grads(shapes, step)):
        p.grad, q.grad = g, g.clone()
    norm, ref_norm = opt.clip_grad_norm_(1.0), ref_opt.clip_grad_norm_(1.0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    assert (norm > 1) == (step == 1), norm
    opt.step()
    ref_opt.step()
    for p, q in zip(params, ref_params):
        master = masters.master_of(p)
        torch.testing.assert_close(master, ref_masters.master_of(q), rtol=1e-6, atol=1e-7)
        assert ((p.detach().float() - master).abs() <= ulp_bf16(master)).all()
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert (masters.master[masters.starts[-1] + 7:] == 0).all()  # the padding is never written
    assert (opt.exp_avg[masters.starts[-1] + 7:] == 0).all()
for i, p in enumerate(params):  # every weight moved (every block of every tensor was updated)
    assert (masters.master_of(p) != masters.view(initial, i)).all()
print("ok")
"""


def test_the_kernels_interpreted_match_their_references(tmp_path: Path):
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
