"""What an SSH runner sends is run by the user's login shell (sshd: ``$SHELL -c``), which may be
csh or tcsh: the command must reach sh unchanged there too, multi-line scripts (the bootstrap's
port check) and "!" included. Run here under each shell that this machine has, as sshd would."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from launcher.errors import PreflightError
from launcher.orchestrate import ray_cluster
from launcher.remote import CommandResult, remote_command
from launcher.spec import ClusterSpec

pytestmark = pytest.mark.processes  # starts processes: not in `just test-fast`

SHELLS = [
    pytest.param(
        name, marks=pytest.mark.skipif(shutil.which(name) is None, reason=f"no {name} here")
    )
    for name in ("sh", "bash", "tcsh", "csh")
]


def login_shell(
    shell: str, command: str, *, stdin: str = "", timeout: float | None = None, **env: str
) -> CommandResult:
    """``command`` as an SSH runner sends it, run as sshd does with ``shell`` as login shell
    (``env``: variables to set)."""
    sent = remote_command(command, timeout)
    assert "\n" not in sent and "\r" not in sent and "!" not in sent, sent
    proc = subprocess.run(
        [shutil.which(shell) or shell, "-c", sent],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    return CommandResult(proc.stdout, proc.stderr, proc.returncode)


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_scripts_reach_sh_unchanged_under_any_login_shell(shell, timeout):
    script = (
        "printf '%s\\n' \"$0\" 'a!b' 'back\\slash' \"it's\"\nx=$(cat)\necho \"stdin: $x\"; exit 7"
    )
    result = login_shell(shell, script, stdin="from stdin", timeout=timeout)
    expected = "sh\na!b\nback\\slash\nit's\nstdin: from stdin\n"
    assert (result.stdout, result.exit_code) == (expected, 7), result
    # one-line scripts without such characters are sent as they are (readable in ps and logs)
    assert remote_command("echo hi", None) == "sh -c 'echo hi'"
    assert remote_command("\n\n", None) == "sh -c ''"  # newlines only: nothing to run, no base64


@pytest.mark.parametrize("shell", SHELLS)
def test_the_bootstraps_commands_run_under_any_login_shell(shell, tmp_path, monkeypatch):
    """The head's port check (a multi-line Python program) and token file, as ``_start_ray``
    sends them: the token lands in the file, and a taken GCS port is still refused."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    node = {"name": "node0", "host": "198.18.250.10", "python": sys.executable}
    cluster = ClusterSpec.model_validate({"nodes": [node], "ray": {"port": port}})
    ran: list[str] = []

    def on_node(cluster, node, command, *, stdin=None, timeout):
        ran.append(command)
        return login_shell(shell, command, stdin=stdin or "", timeout=timeout, HOME=str(tmp_path))

    monkeypatch.setattr(ray_cluster, "_on_node", on_node)
    # The check for another Ray (tested in test_ray_bootstrap_nodes.py) scans this machine's
    # processes: a raylet running here must not fail this test.
    monkeypatch.setattr(ray_cluster, "_OTHER_RAY", "pass")
    monkeypatch.setattr(ray_cluster, "_ray_cli", lambda cluster, node, args: "")
    monkeypatch.setattr(ray_cluster, "stop_ray", lambda cluster, nodes, addresses: [])
    session = ray_cluster.RaySession(
        mode="bootstrap",
        address="ray://127.0.0.1:10001",
        node_ips={"node0": "127.0.0.1"},
        _cluster=cluster,
        _head_ip="127.0.0.1",
        _token="t" * 64,
    )
    token = tmp_path / ".ray" / "launcher_auth_token"

    session._start_ray(cluster.nodes[0], head=True)  # nothing listens yet
    assert "\n" in ran[0]  # the multi-line port check is what is sent
    assert token.read_text() == "t" * 64 and token.stat().st_mode & 0o777 == 0o600

    token.unlink()
    listener.listen()
    try:
        with pytest.raises(PreflightError, match=f"port {port} on the head node 'node0'"):
            session._start_ray(cluster.nodes[0], head=True)
    finally:
        listener.close()
    assert not token.exists()


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_node_without_base64_is_an_error_not_a_silent_success(shell, timeout, tmp_path):
    """A script that travels base64-encoded, on a node where ``base64`` is missing: exit 127 and
    a message on stderr, not nothing run and exit 0. Plain commands need no base64."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sh", shell):  # only these on PATH: no base64, no coreutils' timeout
        if not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(os.path.realpath(shutil.which(name) or name))
    made, sh = tmp_path / "made", str(bin_dir / shell)
    for base64 in ("missing", "decoding nothing and exiting 0"):
        if base64 != "missing":
            fake = bin_dir / "base64"
            fake.write_text(f"#!{os.path.realpath(shutil.which('sh') or 'sh')}\nexit 0\n")
            fake.chmod(0o755)
        script = f"echo 'not run!' > {made}\nexit 0"
        result = login_shell(sh, script, timeout=timeout, PATH=str(bin_dir))
        assert result.exit_code == 127, (base64, result)
        assert "launcher: base64 -d failed on this node" in result.stderr, (base64, result)
        assert not made.exists()
    result = login_shell(sh, f"echo plain > {made}; exit 5", timeout=timeout, PATH=str(bin_dir))
    assert (result.exit_code, made.read_text()) == (5, "plain\n"), result  # sent as it is
