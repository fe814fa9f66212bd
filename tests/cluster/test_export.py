"""`gpumon export`: the figures of every local agent as Prometheus metrics."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polling import wait_for, wait_until

import prometheus_client  # a dependency of gpumon-torch: no skip
from prometheus_client.parser import text_string_to_metric_families

from gpumon.cluster.export import ExportState, Exporter, job_of  # noqa: E402


def parse(text: str) -> dict:
    """{(sample name, frozenset(labels)): value}"""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def values(metrics: dict, name: str, label: str) -> dict:
    return {dict(k)[label]: v for (n, k), v in metrics.items() if n == name}


def _text(state: ExportState) -> str:
    reg = prometheus_client.CollectorRegistry(auto_describe=False)
    from gpumon.cluster.export import StateCollector
    reg.register(StateCollector(state))
    return prometheus_client.generate_latest(reg).decode()


def _hello(key, pid, rank, dev, source="simulated"):
    return {"type": "hello", "key": key, "pid": pid, "rank": rank, "local_rank": dev,
            "world_size": 4, "source": source,
            "devices": [{"index": dev, "name": "H200", "total": 140 << 30,
                         "uuid": f"GPU-{dev:04d}"}]}


def _sample(key, dev, allocated, reserved=None, proc_used=None, retries=0, ooms=0):
    return {"type": "sample", "key": key, "t": 1.0, "devices": [{
        "index": dev, "allocated": allocated, "reserved": reserved or allocated * 2,
        "active": allocated, "peak_allocated": allocated + 5, "peak_reserved": None,
        "peak_active": None, "inactive_split": 0, "segments": 3, "alloc_retries": retries,
        "ooms": ooms, "nvml_used": None, "nvml_total": 140 << 30, "proc_used": proc_used}]}


def test_figures_labels_roles_step_peak_and_counters():
    envs = {101: {"SLURM_JOB_ID": "4242"}, 102: {"SLURM_JOB_ID": "4242"}}
    st = ExportState(host="node7", environ=lambda pid: envs.get(pid, {}))
    st.apply(_hello("101", 101, 0, 0))
    st.apply(_hello("102", 102, 1, 1))
    st.apply(_sample("101", 0, 1000, 3000, proc_used=3500, retries=2, ooms=1))
    st.apply(_sample("102", 1, 2000, 4000, proc_used=4700))
    st.apply({"type": "event", "kind": "breakdown", "key": "101", "devices": [
        {"index": 0, "now": {"parameters": 400, "gradients": 100, "optimizer_state": 300,
                             "activations": 200, "allocator_cache": 2000,
                             "non_pytorch": None}}]})
    st.apply({"type": "event", "kind": "step", "key": "102", "step": 17, "devices": [
        {"index": 1, "peak": 3333, "peak_phase": "backward", "peak_exact": True}]})
    m = parse(_text(st))
    alloc = {(dict(k)["rank"], dict(k)["device"]): v for (n, k), v in m.items()
             if n == "gpumon_allocated_bytes"}
    assert alloc == {("0", "0"): 1000, ("1", "1"): 2000}
    labels = dict(next(k for (n, k) in m if n == "gpumon_allocated_bytes"))
    assert set(labels) == {"host", "rank", "local_rank", "world_size", "device", "gpu_uuid",
                           "job_id", "UUID", "Hostname"}  # no pid label by default
    # DCGM's spellings beside ours: a join with dcgm-exporter needs no label_replace
    assert labels["UUID"] == labels["gpu_uuid"] and labels["Hostname"] == labels["host"]
    assert labels["host"] == "node7" and labels["job_id"] == "4242"
    assert values(m, "gpumon_reserved_bytes", "rank") == {"0": 3000, "1": 4000}
    assert values(m, "gpumon_non_pytorch_bytes", "rank") == {"0": 500, "1": 700}
    assert values(m, "gpumon_peak_allocated_bytes", "rank") == {"0": 1005, "1": 2005}
    assert values(m, "gpumon_alloc_retries_total", "rank") == {"0": 2, "1": 0}
    assert values(m, "gpumon_ooms_total", "rank") == {"0": 1, "1": 0}
    roles = values(m, "gpumon_role_bytes", "role")
    assert roles == {"parameters": 400, "gradients": 100, "optimizer_state": 300,
                     "activations": 200, "allocator_cache": 2000, "non_pytorch": 500}
    (k, v), = [(dict(k), v) for (n, k), v in m.items() if n == "gpumon_step_peak_bytes"]
    assert (k["rank"], k["phase"], k["exact"], v) == ("1", "backward", "true", 3333)
    assert values(m, "gpumon_step", "rank") == {"1": 17}
    assert m[("gpumon_agents", frozenset({("host", "node7")}))] == 2
    # peak_reserved null: no series rather than a made-up 0
    assert not [1 for (n, _) in m if n == "gpumon_peak_reserved_bytes"]
    # TYPE lines: counters are counters
    text = _text(st)
    assert "# TYPE gpumon_ooms counter" in text or "# TYPE gpumon_ooms_total counter" in text
    assert "# TYPE gpumon_allocated_bytes gauge" in text


def test_members_that_end_are_removed_and_nvml_only_members_not_shown():
    st = ExportState(host="h", environ=lambda pid: {})
    st.apply(_hello("1", 1, 0, 0))
    st.apply(_sample("1", 0, 10))
    st.apply(_hello("2", 2, None, 0, source="nvml"))
    st.apply({"type": "sample", "key": "2", "devices": [{"index": 0, "allocated": None,
                                                         "proc_used": 5}]})
    assert values(parse(_text(st)), "gpumon_allocated_bytes", "rank") == {"0": 10}
    st.apply({"type": "state", "key": "1", "pid": 1, "state": "exited", "line": "x"})
    m = parse(_text(st))
    assert not [1 for (n, _) in m if n == "gpumon_allocated_bytes"]
    assert m[("gpumon_agents", frozenset({("host", "h")}))] == 0


def test_pid_label_where_asked_or_where_series_would_collide():
    st = ExportState(host="h", environ=lambda pid: {})
    for pid in (5, 6):  # two programs without RANK on the same GPU
        st.apply({**_hello(str(pid), pid, None, 0), "local_rank": None, "world_size": None})
        st.apply(_sample(str(pid), 0, pid * 100))
    st.apply(_hello("7", 7, 3, 1))
    st.apply(_sample("7", 1, 700))
    m = parse(_text(st))
    by_pid = {dict(k).get("pid"): v for (n, k), v in m.items() if n == "gpumon_allocated_bytes"}
    assert by_pid == {"5": 500, "6": 600, None: 700}
    st2 = ExportState(host="h", pid_label=True, environ=lambda pid: {})
    st2.apply(_hello("7", 7, 3, 1))
    st2.apply(_sample("7", 1, 700))
    assert values(parse(_text(st2)), "gpumon_allocated_bytes", "pid") == {"7": 700}


def test_job_from_slurm_or_kubernetes():
    assert job_of({"SLURM_JOB_ID": "12", "POD_NAME": "p"}) == "12"
    assert job_of({"POD_NAME": "trainer-0"}) == "trainer-0"
    assert job_of({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "trainer-1"}) == "trainer-1"
    assert job_of({"HOSTNAME": "laptop"}) == ""


def test_agents_coming_and_going_on_a_real_node(ranks, gpumon_dir):
    base = gpumon_dir.parent
    p0, p1 = ranks.start(base, [0, 1], 3, SLURM_JOB_ID="99")
    ex = Exporter(host="n1", interval=0.1).start()
    try:
        def alloc():
            return values(parse(ex.text().decode()), "gpumon_allocated_bytes", "rank")
        got = wait_for(lambda: (a := alloc()).keys() == {"0", "1"} and a, what="two ranks")
        assert all(0 < v < 24 << 30 for v in got.values()), got  # the simulated GPU's range
        job = {dict(k)["job_id"] for (n, k) in parse(ex.text().decode())
               if n == "gpumon_allocated_bytes"}
        assert job == {"99"}  # read from each rank's own environment
        ranks.stop(p1)
        wait_for(lambda: alloc().keys() == {"0"}, what="rank 1 removed")
        ranks.start(base, [2], 3)
        wait_for(lambda: alloc().keys() == {"0", "2"}, what="rank 2 added")
    finally:
        ex.close()


def test_textfile_is_written_atomically(ranks, gpumon_dir, tmp_path):
    base = gpumon_dir.parent
    ranks.start(base, [0, 1], 2)
    out = tmp_path / "textfile"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "gpumon", "export", "--textfile", str(out),
                             "--interval", "0.05", "--host", "tf"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reads, bad = [0], []
    stop = threading.Event()

    def reader():  # as node_exporter does: read whatever is there, at any moment
        f = out / "gpumon.prom"
        while not stop.is_set():
            try:
                text = f.read_text()
            except FileNotFoundError:
                continue
            reads[0] += 1
            try:
                parse(text)
            except Exception as e:  # pragma: no cover - the failure we look for
                bad.append(repr(e))
            if not text.endswith("\n") or "gpumon_agents" not in text:
                bad.append(text[-80:])
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        wait_for(lambda: (out / "gpumon.prom").exists() and values(
            parse((out / "gpumon.prom").read_text()), "gpumon_allocated_bytes", "rank").keys()
            == {"0", "1"}, what="both ranks in the textfile")
        time.sleep(1.0)
    finally:
        stop.set()
        t.join(5)
        proc.terminate()
        assert proc.wait(10) == 0, proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert reads[0] > 20 and not bad, bad[:3]
    # no temporary file left behind, and a service stop (SIGTERM) takes the textfile too
    assert sorted(os.listdir(out)) == []


def test_export_refuses_bad_options(tmp_path):
    def run(*a):
        return subprocess.run([sys.executable, "-m", "gpumon", "export", *a],
                              capture_output=True, text=True, timeout=30)
    r = run("--textfile", str(tmp_path / "nope"))
    assert r.returncode == 1 and r.stderr.startswith("gpumon: --textfile: no directory")
    assert r.stderr.count("\n") == 1
    r = run("--interval", "0")
    assert r.returncode == 2 and r.stderr.startswith("gpumon: --interval")
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        r = run("--address", "127.0.0.1", "--port", str(s.getsockname()[1]))
    finally:
        s.close()
    assert r.returncode == 1 and r.stderr.startswith("gpumon: cannot listen on 127.0.0.1:")
    assert r.stderr.count("\n") == 1


def test_stream_command_thins_one_clients_live_samples_only(gpumon_dir, ranks):
    """The exporter's connection asks for 2 samples a second; another client of the same
    agent keeps every one (the agent's rate is unchanged)."""
    from gpumon import client
    p, = ranks.start(gpumon_dir.parent, [0], 1)
    slow, fast = ([], [])

    def keep(into):
        return lambda m: into.append(m["t"]) if m and m.get("type") == "sample" else None
    addr = client.discover(p.pid)[0]
    a = client.AgentConnection.connect(addr, on_message=keep(slow))
    b = client.AgentConnection.connect(addr, on_message=keep(fast))
    try:
        r = a.request("stream", {"max_hz": 2.0})
        assert r["max_hz"] == 2.0 and r["rate_hz"] == 10.0
        with pytest.raises(client.AgentError, match="max_hz"):
            a.request("stream", {"max_hz": "fast"})
        slow.clear(), fast.clear()
        time.sleep(3.0)
        n_slow, n_fast = len(slow), len(fast)
    finally:
        a.close(), b.close()
    assert 20 <= n_fast <= 36, n_fast      # 10 Hz for 3 s
    assert 4 <= n_slow <= 8, n_slow        # 2 Hz for 3 s
    gaps = [y - x for x, y in zip(slow, slow[1:])]
    assert min(gaps) > 0.4, gaps           # evenly thinned, not bursts


DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "gpumon-dashboard.json"
# ranks whose scripted source also sends what the phase tracker sends (step peaks, breakdowns)
EVENTS = {"GPUMON_SIM_EVENTS": "1", "GPUMON_PHASES": "0"}


def dashboard_metric_names(d: dict) -> dict[str, set[str]]:
    """{metric name: the panels (and variables) whose queries use it}"""
    import re
    used: dict[str, set[str]] = {}
    for p in d["panels"]:
        for t in p["targets"]:
            for name in re.findall(r"\bgpumon_[a-z_]+", t["expr"]):
                used.setdefault(name, set()).add(p["title"])
    for v in d["templating"]["list"]:
        for name in re.findall(r"\bgpumon_[a-z_]+", v.get("definition", "")):
            used.setdefault(name, set()).add(f"${v['name']}")
    return used


def test_the_grafana_dashboard_uses_only_metrics_a_live_export_serves(ranks, gpumon_dir):
    """Every metric name in the dashboard's queries has samples in what a real `gpumon export`
    serves on /metrics, following real agents (step peaks and roles included): a renamed
    metric, or a panel on something the exporter never sends, fails here."""
    import json
    import socket
    import urllib.request
    d = json.loads(DASHBOARD.read_text())
    used = dashboard_metric_names(d)
    assert {"gpumon_allocated_bytes", "gpumon_role_bytes", "gpumon_step_peak_bytes",
            "gpumon_ooms_total", "gpumon_non_pytorch_bytes"} <= set(used), used
    ranks.start(gpumon_dir.parent, [0, 1], 2, **EVENTS)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gpumon", "export", "--address", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def served():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return set()
        return {n for (n, _) in parse(text)}  # names with samples (counters as *_total)
    try:
        wait_until(lambda: served() >= set(used), timeout=30, interval=0.5)
        names = served()
    finally:
        proc.terminate()
        proc.wait(10)
    missing = {n: sorted(used[n]) for n in used if n not in names}
    assert not missing, f"dashboard queries on metrics the export does not serve: {missing}"


def test_the_grafana_dashboard_is_self_contained():
    """Every ${variable} a query or datasource names is one of the dashboard's variables (an
    import asks for nothing it does not use), panels have unique ids and lie on the grid."""
    import json
    import re
    text = DASHBOARD.read_text()
    d = json.loads(text)
    variables = {v["name"] for v in d["templating"]["list"]}
    refs = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))
    assert refs <= variables, refs - variables
    assert not d.get("__inputs"), "an import input that nothing uses"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_a_silent_member_is_dropped_and_its_age_said():
    """A stopped agent's last figures were served forever; now each series has its age, and a
    member silent for longer than stale_s leaves the series and gpumon_agents."""
    now = [100.0]
    st = ExportState(host="h", environ=lambda pid: {}, stale_s=10.0, clock=lambda: now[0])
    for key, pid, rank in (("1", 1, 0), ("2", 2, 1)):
        st.apply(_hello(key, pid, rank, rank), 100.0)
        st.apply(_sample(key, rank, 1000 + rank), 100.0)
    now[0] = 108.0
    st.apply(_sample("1", 0, 1500), 108.0)
    m = parse(_text(st))
    assert values(m, "gpumon_last_sample_age_seconds", "rank") == {"0": 0.0, "1": 8.0}
    assert m[("gpumon_agents", frozenset({("host", "h")}))] == 2
    now[0] = 111.0  # rank 1 silent for 11 s
    m = parse(_text(st))
    assert values(m, "gpumon_allocated_bytes", "rank") == {"0": 1500}
    assert m[("gpumon_agents", frozenset({("host", "h")}))] == 1
    assert m[("gpumon_stale_agents", frozenset({("host", "h")}))] == 1
    st.apply(_sample("2", 1, 1700), 111.5)  # it speaks again: back
    m = parse(_text(st))
    assert values(m, "gpumon_allocated_bytes", "rank") == {"0": 1500, "1": 1700}
    assert m[("gpumon_agents", frozenset({("host", "h")}))] == 2
