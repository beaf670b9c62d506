"""The bare trainer with inductor's config changed: a measurement of compiler options.

``python -m launcher.train`` in this process, after setting ``torch._inductor.config``
attributes, so that every graph the trainer compiles sees them. Each ``--option`` is
``KEY=VALUE``, the value a Python literal; a key inductor does not have is refused. At the end
it prints inductor's counters, which show whether an option took effect (e.g.
``batch_linear_post_grad`` counts the groups of products that pass fused)::

    python benchmarks/inductor_options.py --option combo_kernels=True -- \\
        --job jobs/gpt.yaml --set train.steps=100 --set train.warmup_steps=20

    # the weight gradients of the 12 layers as batched products
    python benchmarks/inductor_options.py \\
        --option "post_grad_fusion_options={'batch_linear_post_grad': {'min_fuse_set_size': 4}}" -- \\
        --job jobs/gpt.yaml --set train.steps=100 --set train.warmup_steps=20

Give each option its own ``TORCHINDUCTOR_CACHE_DIR`` when comparing runs, so that each
compiles afresh. Options that only an environment variable sets (e.g.
``TORCHINDUCTOR_MAX_AUTOTUNE_GEMM``) need no tool.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import runpy
import sys


def parse_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` → (key, the value as a Python literal)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{text!r} is not KEY=VALUE")
    try:
        return key.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError) as err:
        raise ValueError(
            f"the value of {key.strip()} is not a Python literal: {value.strip()!r}"
        ) from err


def apply(options: list[tuple[str, object]]) -> None:
    """Set each option on ``torch._inductor.config``; refuse keys it does not have."""
    import torch._inductor.config as config

    for key, value in options:
        if not hasattr(config, key):
            raise ValueError(f"torch._inductor.config has no option {key!r}")
        setattr(config, key, value)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an inductor config value (repeatable)",
    )
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    args = p.parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    try:
        options = [parse_option(o) for o in args.option]
        apply(options)
    except ValueError as err:
        p.error(str(err))

    from torch._dynamo.utils import counters

    shown = ", ".join(f"{k}={v!r}" for k, v in options) or "none"
    atexit.register(
        lambda: print(
            f"inductor options: {shown}; counters: {dict(counters['inductor'])}", flush=True
        )
    )
    sys.argv = ["launcher.train", *trainer_args]
    runpy.run_module("launcher.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
