"""Attaching to a running Ray through Ray Client: a connection whose server process fails to
start on the head is tried again; an unreachable or refusing cluster is not; the error names
what failed on the server, not the first line of its traceback."""

from __future__ import annotations

import pytest

from launcher.errors import PreflightError
from launcher.orchestrate import ray_cluster

SERVER_TRACEBACK = (
    "Initialization failure from server:\n"
    "Traceback (most recent call last):\n"
    '  File "ray/util/client/server/proxier.py", line 770, in Datapath\n'
    "    raise RuntimeError(\n"
    "RuntimeError: Proxy failed to Connect to backend! Check `ray_client_server.err`\n"
)


class FakeRay:
    def __init__(self, errors: list[Exception]):
        self.errors = list(errors)
        self.inits: list[dict] = []
        self.shutdowns = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    def make(errors: list[Exception]) -> FakeRay:
        fake = FakeRay(errors)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.setattr(ray_cluster, "CLIENT_RETRY_WAIT_S", 0.0)
        monkeypatch.setattr(ray_cluster, "_alive_nodes", lambda: [])
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        return fake

    return make


def test_a_server_process_that_fails_to_start_is_tried_again(fake_ray):
    fake = fake_ray([ConnectionAbortedError(SERVER_TRACEBACK)])
    session = ray_cluster._attach([], "ray://198.18.0.10:10001", {})
    assert session.mode == "attach" and len(fake.inits) == 2 and fake.shutdowns == 1
    assert fake.inits[-1]["address"] == "ray://198.18.0.10:10001"


def test_three_failures_say_what_failed_on_the_server(fake_ray):
    fake = fake_ray([ConnectionAbortedError(SERVER_TRACEBACK)] * 3)
    with pytest.raises(PreflightError) as raised:
        ray_cluster._attach([], "ray://198.18.0.10:10001", {})
    assert len(fake.inits) == 3
    failed = "RuntimeError: Proxy failed to Connect to backend!"
    assert f"Initialization failure from server: {failed}" in str(raised.value)


@pytest.mark.parametrize(
    ("address", "error"),
    [
        ("ray://198.18.0.10:10001", ConnectionError("ray client connection timeout")),
        (
            "ray://198.18.0.10:10001",
            ConnectionAbortedError(
                "Initialization failure from server:\nRuntimeError: Failed to create runtime_env"
                " for Ray client server, it is caused by:\npip install failed"
            ),
        ),
        ("198.18.0.10:6379", ConnectionAbortedError(SERVER_TRACEBACK)),  # a Ray node's address
    ],
)
def test_an_unreachable_cluster_a_bad_runtime_env_or_a_nodes_address_is_not_tried_again(
    fake_ray, address, error
):
    fake = fake_ray([error])
    with pytest.raises(PreflightError, match=f"cannot attach to Ray at '{address}'"):
        ray_cluster._attach([], address, {})
    assert len(fake.inits) == 1
