"""A real Prometheus server (Debian's `prometheus` package) scrapes `gpumon export`, and its
query API returns gpumon_allocated_bytes for each rank. Skips, saying why, where the binary
is not installed (apt-get install prometheus)."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from polling import wait_for, wait_until

PROMETHEUS = shutil.which("prometheus") or (
    "/usr/bin/prometheus" if shutil.os.path.exists("/usr/bin/prometheus") else None)
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian: "
                                "apt-get install prometheus)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port: int, q: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def dashboard_queries() -> list[tuple[str, str]]:
    from pathlib import Path
    d = json.loads((Path(__file__).resolve().parents[2] / "contrib" / "grafana" /
                    "gpumon-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p["targets"]]


def readme_scrape_config() -> str:
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return text.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_prometheus_scrapes_every_rank(ranks, gpumon_dir, tmp_path):
    base = gpumon_dir.parent
    # (scripted step peaks and breakdowns too: every panel of the dashboard gets data)
    ranks.start(base, [0, 1, 2], 3, SLURM_JOB_ID="31337", GPUMON_SIM_EVENTS="1",
                GPUMON_PHASES="0")
    exp_port, prom_port = free_port(), free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "gpumon", "export", "--address",
                                 "127.0.0.1", "--port", str(exp_port), "--host", "node-a"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cfg = tmp_path / "prometheus.yml"
    # the README's lines, as they are, with this test's exporter for the nodes
    scrape = readme_scrape_config()
    assert '["gpu01:9808", "gpu02:9808"]' in scrape, scrape
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n" + scrape.replace(
        '["gpu01:9808", "gpu02:9808"]', f'["127.0.0.1:{exp_port}"]'))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def per_rank():
            try:
                res = query(prom_port, "gpumon_allocated_bytes")
            except OSError:
                return None
            return {r["metric"]["rank"]: (r["metric"], float(r["value"][1])) for r in res}
        got = wait_for(lambda: (g := per_rank()) and len(g) == 3 and g, timeout=60,
                       what="gpumon_allocated_bytes of 3 ranks in Prometheus")
        assert sorted(got) == ["0", "1", "2"]
        for rank, (labels, v) in got.items():
            # ("job_id", not "job": Prometheus keeps "job" for its scrape job and renames ours)
            assert labels["host"] == "node-a" and labels["job_id"] == "31337"
            assert labels["world_size"] == "3" and labels["local_rank"] == rank
            assert labels["gpu_uuid"].startswith("SIM-") and "pid" not in labels
            assert 1 << 30 < v < 24 << 30
        # the query language works on them: the imbalance across ranks, in one expression
        spread = query(prom_port, "max(gpumon_peak_allocated_bytes) - "
                                  "min(gpumon_peak_allocated_bytes)")
        assert float(spread[0]["value"][1]) > 0  # the simulated ranks differ (uneven batches)
        up = query(prom_port, 'up{job="gpumon"}')
        assert float(up[0]["value"][1]) == 1
        # every query of the Grafana dashboard runs and has data (its variables at "All")
        def empty_panels():
            return [(title, expr) for title, expr in dashboard_queries() if not query(
                prom_port, expr.replace("$host", ".*").replace("$job_id", ".*"))]
        wait_until(lambda: not empty_panels(), timeout=30, interval=0.5)
        empty = empty_panels()
        assert not empty, f"dashboard panels without data: {empty}"
        roles = query(prom_port, 'sum by (role) (gpumon_role_bytes)')
        assert {r["metric"]["role"] for r in roles} == {
            "parameters", "gradients", "optimizer_state", "activations", "allocator_cache",
            "non_pytorch"}
        steps = query(prom_port, 'gpumon_step_peak_bytes{exact="true"}')
        assert {r["metric"]["rank"] for r in steps} == {"0", "1", "2"}
        assert all(r["metric"]["phase"] for r in steps)
        n = query(prom_port, 'count(gpumon_allocated_bytes{host=~".*", job_id=~".*"})')
        assert float(n[0]["value"][1]) == 3
    finally:
        for p in (prom, exporter):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stderr.close()


def docs_dcgm_panel() -> dict:
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    part = text.split("### Joining DCGM's metrics", 1)[1]
    return json.loads(part.split("```json\n", 1)[1].split("```", 1)[0])


def test_dcgm_join_ranks_reporting_and_a_stopped_agent_going_stale(ranks, gpumon_dir, tmp_path):
    """One Prometheus scrapes gpumon and a DCGM-shaped endpoint (dcgm-exporter's metric,
    labels and units for the same GPUs):
    - the docs' panel query joins on UUID without label_replace: one result per GPU with
      DCGM's labels for its legend, worth DCGM's used bytes minus the ranks' reserved there;
    - the dashboard's "Ranks reporting" counts 2 ranks of 2 devices each as 2 (it said 4);
    - SIGSTOP one rank: its series leave within --stale-after and gpumon_agents counts the
      live one only (the exporter served its last figures forever); SIGCONT: it is back."""
    import http.server
    import os
    import signal
    import threading
    procs = ranks.start(gpumon_dir.parent, [0, 1], 2, LOCAL_RANK="", GPUMON_SIM_DEVICES="2")
    exp_port, dcgm_port, prom_port = free_port(), free_port(), free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "gpumon", "export", "--address",
                                 "127.0.0.1", "--port", str(exp_port), "--host", "node-a",
                                 "--stale-after", "3"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    body = [b""]

    class Dcgm(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body[0])

        def log_message(self, *a):
            pass
    dcgm = http.server.ThreadingHTTPServer(("127.0.0.1", dcgm_port), Dcgm)
    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                   f"  - job_name: gpumon\n    static_configs:\n"
                   f"      - targets: ['127.0.0.1:{exp_port}']\n"
                   f"  - job_name: dcgm\n    static_configs:\n"
                   f"      - targets: ['127.0.0.1:{dcgm_port}']\n")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def value(q):
        try:
            res = query(prom_port, q)
        except OSError:
            return None
        return float(res[0]["value"][1]) if res else None
    stopped = procs[1]
    try:
        wait_for(lambda: value("count(gpumon_allocated_bytes)") == 4, timeout=60,
                 what="2 ranks x 2 devices scraped")
        reporting = dict(dashboard_queries())["Ranks reporting"].replace(
            "$host", ".*").replace("$job_id", ".*")
        assert value(reporting) == 2
        # -- the DCGM join
        series = query(prom_port, "gpumon_reserved_bytes")
        assert all(r["metric"]["UUID"] == r["metric"]["gpu_uuid"] and
                   r["metric"]["Hostname"] == "node-a" for r in series)
        gpus = sorted({r["metric"]["UUID"] for r in series})
        assert len(gpus) == 2  # (both ranks use both simulated GPUs)
        fb_mib = {u: 40000 + 1000 * i for i, u in enumerate(gpus)}
        body[0] = ("# TYPE DCGM_FI_DEV_FB_USED gauge\n" + "".join(
            f'DCGM_FI_DEV_FB_USED{{gpu="{i}",UUID="{u}",device="nvidia{i}",'
            f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"}} {fb_mib[u]}\n'
            for i, u in enumerate(gpus))).encode()
        expr = docs_dcgm_panel()["targets"][0]["expr"]
        assert "label_replace" not in expr
        got = wait_for(lambda: (r := query(prom_port, expr)) and len(r) == 2 and r,
                       timeout=30, what="the join's two GPUs")
        assert {r["metric"]["modelName"] for r in got} == {"NVIDIA H100 80GB HBM3"}
        assert {r["metric"]["device"] for r in got} == {"nvidia0", "nvidia1"}
        # its value: DCGM's bytes minus that GPU's reserved, at one evaluation
        both = query(prom_port, f"({expr}) + on (UUID) sum by (UUID) (gpumon_reserved_bytes)")
        assert {r["metric"]["UUID"]: float(r["value"][1]) for r in both} == {
            u: mib * 1048576.0 for u, mib in fb_mib.items()}
        share = query(prom_port, "gpumon_allocated_bytes / on (UUID) group_left (modelName) "
                                 "(DCGM_FI_DEV_FB_USED * 1048576)")
        assert len(share) == 4 and all(0 < float(r["value"][1]) < 1 for r in share)
        # -- a stopped agent
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_for(lambda: value("gpumon_agents") == 1 and value("gpumon_stale_agents") == 1
                 and value("count(gpumon_allocated_bytes)") == 2, timeout=30,
                 what="the stopped rank left out")
        assert value(reporting) == 1
        assert value('count(gpumon_allocated_bytes{rank="1"})') is None
        # before it left, its age grew past the stale time: a dashboard can tell stuck
        assert value('max_over_time(gpumon_last_sample_age_seconds{rank="1"}[1m])') >= 2
        os.kill(stopped.pid, signal.SIGCONT)
        wait_for(lambda: value("gpumon_agents") == 2 and value(
            "count(gpumon_allocated_bytes)") == 4, timeout=30, what="the rank back")
    finally:
        try:
            os.kill(stopped.pid, signal.SIGCONT)
        except OSError:
            pass
        dcgm.shutdown()
        dcgm.server_close()
        for p in (prom, exporter):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stderr.close()
