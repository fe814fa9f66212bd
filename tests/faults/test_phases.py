"""Issue 22, item 1: phases_breakdown, asked for back to back, killed the training program
with SIGSEGV (5 runs of 7; after 35 to 845 requests): the command read gradients and optimizer
state on the agent's thread while the training thread freed them. The phases part reads tensors
only on the training thread; this case asks as fast as the agent allows, from several clients,
during a real AdamW loop, and checks the program is unharmed."""
import threading
import time

from .harness import Raw, unharmed


def test_phases_breakdown_back_to_back_during_training_never_hurts_the_program(victims, tmp_path):
    v = victims(torch_loop=True, rate=10)
    end = time.monotonic() + 3.0
    answered = []

    def hammer(k):
        try:
            r = Raw(v.sock)
        except OSError:
            return
        n, mid = 0, 0
        while time.monotonic() < end:
            mid += 1
            try:
                rep = r.request("phases_breakdown", mid=mid, timeout=10)  # paced as told
            except (OSError, AssertionError):
                break  # the agent (or the program) went away
            n += bool(rep.get("ok"))
        answered.append(n)
        r.close()

    ts = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert v.alive(), f"the program died: status {v.proc.returncode}"
    assert sum(answered) >= 40, answered  # the case did ask, and was answered
    v.finish()
    ok, why = unharmed(v, tmp_path)
    assert ok, why


PROG = r'''
import json, os, sys, threading, time
import gpumon
from gpumon.agent.phases import roles
main = threading.get_ident()
seen = {"main": 0, "other": []}
orig = roles._device_key


def spy(t):  # called for every tensor the roles' walk reads
    if threading.get_ident() == main:
        seen["main"] += 1
    elif len(seen["other"]) < 20:
        seen["other"].append(threading.current_thread().name)
    return orig(t)


roles._device_key = spy
gpumon.start(source="simulated", rate_hz=50)
import torch
torch.manual_seed(0)
torch.set_num_threads(1)
m = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(20)])
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(8, 16)
print("ready", flush=True)
step = 0
while not os.path.exists(sys.argv[1]):
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    if step % 100 == 0:
        time.sleep(1.5)  # quiet after a step: the agent's sampler closes it (sample_extra)
print(json.dumps(seen), flush=True)
'''


def test_no_tensor_of_the_program_is_read_off_the_training_thread(tmp_path):
    """By construction, not by luck: every tensor the roles' walk reads is read on the
    training thread, whatever clients ask (breakdowns fresh and old, status, samples) and
    when the agent's sampler closes a step the program left quiet. On the code before the
    fix, phases_breakdown walked p.grad and the optimizer state on the agent's thread."""
    import json
    import os
    import subprocess
    import sys

    from .harness import ROOT
    stop = tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPUMON_SIM_READY="now")
    env.pop("GPUMON", None)
    p = subprocess.Popen([sys.executable, "-c", PROG, str(stop)], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()[-2000:]
        from gpumon.agent.core import socket_dir
        sock = socket_dir() / f"{p.pid}.sock"
        end = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < end:
            time.sleep(0.05)
        r = Raw(sock)
        n = 0
        end = time.monotonic() + 6.0  # covers several quiet pauses of the program
        while time.monotonic() < end:
            for cmd, args in (("phases_breakdown", {"wait": 0}), ("phases_breakdown", {"wait": 1}),
                              ("phases_status", {}), ("status", {}), ("sample", {})):
                n += 1
                rep = r.request(cmd, args, mid=n, timeout=20)
                assert rep.get("ok"), rep
        r.close()
        stop.touch()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and err == "", err[-2000:]
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["main"] > 0, seen  # the walk did run (on the training thread)
    assert seen["other"] == [], f"tensors read on other threads: {seen['other']}"
