"""The NVML-only path, through the client's fake NVML (its own interface): a process with no
agent shows what NVML says of it, in --once, --json and the view's stream."""
import subprocess
import sys
import time

from gpumon import client
from gpumon.client.nvml import FakeNvml, NvmlView

from .conftest import JsonLines, fake_nvml, gpumon, gpumon_popen


def _plain_python():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_nvml_view_shapes_what_the_fake_says(tmp_path):
    p = _plain_python()
    try:
        nv = FakeNvml({"gpus": [{"name": "A", "total": 100, "used": 60},
                                {"name": "B", "total": 200, "used": 10}],
                       "processes": {str(p.pid): {"1": 7}, "1": {"0": 50}}})
        v = NvmlView(p.pid, nv)
        h = v.hello()
        assert (h["source"], h["pid"], [d["name"] for d in h["devices"]]) == ("nvml", p.pid, ["B"])
        assert [g["name"] for g in h["gpus"]] == ["A", "B"]
        s = v.sample()
        assert [(d["index"], d["proc_used"], d["nvml_used"], d["nvml_total"], d["allocated"])
                for d in s["devices"]] == [(1, 7, 10, 200, None)]
        assert s["gpus"] == [[0, 60, 100], [1, 10, 200]]
        bad = FakeNvml({"error": "NVML unavailable: no driver"})
        assert bad.error == "NVML unavailable: no driver" and bad.gpus() == []
    finally:
        p.kill()
        p.wait()


def test_once_and_json_of_a_process_without_agent(tmp_path):
    p = _plain_python()
    try:
        nv = fake_nvml(tmp_path / "nvml.json", {p.pid: 3 << 30}, used=9 << 30)
        r = gpumon("attach", p.pid, "--once", env={"GPUMON_FAKE_NVML": nv})
        assert r.returncode == 0 and r.stderr == ""
        assert r.stdout.splitlines() == [
            f"pid {p.pid}: no gpumon agent in this Python process (NVML figures only); for the "
            f"full view start it with gpumon run -- CMD, GPUMON=1, or gpumon attach {p.pid} "
            "--inject",
            f"pid {p.pid} (NVML only)",
            "cuda:0  Fake H100  process 3.00 GiB  device used 9.00 GiB of 80.00 GiB"]
        a = gpumon_popen("attach", p.pid, "--json", env={"GPUMON_FAKE_NVML": nv})
        js = JsonLines(a)
        st = js.until(lambda m: m.get("kind") == "state")
        assert (st["state"], st["pid"]) == ("no_agent", p.pid)
        s = js.until(lambda m: m["type"] == "sample")
        assert s["source"] == "nvml" and s["pid"] == p.pid
        assert [(d["proc_used"], d["allocated"]) for d in s["devices"]] == [(3 << 30, None)]
        # NVML's figure moves (the fake file changes): the next samples follow
        fake_nvml(tmp_path / "nvml.json", {p.pid: 4 << 30}, used=9 << 30)
        js.until(lambda m: m["type"] == "sample" and m["devices"][0]["proc_used"] == 4 << 30,
                 what="the new figure")
        p.kill()
        ex = js.until(lambda m: m.get("kind") == "exit")
        assert ex["signal"] == 9
        js.rest()
        assert a.wait(30) == 0
    finally:
        p.kill()
        p.wait()


def test_states_of_what_is_not_a_gpumon_process():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        t = client.LocalTarget(sleeper.pid, nvml=FakeNvml({"gpus": []})).start()
        (m,) = t.members().values()
        t.close()
        assert m.state == client.NOT_PYTHON
        assert m.line == (f"pid {sleeper.pid} (sleep) is not a Python process, and no process "
                          "under it runs gpumon's agent (yet)")
    finally:
        sleeper.kill()
        sleeper.wait()
    t = client.LocalTarget(sleeper.pid).start()  # gone now
    assert [m.state for m in t.members().values()] == [client.NO_PROCESS] and t.ended
    t.close()


def test_once_on_a_process_that_is_not_python_is_one_line_and_fails():
    """A new user's `gpumon attach <pid of sleep> --once` printed an NVML block ("no reading of
    this process yet": NVML is not read for such a process) with status 0."""
    from .conftest import gpumon
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        t0 = time.monotonic()
        r = gpumon("attach", sleeper.pid, "--once")
        took = time.monotonic() - t0
        assert (r.returncode, r.stdout) == (1, ""), r
        assert took < 4.5, took  # it waited 5 s for a sample that never comes
        assert r.stderr == (f"gpumon: pid {sleeper.pid} (sleep) is not a Python process, and no "
                            "process under it runs gpumon's agent (yet)\n"), r.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
