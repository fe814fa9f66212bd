"""The model is the user's: each operation a training program does with its model (victim.py)
gives the same printed result and exit status with gpumon (under `gpumon run`, with
gpumon.start(), after `gpumon inject`) as without it, and gpumon still reports the phases of
the training steps around it.

One victim process per mode runs every fast op (a line per op, compared line by line); the ops
that start processes (DDP and FSDP2 ranks, spawn workers, a loader without gpumon) run in the
slow test, plainly and under `gpumon run` (every rank gets its agent, as torchrun's would).
"""
from __future__ import annotations

import pytest

from harness import compare, inject_skip, run_mode

import victim

FAST_OPS = [op for op in victim.OPS if op not in victim.SLOW_OPS]
# ops whose root call may run inside a compiled frame (a compiled train step; model.compile()
# in place, whose Module._call_impl dynamo compiles or runs eagerly depending on its own state):
# there gpumon's hooks are compiled away, and each step it reports says so
COMPILED_AWAY = ("compile_train_step", "compile_inplace")
# ops whose training steps gpumon must see as forward + backward + optimizer steps
PHASED = [op for op in FAST_OPS if op not in COMPILED_AWAY]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = run_mode("plain", FAST_OPS, tmp_path_factory.mktemp("plain"))
    assert out.rc == 0, out.stderr[-3000:]
    assert [l.split(":", 1)[0] for l in out.lines()] == FAST_OPS
    return out


def phases_problems(report: dict | None, ops: list[str]) -> list[str]:
    """Ops whose training steps gpumon did not report as forward/backward/optimizer steps."""
    if not report or not report.get("gpumon"):
        return ["no report from gpumon inside the program"]
    bad = []
    for op in ops:
        steps = report["ops"].get(op, {}).get("steps") or []
        full = [s for s in steps if s["forwards"] >= 1 and s["backwards"] >= 1 and s["optimizers"]
                and {"forward", "backward", "optimizer"} <= set(s["phases"])]
        if len(full) < victim.STEPS - 1:  # the first may hold the previous op's tail
            bad.append(f"{op}: {steps}")
    return bad


def check_graphs(lines: list[str]) -> None:
    """The compiled ops compiled as they should, whoever ran them: one graph, no break."""
    got = dict(l.split(": ", 1) for l in lines)
    assert "explain_graphs=1 explain_breaks=0 graphs=[16] breaks=0 unique_minus_backend=0" \
        in got["compile"]
    assert got["compile_fullgraph"].startswith("graphs=[16, 16] breaks=0")  # + eval: no_grad
    assert got["compile_inplace"].startswith("graphs=[16] breaks=0")


@pytest.mark.parametrize("mode", ["run", "start", "inject"])
def test_model_operations_are_the_same_with_gpumon(plain, mode, tmp_path):
    if mode == "inject" and inject_skip():
        pytest.skip(inject_skip())
    got = run_mode(mode, FAST_OPS, tmp_path)
    assert compare(plain, got) == [], (got.notes, got.stderr[-2000:])
    check_graphs(got.lines())
    assert phases_problems(got.report, PHASED) == []
    # a training step compiled whole runs gpumon's hooks compiled away: it says so
    ts = got.report["ops"]["compile_train_step"]
    assert ts["steps"] == [] and ts["note"] and "compiled" in ts["note"], ts
    for s in got.report["ops"]["compile_inplace"]["steps"]:
        assert (s["forwards"] and s["backwards"]) or "compiled" in s["phases_note"], s
    # gpumon stepped aside for the strict export and was back for the very next step
    after_export = got.report["ops"]["export_strict"]["steps"][-victim.STEPS:]
    assert phases_problems({"gpumon": True, "ops": {"x": {"steps": after_export}}}, ["x"]) == []
    assert all(s["forwards"] == 1 and s["backwards"] == 1 for s in after_export), after_export


def test_plain_run_prints_what_the_table_expects(plain):
    """The reference itself: the copies equal the model, hooks as registered, graphs as one."""
    got = dict(l.split(": ", 1) for l in plain.lines())
    assert got["deepcopy"].startswith("same=True")
    assert "_forward_hooks=[]" in got["deepcopy"]
    assert got["pickle"].startswith("same=True")
    out = got["jit_script"].split()
    assert out[0].split("=")[1] == out[1].split("=")[1]  # scripted, saved and reloaded
    assert "fired=['pre', 'sub', 'post', 'bwd', 'pre', 'sub', 'post', 'bwd']" in got["user_hooks"]
    assert "after=_forward_pre_hooks=[]/_forward_hooks=[]" in got["user_hooks"]
    check_graphs(plain.lines())
    assert got["export_strict"].startswith("out=")  # exported, and trained on after it


@pytest.mark.parametrize("ops", [victim.SLOW_OPS])
def test_process_operations_are_the_same_under_gpumon_run(ops, tmp_path):
    ref = run_mode("plain", list(ops), tmp_path / "plain")
    assert ref.rc == 0, ref.stderr[-3000:]
    got = run_mode("run", list(ops), tmp_path / "run")
    # both sides' stderr: once (a loaded CI, 2026-12-06) the PLAIN run's stderr held an
    # exception and the two runs' FSDP2 losses differed; only gpumon's side was shown
    assert compare(ref, got) == [], {"gpumon": got.stderr[-2000:], "plain": ref.stderr[-2000:]}
    lines = dict(l.split(": ", 1) for l in got.lines())
    # the loader had no gpumon, and loaded what the trained model computes
    assert lines["save_load_elsewhere"].startswith("rc=0 loaded=") and " False " in \
        lines["save_load_elsewhere"]
    assert lines["spawn_worker"].startswith("rc=0")
    child, parent = (p.split("=")[1] for p in lines["spawn_worker"].split()[1:3])
    assert child == parent
    # every rank's agent saw its training steps
    for kind in ("ddp", "fsdp2"):
        if lines[kind].startswith("unavailable"):
            continue
        assert lines[kind].startswith("rc=[0, 0]")
        ranks = got.report["ranks"][kind]
        assert len(ranks) == 2
        for steps in ranks:
            full = [s for s in steps or [] if s["forwards"] >= 1 and s["backwards"] >= 1]
            assert len(full) >= victim.STEPS - 1, (kind, steps)
