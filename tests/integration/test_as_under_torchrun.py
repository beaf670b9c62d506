"""What a script sees around it is what it would see under torchrun started from this shell:
the shell's environment, Ctrl-C as KeyboardInterrupt, its own output whole in its rank's log,
and a console without torchrun's or Ray's tracebacks. Real launches: Ray, torchrun, gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.launching import TORCHRUN_NOISE, launch, wait_for, write_job

pytestmark = pytest.mark.ray

SHELL = {
    "MY_OWN_SETTING": "from-my-shell",
    "HF_HOME": "/data/hf-home",
    "WANDB_MODE": "offline",
    "OMP_NUM_THREADS": "2",
    "TORCHINDUCTOR_CACHE_DIR": "/data/inductor",
    "PYTHONHASHSEED": "7",
    "HF_TOKEN": "hf_not_a_real_secret",
}
FORWARDED = {k: v for k, v in SHELL.items() if k != "MY_OWN_SETTING"}


def seen_env(run_dir: Path, node: str, rank: int) -> dict[str, str]:
    """What rank ``rank`` printed of its environment, from its log in the run directory."""
    log = (run_dir / f"logs/{node}/rank{rank}.log").read_text()
    return json.loads(next(line[4:] for line in log.splitlines() if line.startswith("ENV ")))


def script_job(folder: Path, source: str) -> Path:
    """A job running ``source`` as ``script.py`` on two CPU workers."""
    (folder / "script.py").write_text(source)
    return write_job(folder, {"script": "script.py"})


CATCH_CTRL_C = """
import sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"ready {rank}", flush=True)
try:
    while True:
        time.sleep(0.1)
except KeyboardInterrupt:
    time.sleep(0.5)  # a checkpoint being saved
    print(f"KeyboardInterrupt handled on rank {rank}", flush=True)
"""
NOT_OURS = ("Traceback", *TORCHRUN_NOISE)


def test_ctrl_c_runs_every_ranks_keyboard_interrupt_handler(tmp_path):
    """SIGINT to the launch's process group, as a terminal's Ctrl-C: each rank gets SIGINT, its
    handler runs; exit 130, the summary says interrupted, no torchrun or Ray traceback shows."""
    job = script_job(tmp_path, CATCH_CTRL_C)
    run_dir = tmp_path / f"run-{tmp_path.name}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", str(job), "--run-dir", str(run_dir), "--skip-parity"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        logs = [run_dir / f"logs/local/rank{rank}.log" for rank in (0, 1)]

        def ready() -> bool:
            return all(
                log.is_file() and f"ready {r}" in log.read_text() for r, log in enumerate(logs)
            )

        wait_for(ready, timeout=180, what="both ranks ready", proc=proc, poll=0.3)
        os.killpg(proc.pid, signal.SIGINT)
        console, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, console[-3000:]
    for rank in (0, 1):
        log = (run_dir / f"logs/local/rank{rank}.log").read_text()
        assert f"KeyboardInterrupt handled on rank {rank}" in log, log[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert not [bad for bad in NOT_OURS if bad in console], console[-3000:]


LOUD = """
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
print("ENV " + json.dumps(dict(os.environ)), flush=True)
for i in range(N):
    tail = "y" * (20_000 + i) if i % 97 == 0 else ""  # now and then a very long line
    print(f"out rank{rank} line{i} {tail}")
    if i % 25 == 0:
        sys.stderr.write(f"progress rank{rank} {i}/{N}\\r")  # a tqdm-like bar: no newline
        sys.stderr.flush()
    if i % 1000 == 0:
        sys.stderr.write(f"\\nerr rank{rank} line{i}\\n")
sys.stderr.write("\\n")
dist.barrier()
"""
N_LINES = 20_000


def expected_logs(rank: int) -> tuple[list[str], str]:
    """What LOUD writes on ``rank``: its stdout lines, and its stderr as written."""
    out, err = [], []
    for i in range(N_LINES):
        tail = "y" * (20_000 + i) if i % 97 == 0 else ""
        out.append(f"out rank{rank} line{i} {tail}")
        if i % 25 == 0:
            err.append(f"progress rank{rank} {i}/{N_LINES}\r")
        if i % 1000 == 0:
            err.append(f"\nerr rank{rank} line{i}\n")
    return out, "".join(err) + "\n"


def test_workers_see_the_shell_here_and_each_ranks_log_holds_exactly_its_own_lines(tmp_path):
    """One launch, two checks: every rank sees the launching shell's environment as under
    torchrun (its lines ``ENV ...``), and each rank's log holds exactly its own lines, in order
    (LOUD's ``out ...`` lines, long ones, and a progress bar on stderr)."""
    job = script_job(tmp_path, f"N = {N_LINES}\n" + LOUD)
    run_dir = tmp_path / f"run-{tmp_path.name}"
    args = [str(job), "--run-dir", str(run_dir), "--skip-parity"]
    result = launch(*args, cwd=tmp_path, env={**os.environ, **SHELL}, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    for rank in (0, 1):
        seen = seen_env(run_dir, "local", rank)
        for name, value in SHELL.items():
            assert seen.get(name) == value, (rank, name, seen.get(name))
        assert seen["PATH"] == os.environ["PATH"]  # the shell's, as under torchrun
        assert seen["TORCHELASTIC_RUN_ID"] == plan["run_id"]
    sources = plan["nodes"][0]["env_sources"]
    assert {sources[k] for k in SHELL} == {"shell"}
    assert plan["nodes"][0]["env"]["HF_TOKEN"] == "****"  # masked in plan.json like any secret
    for rank in (0, 1):
        out, err = expected_logs(rank)
        with open(run_dir / f"logs/local/rank{rank}.log", newline="") as fh:
            lines = fh.read().split("\n")
        assert [line for line in lines if line.startswith("out ")] == out
        with open(run_dir / f"logs/local/rank{rank}.stderr", newline="") as fh:
            assert fh.read() == err
        other = f"rank{1 - rank} "
        assert not [line for line in lines if other in line]
    # torchrun's own lines, if any (with OMP_NUM_THREADS set in the shell it prints none)
    torchrun_log = run_dir / "logs/local/torchrun.log"
    assert not torchrun_log.exists() or "out rank" not in torchrun_log.read_text()
