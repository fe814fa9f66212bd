"""The per-module report as clients show it: the tree and top list (gpumon/model/modules.py),
the breakdown model's copy, the exporter's bounded top-k, the command's refusals."""
from __future__ import annotations

import subprocess
import sys

import pytest

from gpumon.model.breakdown import BreakdownModel
from gpumon.model.modules import ModuleReport, render

KiB = 1024


def _row(path, typ="Linear", **kw):
    base = dict(path=path, type=typ, calls=1, params=0, buffers=0, grads=0,
                optimizer_state=0, act_at_peak=0, bwd_at_peak=0, fwd_retained=None,
                fwd_transient=None, bwd_transient=None)
    base.update(kw)
    return base


def _result(n_layers=3, device=0):
    mods = [_row("", "Model"), _row("model", "Inner")]
    for i in range(n_layers):  # model.layers (a ModuleList) never runs forward: no row
        mods.append(_row(f"model.layers.{i}", "Layer"))
        mods.append(_row(f"model.layers.{i}.mlp", params=(i + 1) * 100 * KiB,
                         grads=(i + 1) * 100 * KiB, optimizer_state=(i + 1) * 200 * KiB,
                         act_at_peak=10 * KiB, fwd_transient=40 * KiB))
    mods.append(_row("lm_head", act_at_peak=500 * KiB, bwd_at_peak=64 * KiB))
    parts = dict.fromkeys(("parameters", "buffers", "gradients", "optimizer_state",
                           "activations", "backward", "outside_forward", "outside_backward",
                           "optimizer_temporaries", "other", "before_step", "rounding"), 0)
    parts.update(parameters=600 * KiB, gradients=600 * KiB, optimizer_state=1200 * KiB,
                 activations=530 * KiB, backward=64 * KiB, rounding=512)
    return {"ok": True, "error": None, "t": 1.0, "device": device, "steps": 1, "exact": True,
            "note": None, "peak": sum(parts.values()), "peak_step": 1,
            "peak_phase": "backward", "peak_stack": ["", "lm_head"], "at_peak": parts,
            "modules": mods, "compiled": [],
            "step_time_s": {"before": 0.1, "measured": [0.12], "after": 0.1},
            "cost": {"hook_calls": 10, "entries": 100, "analysis_s": 0.01}}


def test_tree_sums_through_containers_and_depth():
    rep = ModuleReport.from_result(_result())
    inc = rep.inclusive()
    assert inc["model.layers"].params == 600 * KiB       # the ModuleList, never seen running
    assert inc["model"].optimizer_state == 1200 * KiB
    assert inc[""].act_at_peak == 530 * KiB and inc[""].bwd_at_peak == 64 * KiB
    tree = rep.tree(depth=2)
    assert max(d for d, _ in tree) == 2
    assert [r.path for d, r in tree if d == 1] == ["model", "lm_head"]  # largest first
    layers = [r.path for d, r in rep.tree(depth=3) if d == 3]
    assert layers == ["model.layers.2", "model.layers.1", "model.layers.0"]


def test_top_and_render():
    rep = ModuleReport.from_result(_result())
    assert [r.path for r in rep.top(2)] == ["model.layers.2.mlp", "model.layers.1.mlp"]
    assert rep.peak_module() == "lm_head"
    text = render(rep, depth=1, top=3)
    assert "running: (root) > lm_head" in text
    assert "optimizer state" in text and "allocator rounding" in text
    assert "top 3 modules" in text


def test_bad_results_refused():
    with pytest.raises(ValueError, match="cancelled"):
        ModuleReport.from_result({"ok": False, "error": "cancelled"})
    bad = _result()
    bad["modules"][2]["params"] = -1
    with pytest.raises(ValueError):
        ModuleReport.from_result(bad)


def test_breakdown_model_keeps_the_last_measurement():
    m = BreakdownModel()
    assert m.feed({"type": "event", "kind": "modules", **_result()})
    assert m.modules.peak_module() == "lm_head" and m.modules_error is None
    m.feed({"type": "event", "kind": "modules", "ok": False, "error": "cancelled"})
    assert m.modules_error == "cancelled" and m.modules is not None


def test_exporter_top_k_only():
    pytest.importorskip("prometheus_client")
    from gpumon.cluster.export import MODULE_TOP_K, ExportState, module_samples
    from tests.cluster.test_export import _hello, _sample, _text, parse
    big = _result(n_layers=40)
    st = ExportState(host="n", environ=lambda pid: {})
    st.apply(_hello("7", 7, 0, 0))
    st.apply(_sample("7", 0, 1000))
    st.apply({"type": "event", "kind": "modules", "key": "7", **big})
    got = parse(_text(st))
    mods = {dict(k)["module"] for (n, k) in got if n == "gpumon_module_bytes"}
    assert len(mods) == MODULE_TOP_K and "model.layers.39.mlp" in mods
    key = ("gpumon_module_bytes", frozenset({"host": "n", "rank": "0", "local_rank": "0",
                                             "world_size": "4", "device": "0",
                                             "gpu_uuid": "GPU-0000", "UUID": "GPU-0000",
                                             "Hostname": "n", "module": "lm_head",
                                             "part": "activations"}.items()))
    assert len(module_samples(big)) == 5 * MODULE_TOP_K
    st2 = ExportState(host="n", environ=lambda pid: {})
    st2.apply(_hello("7", 7, 0, 0))
    st2.apply(_sample("7", 0, 1000))
    st2.apply({"type": "event", "kind": "modules", "key": "7", **_result()})
    assert parse(_text(st2))[key] == 500 * KiB


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "17"], ["--depth", "-1"],
                                  ["--wait", "0"]])
def test_command_refuses_bad_arguments(argv):
    p = subprocess.run([sys.executable, "-m", "gpumon", "modules", "1", *argv],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("gpumon: ") and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [{"steps": True}, {"steps": 0}, {"steps": 17}, {"steps": "2"},
                                  {"steps": 2.0}, {"wait": -1}, {"wait": float("nan")},
                                  {"wait": 601}, {"wait": False}, {"wait": [1]}])
def test_agent_refuses_hostile_arguments(args):
    from gpumon.agent.modules import measure_args
    with pytest.raises(ValueError):
        measure_args(args)


def test_agent_takes_plain_arguments():
    from gpumon.agent.modules import measure_args
    assert measure_args({}) == (1, 120.0)
    assert measure_args(None) == (1, 120.0)
    assert measure_args({"steps": 16, "wait": 0}) == (16, 0.0)
