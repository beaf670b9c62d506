"""The built-in trainer's entry point: parse → build → train → close.

    torchrun --nproc-per-node 2 -m launcher.train --job jobs/quickstart.yaml

Wrapped in torchelastic's ``@record``, so a crash names its rank; input problems exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from launcher.errors import LauncherError, SpecError
from launcher.spec import load_job
from launcher.spec.hf import FolderError
from launcher.train.checkpoint import ResumeError
from launcher.train.data import DataError
from launcher.train.loop import Trainer

# Found at start by the worker, each naming what to change in the job (or its files).
INPUT_ERRORS = (ResumeError, DataError, FolderError)


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.train", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--job", required=True, help="job YAML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a job field, e.g. --set train.steps=50 (repeatable)",
    )
    args = parser.parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(
        level=logging.INFO if rank0 else logging.WARNING,
        stream=sys.stdout,
        format="%(message)s",
        force=True,
    )
    try:
        trainer = Trainer(load_job(args.job, args.overrides))
    except LauncherError as err:  # a bad job, or e.g. fp8 asked of a GPU without FP8 tensor cores
        print(err, file=sys.stderr)
        return err.exit_code
    except INPUT_ERRORS as err:
        spec_error = SpecError(
            " ".join(str(err).split()), source=args.job, field=getattr(err, "field", None)
        )
        print(spec_error, file=sys.stderr)
        return spec_error.exit_code
    with trainer:
        trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
