"""Run a function on every node (or item) in threads, keeping each one's result or exception.

It never stops at the first failure. Interrupted, it returns at once, closing the runners
its threads made. ``Background`` runs one function beside the caller's work.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from launcher.remote.base import Runner, fan_out_scope
from launcher.spec.cluster import NodeSpec

T = TypeVar("T")


def fan_out(
    nodes: Sequence[NodeSpec], fn: Callable[[NodeSpec], T], max_parallel: int = 32
) -> dict[str, T | BaseException]:
    """Node name → ``fn(node)``'s result or the exception it raised, in node order, at most
    ``max_parallel`` at once. Interrupted, it stops the nodes' work and re-raises at once
    (see ``parallel_map``)."""
    outcomes = parallel_map(fn, nodes, max_parallel)
    return {node.name: outcome for node, outcome in zip(nodes, outcomes, strict=True)}


class _Scope:
    """The runners made in one ``parallel_map``'s threads, to close when it is interrupted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runners: list[Runner | _Scope] = []
        self.cancelled = False

    def add(self, runner: Runner | _Scope) -> None:
        with self._lock:
            self._runners.append(runner)
            cancelled = self.cancelled
        if cancelled:
            runner.close()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            runners = list(self._runners)
        for runner in runners:
            with contextlib.suppress(Exception):
                runner.close()

    close = cancel  # a fan-out's scope within another's (or a Background's) is cancelled with it


def parallel_map(
    fn: Callable[[Any], T], items: Sequence[Any], max_parallel: int = 32, *, grace_s: float = 0.0
) -> list[T | BaseException]:
    """``fn(item)`` for every item in daemon threads, at most ``max_parallel`` at once: each
    result or the exception it raised, in item order. Interrupted, it starts no more items,
    closes every runner made in its threads, gives them ``grace_s`` and raises again."""
    items = list(items)
    outcomes: list[Any] = [None] * len(items)
    if not items:
        return outcomes
    scope = _Scope()
    outer: _Scope | None = getattr(fan_out_scope, "scope", None)
    if outer is not None:  # called within a fan-out's thread or a Background
        outer.add(scope)
    lock = threading.Lock()
    queue = iter(range(len(items)))

    def work() -> None:
        fan_out_scope.scope = scope
        while True:
            with lock:
                index = None if scope.cancelled else next(queue, None)
            if index is None:
                return
            try:
                outcomes[index] = fn(items[index])
            except BaseException as err:  # noqa: BLE001 - every item's outcome is kept
                outcomes[index] = err

    threads = [
        threading.Thread(target=work, name=f"fan-out-{i}", daemon=True)
        for i in range(max(1, min(max_parallel, len(items))))
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        scope.cancel()
        deadline = time.monotonic() + grace_s
        for thread in threads:
            if thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        raise
    return outcomes


class Background(Generic[T]):
    """``fn()`` in a daemon thread while the caller does other work; ``result()`` returns or
    raises what it did, ``cancel()`` closes its runners as an interrupted fan-out does."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self.seconds = 0.0
        self._scope = _Scope()
        self._outcome: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        fan_out_scope.scope = self._scope
        started = time.monotonic()
        try:
            self._outcome.append(fn())
        except BaseException as err:  # noqa: BLE001 - raised again in the caller by result()
            self._outcome.append(err)
        finally:
            self.seconds = time.monotonic() - started

    @property
    def failed(self) -> bool:
        """``fn`` has ended with an exception."""
        return bool(self._outcome) and isinstance(self._outcome[0], BaseException)

    def result(self) -> T:
        self._thread.join()
        outcome = self._outcome[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def cancel(self, grace_s: float) -> None:
        self._scope.cancel()
        self._thread.join(grace_s)
