"""Which variables of the launching shell reach the workers, and which the launcher owns.

``launch.env_forward`` holds gitignore-like name patterns; ``forwarded`` applies them.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence

# Where the trainer keeps compiled graphs (launcher.train.compile_cache): the user's to set.
COMPILE_CACHE_ENV = "LAUNCHER_COMPILE_CACHE"
DEFAULT_ENV_FORWARD = (
    "HF_*",
    "HUGGINGFACE_*",
    "TRANSFORMERS_*",
    "TOKENIZERS_PARALLELISM",
    "WANDB_*",
    "MLFLOW_*",
    "NCCL_*",
    "NVSHMEM_*",
    "TORCH*",
    "PYTORCH_*",
    "CUDA_*",
    "!CUDA_HOME",
    "!CUDA_PATH",
    "OMP_*",
    "MKL_*",
    "TRITON_*",
    "GLOO_*",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "PYTHONHASHSEED",
    COMPILE_CACHE_ENV,
)
# Set by torchrun for each worker, by Ray's GPU assignment, or the launcher's own: a shell's
# value never reaches a worker.
OWNED_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
    }
)
OWNED_PREFIXES = ("TORCHELASTIC_", "LAUNCHER_", "RAY_")
# The user's settings among the owned prefixes: the workers read them.
USER_NAMES = frozenset({COMPILE_CACHE_ENV})
PATTERN = re.compile(r"^!?[A-Za-z0-9_*?\[\]!-]+$")


def owned(name: str) -> bool:
    """A name the launcher (or torchrun, or Ray) sets: never taken from the shell."""
    return name not in USER_NAMES and (name in OWNED_NAMES or name.startswith(OWNED_PREFIXES))


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``patterns`` forward ``name``: the last pattern that matches decides (a ``!``
    pattern leaves the name out), as in a .gitignore."""
    chosen = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if fnmatch.fnmatchcase(name, pattern.removeprefix("!")):
            chosen = not negated
    return chosen


def forwarded(
    shell: Mapping[str, str], patterns: Sequence[str] | None, *, everything: bool = False
) -> dict[str, str]:
    """The shell's variables that reach the workers: all of them (``everything``: this machine's
    node, as under torchrun) or those ``patterns`` match, less the launcher's own."""
    return {
        k: v
        for k, v in shell.items()
        if not owned(k) and (everything or matches(k, patterns or ()))
    }
