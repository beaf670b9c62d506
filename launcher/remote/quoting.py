"""Shell quoting for remote commands: one line any login shell hands to sh unchanged."""

from __future__ import annotations

import base64
import math
import re
import shlex

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
REMOTE_TIMEOUT_MARGIN_S = 2  # a remote command outliving its timeout by this stops itself


def remote_command(script: str, timeout: float | None) -> str:
    """What an SSH runner sends: ``script`` for sh. With a ``timeout``, under coreutils'
    ``timeout`` where the node has one that takes ``-k`` (else as it is): closing the channel
    when the launcher gives up does not stop a remote command, so it stops itself
    REMOTE_TIMEOUT_MARGIN_S later (SIGTERM to its process group, SIGKILL 5 s after)."""
    if timeout is None:
        return for_login_shell(script)
    limit = math.ceil(timeout) + REMOTE_TIMEOUT_MARGIN_S
    wrapper = (
        f"if timeout -k 1 5 true >/dev/null 2>&1; then exec timeout -k 5 {limit} sh -c {shlex.quote(script)}; "
        f"else exec sh -c {shlex.quote(script)}; fi"
    )
    return for_login_shell(wrapper)


# What a login shell other than sh does not keep as it is inside a single-quoted word: csh and
# tcsh end the command at a newline ("Unmatched '") and expand history at "!" ("Event not
# found"), also under -c; fish unescapes \\ and \'.
_LOGIN_SHELL_UNSAFE = re.compile(r"[\n\r!\\]")


# A node without `base64` (or whose `base64 -d` fails) must not run nothing and exit 0.
BASE64_FAILED = "launcher: base64 -d failed on this node"


def for_login_shell(script: str) -> str:
    """``sh -c`` running ``script``, as one line that any login shell (sh, bash, csh, tcsh,
    fish) passes to sh unchanged: quoted as it is where that is safe, else base64-encoded and
    decoded by sh itself (stdin is left to the script). Where the node cannot decode it (no
    ``base64``), sh prints BASE64_FAILED on stderr and exits 127 instead of running nothing."""
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
