"""The live straggler check: compute time over wall time, a window, a confirmation, node facts."""

from __future__ import annotations

from launcher.results.stragglers import StragglerWatch, node_differences


def feed(watch: StragglerWatch, steps: int, per_rank: dict[int, dict], start: int = 1) -> list:
    named = []
    for step in range(start, start + steps):
        for rank, extra in per_rank.items():
            record = {"type": "step", "step": step, "time": float(step), **extra}
            found = watch.add(rank, record)
            if found is not None:
                named.append((step, found))
    return named


def test_a_rank_computing_60_percent_longer_is_named_once_with_its_node():
    watch = StragglerWatch({0: "a", 1: "a", 2: "b"})
    named = feed(watch, 30, {0: {"compute_s": 0.1}, 1: {"compute_s": 0.1}, 2: {"compute_s": 0.16}})
    assert len(named) == 1
    step, found = named[0]
    assert (found.rank, found.node, found.compute) == (2, "b", True)
    assert round(found.slower_pct) == 60 and step <= 10
    assert found.line().startswith("straggler: rank 2 on node b, 60% slower than the median")


def test_waiting_ranks_equal_in_wall_time_are_no_stragglers():
    """Without compute_s every rank's wall time is the slow one's: nobody is named."""
    watch = StragglerWatch({0: "a", 1: "a"})
    assert feed(watch, 30, {0: {}, 1: {}}) == []


def test_wall_time_per_step_where_no_compute_time_is_reported():
    watch = StragglerWatch({0: "a", 1: "b"})
    named = feed(watch, 20, {0: {"interval_s": 1.0, "step_times_ms": [1]}, 1: {"interval_s": 1.5}})
    assert [(f.rank, f.compute) for _, f in named] == [(1, False)]


def test_a_brief_slowdown_is_not_named():
    watch = StragglerWatch({0: "a", 1: "a"})
    assert feed(watch, 10, {0: {"compute_s": 0.1}, 1: {"compute_s": 0.1}}) == []
    # two slow steps in a row, then back to normal: the window mean stays under the threshold
    assert feed(watch, 2, {0: {"compute_s": 0.1}, 1: {"compute_s": 0.3}}, start=11) == []


def test_what_differs_on_the_slow_node_among_its_preflight_facts():
    facts = {
        "a": {"driver": "550.1", "hostname": "a", "torch": {"cuda": "12.4"}},
        "b": {"driver": "550.1", "hostname": "b", "torch": {"cuda": "12.4"}},
        "c": {"driver": "535.2", "hostname": "c", "torch": {"cuda": "12.4"}},
    }
    assert node_differences(facts, "c") == ["driver 535.2 vs 550.1"]
    assert node_differences(facts, "a") == []
    watch = StragglerWatch({0: "a", 1: "b", 2: "c"}, facts)
    per_rank = {0: {"compute_s": 0.1}, 1: {"compute_s": 0.1}, 2: {"compute_s": 0.2}}
    (_, found), *_ = feed(watch, 20, per_rank)
    assert "node c differs in its preflight facts: driver 535.2 vs 550.1" in found.line()


def test_among_many_ranks_the_slow_one_is_named_against_the_round_median():
    watch = StragglerWatch({r: f"n{r // 8}" for r in range(32)})
    per_rank = {r: {"compute_s": 0.1} for r in range(32)}
    per_rank[19] = {"compute_s": 0.15}
    named = feed(watch, 20, per_rank)
    assert [(f.rank, f.node, round(f.slower_pct)) for _, f in named] == [(19, "n2", 50)]
