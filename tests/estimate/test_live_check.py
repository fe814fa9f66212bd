"""`gpumon estimate --check PID` against a real agent process: a torch CPU model training with
the phases part's hooks, the simulated memory source (no CUDA here), a real socket and the real
CLI in another process. Parameters, gradients and optimizer state are measured exactly by the
agent, so those rows must agree with the estimate from the same config.json; the peak rows need
CUDA allocator figures (tests/gpu/test_estimate_gpu.py checks them on a GPU)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import polling
import pytest

from gpumon import client
from gpumon.estimate import Setup, arch_from_config, estimate
from gpumon.estimate.compare import Measured, compare_device, compare_live, render_comparison
from gpumon.estimate.core import DEFAULT_WORKSPACE_BYTES as WS  # noqa: E402

HERE = Path(__file__).resolve().parent
CFG = HERE.parent / "fixtures" / "configs"

PROG = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {here!r})
    import gpumon
    gpumon.start(rate_hz=20)
    import torch
    import torch.nn.functional as F
    from tiny_models import TinyLlama
    cfg = json.load(open({cfg!r}))
    torch.manual_seed(0)
    m = TinyLlama(cfg, "eager")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, cfg["vocab_size"], (2, 16))
    print("ready", flush=True)
    while True:
        if not {train}:          # an agent in a process that does not train
            time.sleep(0.2)
            continue
        out = m(ids)
        F.cross_entropy(out.float().view(-1, out.shape[-1]), ids.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep({pause})
""")


def wait_for(fn, timeout=60.0, what="condition"):
    return polling.wait_for(fn, timeout, 0.05, what)


def start(tmp_path, pause=0.05, train=True):
    cfg = json.loads((CFG / "llama-tiny.json").read_text())
    cfg["num_hidden_layers"] = 2
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    prog = PROG.format(here=str(HERE), cfg=str(cfg_path), pause=pause, train=train)
    env = dict(os.environ, GPUMON_SOURCE="simulated")
    env.pop("GPUMON", None)
    p = subprocess.Popen([sys.executable, "-c", prog], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    addrs = wait_for(lambda: client.discover(p.pid) or (p.poll() is not None and [None]), what="agent")
    if addrs == [None]:
        raise AssertionError(p.communicate()[1].decode()[-2000:])
    return p, cfg, cfg_path


def gpumon_cli(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "gpumon", "estimate", *argv], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def training(tmp_path):
    p, cfg, cfg_path = start(tmp_path)
    try:
        yield p, cfg, cfg_path
    finally:
        p.kill()
        p.wait()


def test_check_live_run_json(training, tmp_path):
    p, cfg, cfg_path = training
    r = gpumon_cli("--config", str(cfg_path), "--batch", "2", "--seq", "16", "--attn", "eager",
                   "--check", str(p.pid), "--timeout", "90", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    rows = {row["role"]: row for row in d["comparison"]["rows"]}
    n = arch_from_config(cfg).param_count()
    tiny = _tiny(cfg)
    n_tensors = len(list(tiny.parameters()))
    buffers = sum(b.numel() * b.element_size() for b in tiny.buffers())     # rotary inv_freq
    assert d["device"] == "cpu" and d["steps"] >= 2
    # the agent counts the modules' buffers with the parameters
    assert rows["parameters"]["estimate"] == 4 * n and rows["parameters"]["measured"] == 4 * n + buffers
    assert abs(rows["parameters"]["error_pct"]) < 0.001
    # the agent counts AdamW's 4-byte step counters too (CPU tensors, one per parameter)
    assert rows["optimizer_state"]["measured"] == 8 * n + 4 * n_tensors
    assert abs(rows["optimizer_state"]["error_pct"]) < 0.01
    assert rows["gradients"]["measured"] == rows["gradients"]["estimate"] == 4 * n   # end of the optimizer step
    assert d["comparison"]["phase"] == "optimizer"
    # no allocator figures from a CPU run: no peak, said so
    assert rows["peak"]["measured"] is None and d["comparison"]["peak_error_pct"] is None
    assert any("no allocator figures" in x for x in d["comparison"]["notes"])


def test_check_text_from_a_saved_estimate(training, tmp_path):
    p, cfg, cfg_path = training
    r = gpumon_cli("--config", str(cfg_path), "--batch", "2", "--seq", "16", "--attn", "eager", "--json")
    est = tmp_path / "est.json"
    est.write_text(r.stdout)
    r = gpumon_cli("--load", str(est), "--check", str(p.pid), "--timeout", "90")
    assert r.returncode == 0, r.stderr
    for needle in ("live check: pid", "parameters", "+0.0%", "optimizer state", "gradients",
                   "activations & temporaries", "peak allocated", "peak error: not measured"):
        assert needle in r.stdout, (needle, r.stdout)
    # every wait said as it changes (issue 32 item 8: 39.7 s without a word): each step
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"pid {p.pid}: ")]
    assert any("(0 of 2 so far" in x or "(1 of 2 so far" in x for x in lines), r.stderr
    assert any("(1 of 2 so far" in x for x in lines) or any("steps completed" in x
                                                              for x in lines), r.stderr


def _steps_done(pid: int) -> int:
    with client.connect(pid, timeout=5.0) as conn:
        return int(conn.request("phases_status", timeout=5.0).get("steps_done") or 0)


def test_check_of_a_run_long_under_way_says_each_wait_once(training, tmp_path):
    """A new user's try: attached 600 steps in, the check said "0 of 2 so far", then one line
    per step ("593 steps completed; ...": 19 lines in 5 s) until it gave up waiting for an
    unasked breakdown at the end of the peak phase (one in ~20 s). It now asks for them."""
    p, cfg, cfg_path = training
    wait_for(lambda: _steps_done(p.pid) >= 12, what="12 steps")
    r = gpumon_cli("--config", str(cfg_path), "--batch", "2", "--seq", "16", "--attn", "eager",
                   "--check", str(p.pid), "--timeout", "60")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"pid {p.pid}: ")]
    assert lines == [f"pid {p.pid}: 2 or more steps completed; waiting for a breakdown at the end "
                     "of the peak phase (optimizer)"], r.stderr
    assert "not seen in time" not in r.stdout, r.stdout  # the asked breakdown came
    assert "live check: pid" in r.stdout and "optimizer state" in r.stdout


def test_check_errors(tmp_path):
    est = gpumon_cli("--params", "1e6", "--json").stdout
    (tmp_path / "est.json").write_text(est)
    # a live process with no agent
    r = gpumon_cli("--load", str(tmp_path / "est.json"), "--check", str(os.getpid()))
    assert r.returncode == 1 and "no gpumon agent" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # no such process
    r = gpumon_cli("--load", str(tmp_path / "est.json"), "--check", "999999999")
    assert r.returncode == 1 and "no process" in r.stderr
    for bad in ('{"peak": 1}', '{"peak_bytes": 5, "live_phases": {"forward": 3}}', "[1, 2]"):
        (tmp_path / "bad.json").write_text(bad)
        r = gpumon_cli("--load", str(tmp_path / "bad.json"), "--check", "1")
        assert r.returncode == 1 and "not a gpumon estimate" in r.stderr, r.stderr
    (tmp_path / "bad.json").write_text("{truncated")
    r = gpumon_cli("--load", str(tmp_path / "bad.json"), "--check", "1")
    assert r.returncode == 1 and "is not JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_check_times_out_when_nothing_trains(tmp_path):
    p, cfg, cfg_path = start(tmp_path, train=False)
    try:
        r = gpumon_cli("--config", str(cfg_path), "--batch", "2", "--seq", "16", "--check", str(p.pid),
                       "--timeout", "3")
        assert r.returncode == 1 and "only 0 training step(s) completed" in r.stderr, r.stderr
    finally:
        p.kill()
        p.wait()


def _tiny(cfg):
    sys.path.insert(0, str(HERE))
    from tiny_models import TinyLlama
    return TinyLlama(cfg, "eager")


# --- compare_live on figures as a GPU run gives them ---------------------------------------------
@pytest.fixture(scope="module")
def qwen_est():
    from gpumon.estimate import load_config
    return estimate(Setup(arch=load_config(CFG / "qwen2.5-1.5b.json")[0], batch=2, seq=256, loss="mean"))


def test_live_phases_in_the_agents_vocabulary(qwen_est):
    lp = qwen_est.to_dict()["live_phases"]
    N = 1_543_714_304
    assert set(lp) == {"forward", "backward", "optimizer"}
    assert lp["optimizer"]["peak"] == qwen_est.peak_bytes == 20 * N + WS
    assert lp["forward"]["gradients"] == 0 and lp["backward"]["gradients"] == lp["optimizer"]["gradients"] == 4 * N
    assert lp["forward"]["peak"] < lp["backward"]["peak"] < lp["optimizer"]["peak"]
    assert max(v["peak"] for v in lp.values()) == qwen_est.peak_bytes


def test_compare_rows_against_a_measured_peak(qwen_est):
    N = 1_543_714_304
    m = Measured(peak=int(20.1 * N), peak_phase="optimizer", peak_step=2,
                 roles={"parameters": 4 * N, "gradients": 4 * N, "optimizer_state": 8 * N + 4 * 338,
                        "allocator_cache": 2 * 2**30, "non_pytorch": int(0.73 * 2**30)})
    c = compare_live(qwen_est.to_dict(), m)
    assert [r.role for r in c.rows] == ["parameters", "gradients", "optimizer_state", "activations", "peak",
                                        "allocator_cache", "non_pytorch"]
    act = c.row("activations")
    assert act.estimate == 4 * N + WS                       # the foreach temporaries + workspace
    assert act.measured == int(20.1 * N) - 16 * N - 4 * 338
    assert act.error_pct == pytest.approx(100 * (act.estimate - act.measured) / act.measured)
    assert "optimizer step temporaries" in act.note
    assert c.peak_error_pct == pytest.approx(100 * (qwen_est.peak_bytes - int(20.1 * N)) / int(20.1 * N))
    assert "(same phase)" in c.row("peak").note
    assert c.row("non_pytorch").note == "within the expected range"
    text = render_comparison(c)
    assert f"peak error: {c.peak_error_pct:+.1f}%" in text and "activations & temporaries" in text
    # 80 columns (the notes were on the rows' lines: ~130 columns), each note whole under its row
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    flat = " ".join(text.split())
    for r in c.rows:
        assert " ".join(r.note.split()) in flat, r.note
    i = next(k for k, x in enumerate(lines) if x.lstrip().startswith("activations & temporaries"))
    assert lines[i + 1].startswith("      estimate: optimizer step temporaries")


def test_compare_takes_a_breakdown_device_and_the_right_phase_end(qwen_est):
    N = 1_543_714_304
    # the run's peak in backward: gradients at the end of backward are all of them
    dev = {"index": 0, "run_peak": 21 * N, "run_peak_phase": "backward", "run_peak_step": 3,
           "peak_phase": "optimizer", "at_peak": {"parameters": 4 * N, "gradients": 4 * N, "optimizer_state": 8 * N},
           "now": {"parameters": 4 * N, "gradients": 0, "optimizer_state": 8 * N}}
    c = compare_device(qwen_est, dev, {"backward": {"parameters": 4 * N, "gradients": 4 * N,
                                                    "optimizer_state": 8 * N}})
    assert c.phase == "backward" and c.row("gradients").measured == 4 * N
    assert c.row("activations").measured == 5 * N
    assert c.row("activations").estimate == qwen_est.live_phases["backward"]["peak"] - 16 * N
    assert "(a different phase)" in c.row("peak").note
    # peak outside the modelled phases (e.g. a user's mark): rows at the estimate's peak phase, said so
    c = compare_device(qwen_est, {**dev, "run_peak_phase": "eval"})
    assert c.phase == "optimizer" and c.row("activations").measured is None
    assert any("'eval'" in n for n in c.notes)


@pytest.mark.parametrize("bad", [
    {"peak": 1}, [], None, {"peak_bytes": 1, "live_phases": {"forward": "x"}},
    {"peak_bytes": "1", "live_phases": {}},
    {"peak_bytes": 1, "live_phases": {p: {"peak": 1, "parameters": 1, "gradients": 1, "optimizer_state": None}
                                      for p in ("forward", "backward", "optimizer")}},
    {"peak_bytes": 1, "terms": [{"key": 1}], "live_phases": {p: {"peak": 1, "parameters": 1, "gradients": 1,
                                                                  "optimizer_state": 1}
                                                              for p in ("forward", "backward", "optimizer")}},
])
def test_compare_rejects_what_is_not_an_estimate(bad):
    with pytest.raises(ValueError, match="not a gpumon estimate"):
        compare_live(bad, Measured())


def test_compare_device_takes_the_breakdown_models_device(qwen_est):
    """The TUI's path: gpumon.model.breakdown folds the agent's events; compare its main device."""
    from gpumon.model.breakdown import BreakdownModel
    N = 1_543_714_304
    persistent = {"parameters": 4 * N, "gradients": 4 * N, "optimizer_state": 8 * N}
    model = BreakdownModel()
    model.feed({"type": "event", "kind": "breakdown", "step": 3, "phase": "optimizer", "devices": [{
        "index": 0, "now": dict(persistent, activations=0), "allocated": 16 * N, "reserved": 17 * N,
        "at_peak": dict(persistent, activations=int(4.1 * N), allocator_cache=2 * 2**30, non_pytorch=None),
        "peak": int(20.1 * N), "peak_phase": "optimizer", "peak_step": 2, "peak_exact": True,
        "run_peak": int(20.1 * N), "run_peak_phase": "optimizer", "run_peak_step": 2}]})
    c = compare_device(qwen_est, model.main_device())
    assert c.phase == "optimizer" and c.measured_phase == "optimizer"
    assert model.estimate_comparison() is None           # the model's own hook, without an estimate
    assert c.row("parameters").error_pct == 0.0 and c.row("gradients").error_pct == 0.0
    assert c.row("activations").measured == int(20.1 * N) - 16 * N
    assert c.row("allocator_cache").measured == 2 * 2**30
    assert c.peak_error_pct == pytest.approx(100 * (qwen_est.peak_bytes - int(20.1 * N)) / int(20.1 * N))


def test_at_run_peak_roles_are_used(qwen_est):
    N = 1_543_714_304
    dev = {"index": 0, "run_peak": 21 * N, "run_peak_phase": "backward", "run_peak_step": 2,
           "at_run_peak": {"parameters": 4 * N, "gradients": 4 * N, "optimizer_state": 8 * N},
           "now": {"parameters": 4 * N, "gradients": 0, "optimizer_state": 8 * N}}
    c = compare_device(qwen_est, dev)
    assert c.phase == "backward" and c.row("gradients").measured == 4 * N
    assert c.row("activations").measured == 5 * N


def test_max_memory_allocated_is_the_peak_plus_the_allocators_rounding(qwen_est):
    """The estimate counts the bytes requested; max_memory_allocated counts whole blocks. On the H100
    the sliding-window Mistral rows were exact in requested bytes and 1.7% under max_memory_allocated:
    the report gives that range, and a live check whose peak falls in it says so."""
    from gpumon.estimate.core import ALLOCATOR_ROUNDING, ESTIMATE_TOLERANCE
    from gpumon.estimate.report import render_text as render
    peak = qwen_est.peak_bytes
    lo, hi = qwen_est.allocated_range
    assert (lo, hi) == (int(peak * (1 - ESTIMATE_TOLERANCE)), int(peak * (1 + ALLOCATOR_ROUNDING[1])))
    # an estimate 0.02% over the requested peak, with max_memory_allocated equal to that peak
    # (two H100 rows): inside the range, not "outside"
    assert lo <= int(peak * 0.9998) and hi >= int(peak * 1.042)   # the H100's largest rounding: 4.2%
    assert qwen_est.nvml_range[1] >= hi * (1 + qwen_est.allocator_cache[1])
    d = qwen_est.to_dict()
    assert d["allocated_range"] == [lo, hi] or tuple(d["allocated_range"]) == (lo, hi)
    assert "requested" in d["predicts"]
    assert "adds the allocator's block rounding" in " ".join(render(qwen_est).split())
    inside = compare_live(d, Measured(peak=int(peak * 1.017), peak_phase="optimizer", peak_step=2, roles={}))
    assert "within the allocator's block rounding" in inside.row("peak").note
    beyond = compare_live(d, Measured(peak=int(peak * 1.06), peak_phase="optimizer", peak_step=2, roles={}))
    assert "rounding" not in beyond.row("peak").note
    under = compare_live(d, Measured(peak=int(peak * 0.99), peak_phase="optimizer", peak_step=2, roles={}))
    assert "rounding" not in under.row("peak").note


def test_a_run_without_a_peak_phase_is_read_at_the_end_of_the_estimates_peak_phase():
    """A CPU run has no allocator figures, so no peak phase: --check waits for the end of the
    estimate's peak phase (ready()), and must read the roles there, not the latest breakdown's
    `now` (which may be the end of `other`, after zero_grad: 0 B of gradients; seen once in CI
    as `assert 0 == 22582272`)."""
    from gpumon.estimate.compare import measured_from_device
    at_opt_end = {"params": 100, "grads": 100, "opt_state": 200}
    after_zero_grad = {"params": 100, "grads": 0, "opt_state": 200}
    dev = {"index": "cpu", "run_peak": None, "peak": None, "peak_phase": None,
           "now": after_zero_grad}
    m = measured_from_device(dev, {"optimizer": at_opt_end, "other": after_zero_grad},
                             fallback_phase="optimizer")
    assert m.roles == at_opt_end and m.peak_phase is None  # the phase is not claimed as measured
