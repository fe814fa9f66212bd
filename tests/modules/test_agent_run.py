"""Through the real agent: a program runs plainly and under `gpumon run` while
`gpumon modules PID` measures two of its steps. Same losses bit for bit, deepcopy and pickle of
the model after it work the same, and no hook of gpumon's is left on the model or in torch's
global tables (beyond the phases tracker's own, which the plain run has not)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

PROGRAM = textwrap.dedent("""
    import copy, json, pickle, sys, time
    import torch
    import torch.nn.modules.module as mm
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(int(sys.argv[1])):
        loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        time.sleep(0.03)
    model(torch.randn(1, 32))  # a module call after the last step
    out = {"losses": losses}
    for name, fn in (("deepcopy", lambda: copy.deepcopy(model)),
                     ("pickle", lambda: pickle.loads(pickle.dumps(model)))):
        try:
            fn()
            out[name] = "ok"
        except Exception as e:
            out[name] = type(e).__name__
    out["module_hooks"] = sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                              + len(m._backward_hooks) for m in model.modules())
    out["global_forward_hooks"] = len(mm._global_forward_hooks) + len(mm._global_forward_pre_hooks)
    print(json.dumps(out))
""")


def test_measured_run_equals_plain_run(tmp_path):
    prog = tmp_path / "train.py"
    prog.write_text(PROGRAM)
    steps = "160"
    env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_PHASES="0")
    plain = subprocess.run([sys.executable, str(prog), steps], capture_output=True, text=True,
                           timeout=120, env=env)
    assert plain.returncode == 0, plain.stderr
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "run", "--", sys.executable,
                          str(prog), steps], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        result = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and result is None:
            m = subprocess.run([sys.executable, "-m", "gpumon", "modules", str(p.pid),
                                "--steps", "2", "--json", "--wait", "60"],
                               capture_output=True, text=True, timeout=90, env=env)
            if m.returncode == 0:
                result = json.loads(m.stdout)
            else:
                time.sleep(0.3)  # the agent is not serving yet
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert result is not None and result["ok"], result
    assert len(result["step_time_s"]["measured"]) == 2
    rows = {r["path"]: r for r in result["modules"]}
    assert rows["0"]["params"] == (32 * 64 + 64) * 4
    assert p.returncode == 0, err
    measured, plain_out = json.loads(out.splitlines()[-1]), json.loads(plain.stdout)
    assert measured == plain_out  # losses bit for bit, copies, hooks
    assert measured["module_hooks"] == 0 and measured["global_forward_hooks"] == 0
