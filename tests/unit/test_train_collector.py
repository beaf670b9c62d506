"""The trainer's manual garbage collection: freeze once, collect young generations on log steps,
restore the collector at the end."""

from __future__ import annotations

import gc

import pytest

from launcher.train.collector import ManualCollector


@pytest.fixture
def restore_gc():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_freezes_at_its_step_then_collects_only_on_log_steps(restore_gc, monkeypatch):
    gc.enable()
    collected: list[int] = []
    real_collect = gc.collect
    monkeypatch.setattr(
        gc, "collect", lambda generation=2: collected.append(generation) or real_collect(generation)
    )
    c = ManualCollector(enabled=True, freeze_at=3)
    for step in (1, 2):
        c.after_step(step, logged=step == 2)
    assert not c.frozen and gc.isenabled() and collected == []
    c.after_step(3, logged=False)
    assert c.frozen and not gc.isenabled() and gc.get_freeze_count() > 0 and collected == [2]
    c.after_step(4, logged=False)
    c.after_step(5, logged=True)
    assert collected == [2, 1]
    c.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not c.frozen
    c.close()  # twice is harmless
    assert gc.isenabled()


@pytest.mark.parametrize(("gc_on", "enabled"), [(True, False), (False, True)])
def test_the_collector_leaves_gc_as_it_found_it(restore_gc, gc_on: bool, enabled: bool):
    """A disabled collector touches nothing; an enabled one keeps an off collector off."""
    (gc.enable if gc_on else gc.disable)()
    c = ManualCollector(enabled=enabled, freeze_at=1)
    c.after_step(1, logged=True)
    if not enabled:
        assert gc.isenabled() and gc.get_freeze_count() == 0
    c.close()
    assert gc.isenabled() is gc_on and gc.get_freeze_count() == 0
