"""Shell quoting for remote commands: one line any login shell hands to sh unchanged."""

from __future__ import annotations

import base64
import math
import re
import shlex

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
REMOTE_TIMEOUT_MARGIN_S = 2  # a remote command outliving its timeout by this stops itself


def remote_command(script: str, timeout: float | None) -> str:
    """What an SSH runner sends: ``script`` for sh, under coreutils' ``timeout -k`` where given
    one (a closed channel stops no remote command: it stops itself)."""
    if timeout is None:
        return for_login_shell(script)
    limit = math.ceil(timeout) + REMOTE_TIMEOUT_MARGIN_S
    wrapper = (
        f"if timeout -k 1 5 true >/dev/null 2>&1; then exec timeout -k 5 {limit} sh -c {shlex.quote(script)}; "
        f"else exec sh -c {shlex.quote(script)}; fi"
    )
    return for_login_shell(wrapper)


# What csh, tcsh or fish change inside a single-quoted word (newline, history "!", fish's \\ \').
_LOGIN_SHELL_UNSAFE = re.compile(r"[\n\r!\\]")


# A node without `base64` (or whose `base64 -d` fails) must not run nothing and exit 0.
BASE64_FAILED = "launcher: base64 -d failed on this node"


def for_login_shell(script: str) -> str:
    """``sh -c`` running ``script``, as one line that any login shell passes to sh unchanged:
    quoted where that is safe, else base64-encoded (BASE64_FAILED, exit 127, without base64)."""
    if not script.rstrip("\n"):  # newlines only: nothing to run (and sh's $(...) drops them)
        script = ""
    if _LOGIN_SHELL_UNSAFE.search(script) is None:
        return f"sh -c {shlex.quote(script)}"
    encoded = base64.b64encode(script.encode()).decode()
    # Inside the single quotes: no ', newline, ! or backslash, so csh, tcsh and fish keep it as it is.
    return (
        f'sh -c \'s=$(echo {encoded} | base64 -d) && [ -n "$s" ] || '
        f'{{ echo "{BASE64_FAILED}" >&2; exit 127; }}; eval "$s"\''
    )
