"""bf16 weights with fp32 masters (``launcher.train.optim``) on the CPU: the flat buffers, the
torch reference of the update against ``torch.optim.AdamW``, the state round trip, the masters
in checkpoints, ``precision.weights`` resolved and checked.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from fixtures import optim_cases as cases
from fixtures.fake_launch import two_nodes
from fixtures.optim_cases import BETAS, LR, groups
from torch import nn

from launcher.errors import SpecError
from launcher.spec import ClusterSpec, check_fits, load_job
from launcher.spec.job import refusal_at
from launcher.train import optim
from launcher.train.optim import (
    BLOCK,
    MasterAdamW,
    MasterWeights,
    choose_weights,
    substitute_masters,
)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs" / "quickstart.yaml"

SHAPES = [(37, 5), (2000,), (3, 1030), (7,), (64, 64)]
fp32_params = functools.partial(cases.fp32_params, SHAPES)
bf16_grads = functools.partial(cases.bf16_grads, SHAPES)


def make(seed: int = 0) -> tuple[list[nn.Parameter], MasterWeights, MasterAdamW]:
    params, masters, opt = cases.build(SHAPES, seed=seed)
    assert opt.kernels is False  # the CPU: the torch reference
    return params, masters, opt


# -- MasterWeights ---------------------------------------------------------------------------


def test_master_weights_make_the_parameters_bf16_views_and_keep_fp32_masters():
    params = fp32_params()
    originals = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    masters = MasterWeights(params)
    flat = masters.flat
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    assert masters.master.dtype == torch.float32 and flat.dtype == torch.bfloat16
    for i, (p, original) in enumerate(zip(params, originals, strict=True)):
        assert id(p) == ids[i] and isinstance(p, nn.Parameter)  # the same Parameter objects
        assert p.dtype == torch.bfloat16 and p.shape == original.shape and p.requires_grad
        master = masters.master_of(p)  # exactly the fp32 values
        assert master.dtype == torch.float32 and torch.equal(master, original)
        assert torch.equal(p.detach(), original.bfloat16())  # rounded to nearest
        # a view of flat
        assert lo <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= hi
        assert p.data_ptr() == flat.data_ptr() + masters.starts[i] * flat.element_size()
        assert masters.starts[i] % BLOCK == 0
    # each slice padded to whole blocks, nothing overlapping, the buffers no bigger than that
    padded = [-(-p.numel() // BLOCK) * BLOCK for p in params]
    assert masters.starts == [sum(padded[:i]) for i in range(len(padded))]
    assert flat.numel() == sum(padded) == masters.master.numel()
    # writing a parameter writes the flat buffer (a view, not a copy)
    with torch.no_grad():
        params[1].fill_(3.0)
    assert (masters.view(flat, 1) == 3.0).all()


def test_a_parameter_listed_twice_is_refused():
    params = fp32_params()
    with pytest.raises(ValueError, match="listed twice"):
        MasterWeights([params[0], params[1], params[0]])
    assert params[0].dtype == torch.float32  # refused before anything changed


# -- MasterAdamW (the torch reference) against torch.optim.AdamW ------------------------------


@pytest.mark.parametrize("clip", [True, False])
def test_master_adamw_matches_torch_adamw_with_two_groups(clip: bool):
    """With clipping, and without (the first step's large gradients used as they are)."""
    params, masters, opt = make()
    fp32 = fp32_params()  # the same initial values, trained by torch's AdamW in fp32
    torch_opt = torch.optim.AdamW(groups(fp32), lr=LR, betas=BETAS)
    clipped = []
    for step in range(1, 6):
        grads = bf16_grads(step)
        for p, q, g in zip(params, fp32, grads, strict=True):
            p.grad = g
            q.grad = g.float()  # the same values
        if clip:
            norm = opt.clip_grad_norm_(1.0)
            torch_norm = torch.nn.utils.clip_grad_norm_(fp32, 1.0)
            torch.testing.assert_close(norm, torch_norm, rtol=1e-5, atol=0)
            clipped.append(norm.item() > 1.0)
        opt.step()
        torch_opt.step()
        for p, q in zip(params, fp32, strict=True):
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(masters.master_of(p), q.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), masters.master_of(p).bfloat16())
            assert p.grad.dtype == torch.bfloat16  # the gradients themselves are left alone
    if clip:  # both sides of the clipping rule ran
        assert clipped == [True, False, False, False, False]
    for p, q in zip(params, fp32, strict=True):
        mine, theirs = opt.state[p], torch_opt.state[q]
        assert float(mine["step"]) == float(theirs["step"]) == 5
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-5, atol=1e-10)


def test_a_parameter_without_a_gradient_is_not_updated():
    params, masters, opt = make()
    skipped = params[0]  # a matrix: weight decay would move it if it were touched
    before = masters.master_of(skipped).clone()
    weight_before = skipped.detach().clone()
    for step in range(1, 4):
        for p, g in zip(params, bf16_grads(step), strict=True):
            p.grad = None if p is skipped else g
        opt.clip_grad_norm_(1.0)
        opt.step()
    assert torch.equal(masters.master_of(skipped), before)
    assert torch.equal(skipped.detach(), weight_before)
    assert (opt.state[skipped]["exp_avg"] == 0).all()
    assert (opt.state[skipped]["exp_avg_sq"] == 0).all()
    other = params[2]
    assert not torch.equal(masters.master_of(other), fp32_params()[2])  # the others were
    assert (opt.state[other]["exp_avg"] != 0).any()


def test_the_norm_leaves_out_parameters_without_gradients():
    params, _, opt = make()
    for p, g in zip(params, bf16_grads(1), strict=True):
        p.grad = g
    params[1].grad = None
    norm = opt.clip_grad_norm_(1.0)
    want = torch.linalg.vector_norm(
        torch.cat([p.grad.float().flatten() for p in params if p.grad is not None])
    )
    torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)


def test_one_gradient_table_serves_the_norm_and_every_group_until_an_address_changes():
    """The kernels' table of gradient addresses (an upload to the GPU) is built again only when
    a gradient moves, not for the norm and each group of each step."""
    params, _, opt = make()
    for p, g in zip(params, bf16_grads(1), strict=True):
        p.grad = g
    params[3].grad = None
    table, present = opt._gradients()
    assert table.tolist() == [0 if p.grad is None else p.grad.data_ptr() for p in params]
    # per group, the tensors with a gradient (groups(): matrices, vectors)
    assert present == [(0, 2, 4), (1,)]
    for _ in range(3):  # the norm and both groups' updates of three steps, gradients in place
        for _group in range(3):
            again, _ = opt._gradients()
            assert again is table
    params[1].grad = params[1].grad.clone()  # a gradient moved
    moved, _ = opt._gradients()
    assert moved is not table and moved[1].item() == params[1].grad.data_ptr()
    params[0].grad = params[0].grad.t().contiguous().t()  # the kernels read contiguous ones only
    with pytest.raises(RuntimeError, match="contiguous=False"):
        opt._gradients()


# -- state_dict / load_state_dict ------------------------------------------------------------


def test_load_state_dict_copies_into_the_optimizers_own_buffers():
    params, masters, opt = make()
    for step in range(1, 4):
        for p, g in zip(params, bf16_grads(step), strict=True):
            p.grad = g
        opt.clip_grad_norm_(1.0)
        opt.step()
    for group in opt.param_groups:  # as a scheduler would have left them
        group["lr"] = 2e-3
    state = opt.state_dict()

    params2, masters2, opt2 = make(seed=1)  # other weights, fresh moments
    own = {
        id(p): (opt2.state[p]["exp_avg"].data_ptr(), opt2.state[p]["exp_avg_sq"].data_ptr())
        for p in params2
    }
    opt2.load_state_dict(state)
    for p, q in zip(params, params2, strict=True):
        mine, theirs = opt2.state[q], opt.state[p]
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"])
        assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])
        assert float(mine["step"]) == 3
        # still views of opt2's flat buffers, not the loaded tensors
        assert (mine["exp_avg"].data_ptr(), mine["exp_avg_sq"].data_ptr()) == own[id(q)]
        assert mine["exp_avg"].data_ptr() != theirs["exp_avg"].data_ptr()
    assert torch.equal(opt2.masters.view(opt2.exp_avg, 2), opt.state[params[2]]["exp_avg"])
    assert all(g["lr"] == 2e-3 for g in opt2.param_groups)
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.1, 0.0]

    # the weights come from the checkpoint's masters; one more step each: the same masters
    masters2.master.copy_(masters.master)
    masters2.flat.copy_(masters2.master)  # what loading the model's state does
    for p, q, g in zip(params, params2, bf16_grads(4), strict=True):
        p.grad, q.grad = g, g.clone()
    opt.clip_grad_norm_(1.0)
    opt2.clip_grad_norm_(1.0)
    opt.step()
    opt2.step()
    assert torch.equal(masters.master, masters2.master)
    for p, q in zip(params, params2, strict=True):
        assert torch.equal(p.detach(), q.detach())
    assert float(opt2.state[params2[0]]["step"]) == 4


def test_load_state_dict_refuses_another_layout():
    params, _, opt = make()
    state = opt.state_dict()
    params2 = fp32_params()
    masters2 = MasterWeights(params2)
    one_group = MasterAdamW([{"params": params2}], masters2, lr=LR, betas=BETAS)
    with pytest.raises(ValueError, match="parameter groups"):
        one_group.load_state_dict(state)


# -- substitute_masters ----------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("scale", torch.arange(16, dtype=torch.float32))
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)


def test_substitute_masters_puts_the_fp32_masters_in_place_of_the_bf16_weights():
    torch.manual_seed(0)
    model = Tiny()
    trained = [p for p in model.parameters() if p.requires_grad]
    masters = MasterWeights(trained)
    with torch.no_grad():  # masters that differ from their rounded weights
        masters.master.add_(1e-4)
    state = model.state_dict()
    out = substitute_masters(state, masters)
    assert sorted(out) == sorted(state)
    names = {"linear.weight", "linear.bias", "norm.weight", "norm.bias"}
    for name, p in model.named_parameters():
        if name in names:
            assert state[name].dtype == torch.bfloat16
            assert out[name].dtype == torch.float32 and torch.equal(out[name], masters.master_of(p))
            # the masters themselves: a load fills them
            assert out[name].data_ptr() == masters.master_of(p).data_ptr()
    assert out["scale"] is state["scale"] and out["frozen"] is state["frozen"]  # left alone
    assert out["frozen"].dtype == torch.float32
    assert substitute_masters(state, None) is state


# -- precision.weights -----------------------------------------------------------------------

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def choose(requested: str, **kw) -> str:
    """choose_weights for bf16 training, one micro-batch, unsharded, on the CPU unless ``kw``."""
    kw = {"dtype": "bf16", "grad_accum": 1, "sharded": False, "device": CPU, **kw}
    return choose_weights(requested, **kw)


def test_choose_weights_resolves_auto_and_honours_explicit_choices():
    assert choose("fp32") == "fp32"
    assert choose("fp32", dtype="fp16", grad_accum=4, sharded=True) == "fp32"
    assert choose("auto") == "fp32"  # the CPU
    assert choose("auto", dtype="fp16", device=CUDA) == "fp32"
    assert choose("auto", grad_accum=2, device=CUDA) == "fp32"
    assert choose("auto", sharded=True, device=CUDA) == "fp32"
    assert choose("bf16") == "bf16"  # on the CPU: the torch reference
    if optim.triton is not None:
        assert choose("auto", device=CUDA) == "bf16"


@pytest.mark.parametrize(
    ("kwargs", "reasons"),
    [
        ({"dtype": "fp16"}, ["precision.dtype is fp16"]),
        ({"dtype": "fp32"}, ["precision.dtype is fp32"]),
        ({"grad_accum": 2}, ["train.grad_accum is 2"]),
        ({"sharded": True}, ["FSDP shards the weights"]),
        (  # every reason named
            {"dtype": "fp16", "grad_accum": 2, "sharded": True},
            ["precision.dtype is fp16", "train.grad_accum is 2", "FSDP shards"],
        ),
    ],
)
def test_choose_weights_refuses_bf16_where_it_cannot_apply(kwargs: dict, reasons: list[str]):
    with pytest.raises(SpecError) as err:
        choose("bf16", **kwargs)
    message = str(err.value)
    assert err.value.exit_code == 2 and err.value.field == "precision.weights"
    assert all(r in message for r in reasons) and "Set precision.weights to auto or fp32" in message


def test_the_job_spec_takes_bf16_weights_with_bf16_training():
    job = load_job(QUICKSTART, ["precision.dtype=bf16", "precision.weights=bf16"])
    assert job.precision.weights == "bf16"
    assert load_job(QUICKSTART).precision.weights == "auto"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["resources.device=cuda", "precision.dtype=fp16"], "precision.dtype is fp16"),
        (["precision.dtype=fp32"], "precision.dtype is fp32"),
        (
            ["precision.dtype=bf16", "train.grad_accum=2"],
            "train.grad_accum is 2 (raise train.micro_batch instead)",
        ),
        (
            [
                "resources.device=cuda",
                "resources.nproc_per_node=1",
                "precision.dtype=bf16",
                "parallel.strategy=fsdp",
                "parallel.fsdp.cpu_offload=true",
            ],
            "FSDP shards the weights here",
        ),  # even one process
    ],
)
def test_the_job_spec_refuses_bf16_weights_where_they_cannot_apply(
    overrides: list[str], expected: str
):
    with pytest.raises(SpecError) as err:
        load_job(QUICKSTART, [*overrides, "precision.weights=bf16"])
    message = str(err.value)
    assert err.value.exit_code == 2
    assert str(QUICKSTART) in message, "the error names the file"
    assert "\n" not in message and "Traceback" not in message
    assert expected in message, message
    # the trainer's refusal (choose_weights) and the spec's are one paragraph, worded alike
    refusal = "precision.weights bf16 (bf16 weights with fp32 masters) cannot apply to this run: "
    assert refusal in message and "Set precision.weights to auto or fp32." in message


def test_refusal_at_knows_the_world_size_and_reruns_the_checks(tmp_path: Path):
    """``refusal_at(job, world)``: the spec's checks again (a job changed with model_copy, as an
    elastic restart's new grad_accum, skipped them) and FSDP's sharding of bf16 weights over
    the ranks, which the spec alone cannot know with nodes all or nproc_per_node auto."""
    bf16 = ["precision.dtype=bf16", "precision.weights=bf16"]
    one = load_job(QUICKSTART, [*bf16, "parallel.strategy=fsdp", "resources.nproc_per_node=1"])
    assert refusal_at(one, 1) is None  # one process: FSDP trains it unwrapped
    assert "FSDP shards the weights here" in refusal_at(one, 2)
    more = one.model_copy(update={"train": one.train.model_copy(update={"grad_accum": 2})})
    assert "train.grad_accum is 2" in refusal_at(more, 1)
    ddp = load_job(QUICKSTART, bf16)
    assert refusal_at(ddp, 8) is None

    pattern = "on 2 ranks: precision.weights bf16 .*FSDP shards the weights here"
    with pytest.raises(SpecError, match=pattern) as err:
        check_fits(one, two_nodes(), job_source=str(QUICKSTART))
    assert err.value.exit_code == 2 and err.value.field == "precision.weights"
    check_fits(one, ClusterSpec.this_machine())
    check_fits(ddp, two_nodes())
