"""Running a program of tests/gpu/programs plainly and with gpumon, and reading gpumon's steps.

``run(mode, argv, ...)``: ``plain`` (no gpumon), ``run`` (``gpumon run -- python ...``) or
``start`` (the program calls ``gpumon.start()``: tests/compat/harness.py's ``start_if_asked``).
With gpumon, the program stops at ``wait_if_asked()`` (after CUDA is up) until a client is
connected, collects the agent's events as it trains, and stops again at ``wait_if_asked(".end")``
until the client has read ``phases_status``: every step gpumon reported is in the result. The
program prints the same with or without the stops (what the tests compare).

``same_lines(plain, again, got)``: what gpumon changed in the program's output, apart from
lines that differ between two plain runs (nondeterminism of the program itself, shown).

Shared by tests/gpu/test_counters_gpu.py (the GPU) and tests/phases/test_counters_program.py
(the same machinery on the fake CUDA allocator, in CI). By hand, on CPU (the Trainer: a minute on
2 cores, not in CI):  python tests/gpu/programs/plain_vs_gpumon.py trainer --device fake
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PROGRAMS = Path(__file__).resolve().parent
ROOT = PROGRAMS.parents[2]
# by path, not as tests.compat: "tests" is a namespace package here, which any regular package
# of that name in site-packages would shadow
if str(ROOT / "tests" / "compat") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "compat"))
from harness import clean_env, normal_stderr  # noqa: E402

from gpumon.agent.phases.tracker import PHASES_BUDGET  # noqa: E402


@dataclass
class Result:
    mode: str
    rc: int
    stdout: str
    stderr: str
    steps: dict = field(default_factory=dict)   # step number -> gpumon's step event
    status: dict | None = None                  # phases_status at the program's end
    seconds: float = 0.0

    def lines(self) -> list[str]:
        return self.stdout.splitlines()


def run(mode: str, args: list[str], workdir: Path, *, script: str, source: str = "torch",
        env: dict | None = None, timeout: float = 240.0) -> Result:
    """``python programs/SCRIPT ARGS`` in ``mode``; ``source``: the agent's memory source."""
    from gpumon import client
    workdir.mkdir(parents=True, exist_ok=True)
    e = clean_env(env)
    py = [sys.executable, str(PROGRAMS / script), *args]
    if mode == "plain":
        argv = py
    elif mode == "run":
        argv = [sys.executable, "-m", "gpumon", "run", "--rate", "20", "--", *py]
        e["GPUMON_SOURCE"] = source
    elif mode == "start":
        argv = py
        e["COMPAT_START"], e["COMPAT_SOURCE"] = "1", source
    else:
        raise ValueError(mode)
    e.setdefault("GPUMON_PHASES_BUDGET", "0")  # the replay's budget: every step (roles at peaks)
    go = workdir / f"go-{mode}"
    if mode != "plain":
        e["COMPAT_WAIT"] = str(go)
        for suffix in ("", ".ready", ".end", ".end.ready"):  # a run before in this folder
            Path(str(go) + suffix).unlink(missing_ok=True)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # never a full pipe
    t0 = time.monotonic()
    p = subprocess.Popen(argv, env=e, cwd=str(workdir), stdout=out, stderr=err, text=True)
    res = Result(mode, 0, "", "")
    try:
        if mode != "plain":
            _follow(p, go, res, client, timeout)
        rc = p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for f in (out, err):
            f.seek(0)
    res.rc, res.stdout, res.stderr = rc, out.read(), err.read()
    res.seconds = time.monotonic() - t0
    return res


def _wait_file(p: subprocess.Popen, path: Path, what: str, deadline: float) -> None:
    while not path.exists():
        if p.poll() is not None:
            raise AssertionError(f"the program ended (rc {p.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _follow(p, go: Path, res: Result, client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    _wait_file(p, Path(str(go) + ".ready"), "its first stop", deadline)
    while not client.discover(p.pid):
        assert time.monotonic() < deadline and p.poll() is None, "the agent never served"
        time.sleep(0.05)
    conn = client.AgentConnection.connect(client.discover(p.pid)[0])
    while True:
        try:
            if conn.request("phases_status").get("installed"):
                break
        except client.AgentError:  # asked before the extensions registered their commands
            pass
        assert time.monotonic() < deadline, "the phases tracker never installed"
        time.sleep(0.05)
    msgs: list = []

    def read() -> None:
        while True:
            try:
                m = conn.recv(timeout=timeout)
            except Exception:
                return
            if m is None:
                return
            msgs.append(m)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    go.touch()
    end = Path(str(go) + ".end")
    _wait_file(p, Path(str(end) + ".ready"), "its last stop", deadline)
    # the last step closes at the program's next hook (its final forward); its event goes out
    # with the next sample, and phases_status has it at once
    res.status = conn.request("phases_status", timeout=30)
    time.sleep(0.3)
    end.touch()
    p.wait(timeout=max(1.0, deadline - time.monotonic()))
    reader.join(timeout=10)
    conn.close()
    for m in list(msgs):
        if m.get("type") == "event" and m.get("kind") == "step":
            res.steps[m["step"]] = m
    for s in res.status.get("recent_steps") or []:
        res.steps.setdefault(s["step"], s)


def same_lines(plain: Result, again: Result, got: Result) -> tuple[list[str], int]:
    """(what differs in ``got``'s stdout and stderr from ``plain``'s, the number of stdout lines
    left out because two plain runs differ there already)."""
    diffs = []
    if got.rc != plain.rc:
        diffs.append(f"exit status {got.rc} (plain: {plain.rc})")
    a, b, c = plain.lines(), again.lines(), got.lines()
    if len(a) != len(b):
        diffs.append(f"two plain runs printed {len(a)} and {len(b)} lines")
    if len(c) != len(a):
        diffs.append(f"{len(c)} lines printed ({len(a)} plain)")
    unstable = 0
    for i, (la, lc) in enumerate(zip(a, c)):
        if i < len(b) and b[i] != la:
            unstable += 1
            continue
        if la != lc:  # where they part, and a little of both lines from there
            j = next((k for k, (x, y) in enumerate(zip(la, lc)) if x != y), min(len(la), len(lc)))
            diffs.append(f"stdout line {i + 1} from column {j}: {lc[max(0, j - 80):j + 80]!r} "
                         f"(plain: {la[max(0, j - 80):j + 80]!r})")
    sa, sc = normal_stderr(plain.stderr), normal_stderr(got.stderr)
    if sa != sc:
        diffs.append(f"stderr differs: added {[x for x in sc if x not in sa][:5]}, "
                     f"lost {[x for x in sa if x not in sc][:5]}")
    return diffs, unstable


# counters_view.py's probes: the phases gpumon may put the span ending at each (a span runs
# from the probe before; ties between spans widen the set, as gpumon's own phase peaks start
# at the value where the phase began)
SPAN_PHASES = {"start": {"other"}, "mid forward": {"forward"}, "after forward": {"forward"},
               # loss.backward() makes its grad seed before autograd reaches the model
               "mid backward": {"forward", "backward"}, "after backward": {"backward"},
               "mid optimizer": {"other", "optimizer"}, "optimizer end (hook)": {"optimizer"},
               "after step": {"optimizer", "other"}, "end": {"other"},
               "mid eval": {"other", "eval"}, "after eval": {"eval"}}
STEP_END = "optimizer end (hook)"


def reference_steps(stdout: str) -> list[tuple[int, set]]:
    """From counters_view.py --reference (reset after every probe): torch's own peak of each
    step as gpumon counts steps (from one optimizer step's end to the next; step 1 from its
    first forward), and the phases whose spans reached it."""
    import json
    steps: list = []
    spans: list = []
    started = False
    for line in stdout.splitlines():
        if not line.startswith("PROBE "):
            continue
        p = json.loads(line[6:])
        where = p["at"].split("/", 1)[-1]
        if where == "mid forward":
            started = True
        if not started or where not in SPAN_PHASES:
            continue
        spans.append((p["max_alloc"], SPAN_PHASES[where]))
        if where == STEP_END:
            peak = max(v for v, _ in spans)
            steps.append((peak, set().union(*(ph for v, ph in spans if v == peak))))
            spans = []
    return steps


# the replay at the agent's own budget (the runs above: every step): the steps it does not follow
# take their forward's start early (the counters only; the rest after the forward's launches)
SAMPLED = {"GPUMON_PHASES_BUDGET": str(PHASES_BUDGET)}


def check_counters_view(args: list[str], workdir: Path, steps: int, again: bool = True) -> dict:
    """counters_view.py ARGS plainly (twice, and once with --reference), under ``gpumon run``
    and with ``gpumon.start()``, all at once: the program prints the same with gpumon, and
    gpumon reported every step, exact, equal to torch's own peak of the step, in its phase.
    ``again=False``: one plain run (a deterministic fake allocator: nothing to rule out)."""
    jobs = {"plain": ("plain", args), "reference": ("plain", args + ["--reference"]),
            "run": ("run", args), "start": ("start", args),
            "sampled": ("run", args, SAMPLED)}
    if again:
        jobs["again"] = ("plain", args)
    res = run_all(jobs, workdir, "counters_view.py")
    plain = res["plain"]
    out = plain.stdout
    # 4 resets (a 5th, torch.accelerator's, where torch has it), the deprecated one warned
    assert out.count("\nRESET ") >= 4 and "FutureWarning" in out, out[-2000:]
    assert out.count("PROBE ") >= 9 * steps and out.count("SUMMARY| ") > 200
    ref = reference_steps(res["reference"].stdout)
    assert len(ref) == steps
    for k in ("run", "start", "sampled"):
        r = res[k]
        diffs, unstable = same_lines(plain, res.get("again", plain), r)
        print(f"{k}: {len(diffs)} differences, {unstable} lines differ between plain runs")
        assert not diffs, diffs[:10]
        assert unstable <= len(plain.lines()) // 20, unstable  # the comparison keeps its teeth
        assert sorted(r.steps) == list(range(1, steps + 1)), sorted(r.steps)
        for (peak, phases), (n, e) in zip(ref, sorted(r.steps.items())):
            print(f"{k} step {n}: gpumon {e['peak']} in {e['peak_phase']} (exact "
                  f"{e['peak_exact']}, {e['exact_note']}); torch {peak} in {sorted(phases)}")
            assert e["peak_exact"] is True and e["exact_note"] is None, e
            assert e["peak"] == peak and e["peak_phase"] in phases, (n, e["peak"], peak,
                                                                     e["peak_phase"], phases)
        assert "eval" in r.steps[11]["tags"]  # the eval pass after step 10's optimizer step
        c = r.status["counters"]
        assert c["boundaries"] >= 4 * steps and c["races"] == 0 and c["unseen_resets"] == 0, c
        assert r.status["counters_note"] is None, r.status
        # at the agent's own budget the replay follows one step in N (the first 3 always): the
        # others' forward starts are taken early (at budget 0 on a GPU it follows every step,
        # and none is; the fake allocator keeps no history to replay, so all are there)
        if k == "sampled":
            assert c["forward_starts_taken_early"] >= steps - 6, c
    # the batches make some steps peak in the optimizer step, others in backward
    got = {e["peak_phase"] for e in res["run"].steps.values()}
    assert "optimizer" in got and got & {"forward", "backward"}, got
    return res


def run_all(jobs: dict, workdir: Path, script: str) -> dict:
    """{name: (mode, args[, env])} run at once (a run waits mostly on its imports); each must exit 0."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(jobs)) as ex:
        futs = {k: ex.submit(run, job[0], job[1], workdir / k, script=script,
                             env=job[2] if len(job) > 2 else None)
                for k, job in jobs.items()}
        res = {k: f.result() for k, f in futs.items()}
    for k, r in res.items():
        assert r.rc == 0, (k, r.stderr[-3000:])
        print(f"{k}: {r.seconds:.1f} s, {len(r.lines())} lines")
    return res


# trainer_steps.py's points: the phases gpumon may put the span ending at each
POINT_PHASES = {"forward": {"forward"}, "backward": {"backward"}, "clip": {"other"},
                "optimizer": {"optimizer"}, "other": {"other"},
                "eval": {"eval", "other"}}  # an evaluation: eval forwards, the loop around them


def trainer_reference(stdout: str) -> list[tuple[int, set, dict]]:
    """Per step as gpumon counts them (from one optimizer step's end to the next): torch's own
    peak from the points the program printed (each the peak since the point before), the
    phases whose spans reached it, and each point's peak."""
    steps, spans = [], []
    for line in stdout.splitlines():
        if not line.startswith("POINT "):
            continue
        _, name, _step, peak, _alloc = line.split()
        spans.append((name, int(peak)))
        if name == "optimizer":
            top = max(v for _, v in spans)
            steps.append((top, set().union(*(POINT_PHASES[n] for n, v in spans if v == top)),
                          dict(spans)))
            spans = []
    return steps


def check_trainer(args: list[str], workdir: Path, steps: int, again: bool = True,
                  modes: tuple = ("run", "start")) -> dict:
    """trainer_steps.py ARGS plainly (twice) and with gpumon, all at once: the program's points
    are the same with gpumon (its view of the counters), and gpumon reported every step, exact,
    equal to torch's own peak of the step as the points give it, in its phase."""
    jobs = {"plain": ("plain", args), **{m: (m, args) for m in modes},
            "sampled": ("run", args, SAMPLED)}
    if again:
        jobs["again"] = ("plain", args)
    res = run_all(jobs, workdir, "trainer_steps.py")
    plain = res["plain"]
    ref = trainer_reference(plain.stdout)
    assert len(ref) == steps, plain.stdout[-2000:]
    assert plain.stdout.count("POINT eval ") >= steps // 10
    for m in modes + ("sampled",):
        r = res[m]
        diffs, unstable = same_lines(plain, res.get("again", plain), r)
        print(f"{m}: {len(diffs)} differences, {unstable} lines differ between plain runs")
        assert not diffs, diffs[:10]
        assert unstable <= len(plain.lines()) // 20, unstable
        assert sorted(r.steps) == list(range(1, steps + 1)), sorted(r.steps)
        for (peak, phases, spans), (n, e) in zip(ref, sorted(r.steps.items())):
            print(f"{m} step {n}: gpumon {e['peak']} in {e['peak_phase']} (exact "
                  f"{e['peak_exact']}, {e['exact_note']}, tags {e['tags']}); torch {peak} in "
                  f"{sorted(phases)}")
            assert e["peak_exact"] is True and e["exact_note"] is None, e
            assert e["peak"] == peak and e["peak_phase"] in phases, (n, e["peak"], peak,
                                                                     e["peak_phase"], phases)
            assert e["forwards"] == 1 and e["backwards"] == 1, e
            assert e["optimizers"] == ["AdamW"] and e["phases_note"] is None, e
            # each phase's own peak: the forward's and the optimizer step's are exactly a
            # point's span (the others share theirs with the Trainer's code around them)
            pp = e["devices"][0]["phase_peaks"]
            assert pp["forward"] >= spans["forward"] and pp["optimizer"] == spans["optimizer"], \
                (n, pp, spans)
        for n in range(11, steps + 1, 10):  # the evaluations after steps 10, 20, ...
            assert "eval" in r.steps[n]["tags"], (n, r.steps[n]["tags"])
        c = r.status["counters"]
        assert c["boundaries"] >= 4 * steps and c["races"] == 0 and c["unseen_resets"] == 0, c
        if m == "sampled":  # see check_counters_view
            assert c["forward_starts_taken_early"] >= steps - 6, c
    return res


def main(argv: list[str] | None = None) -> int:
    """A check by hand: python tests/gpu/programs/plain_vs_gpumon.py trainer --device fake
    --steps 12 (the Trainer on CPU takes a minute on 2 cores: not in CI)."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=("counters", "trainer"))
    ap.add_argument("--device", choices=("cuda", "fake"), default="fake")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args(argv)
    os.environ.setdefault("GPUMON_SIM_READY", "now")
    with tempfile.TemporaryDirectory() as d:
        args = ["--device", a.device, "--steps", str(a.steps)]
        if a.check == "counters":
            check_counters_view(args, Path(d), a.steps, again=a.device == "cuda")
        else:
            check_trainer(args, Path(d), a.steps, again=a.device == "cuda")
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
