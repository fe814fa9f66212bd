"""The loop-cost estimator of benchmarks/sampler_cost.py, on synthetic runs where the answer is
known: it must find a cost charged to steps that overlap a sampling window, find nothing when
there is none (despite the length bias: long steps overlap more windows), and survive drift."""
import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sampler_cost():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("sampler_cost",
                                                      ROOT / "benchmarks" / "sampler_cost.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def synthetic_run(cost_s: float, seconds: float = 120.0, rate: float = 10.0, seed: int = 1):
    """Steps of ~8 ms (sd 2 ms, plus a slow drift of +-2 ms); a 250 us sampling window every
    1/rate s; a step that overlaps a window takes cost_s longer."""
    rng = random.Random(seed)
    period = 1.0 / rate
    wins = [(k * period + 0.0123, k * period + 0.0123 + 250e-6, True)
            for k in range(int(seconds * rate))]
    starts = [w[0] for w in wins]
    steps, t = [], 0.0
    import bisect
    while t < seconds - 0.2:
        d = max(1e-3, rng.gauss(8e-3, 2e-3) + 2e-3 * ((t / 30.0) % 2 - 1))
        i = bisect.bisect_right(starts, t + d) - 1
        if i >= 0 and wins[i][1] >= t:
            d += cost_s
        steps.append((t, t + d))
        t += d
    return steps, wins, period


def test_finds_the_cost_charged_to_touched_steps(sampler_cost):
    steps, wins, period = synthetic_run(300e-6)
    r = sampler_cost.attribute(steps, wins, period)
    assert r["per_sample_us"] == pytest.approx(300, abs=max(60, r["per_sample_ci"]))
    truth = 300e-6 * r["touched"] / (r["seconds"] - 300e-6 * r["touched"])
    assert abs(r["overhead"] - truth) <= r["overhead_ci"]
    assert abs(r["null"]) <= 2 * r["null_ci"]


def test_finds_nothing_where_there_is_nothing(sampler_cost):
    for seed in (1, 2, 3):
        steps, wins, period = synthetic_run(0.0, seed=seed)
        r = sampler_cost.attribute(steps, wins, period)
        assert abs(r["overhead"]) <= 2 * r["overhead_ci"], r
        # the naive comparison (touched steps against all the others) is biased upward
        durs = [b - a for a, b in steps]
        hit = sampler_cost.touched(steps, [(w0, w1) for w0, w1, _ in wins])
        on = [d for d, h in zip(durs, hit) if h]
        off = [d for d, h in zip(durs, hit) if not h]
        assert sum(on) / len(on) > sum(off) / len(off)
