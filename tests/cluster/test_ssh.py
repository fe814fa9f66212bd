"""`gpumon attach --hosts` through a real OpenSSH server on localhost: two "nodes" (two sshd
ports whose sessions see different GPUMON_DIRs), each with simulated ranks; `gpumon relay` at
the far end of each session."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from polling import wait_for

from gpumon import client
from gpumon.client.remote import ClusterTarget, ssh_node


@pytest.fixture
def two_nodes(ssh_nodes, ranks, tmp_path):
    """nodea: ranks 0, 1; nodeb: ranks 2, 3 (world 4), each node its own GPUMON_DIR."""
    bases = {"nodea": tmp_path / "node-a", "nodeb": tmp_path / "node-b"}
    procs = {}
    for (name, base), rs in zip(bases.items(), ([0, 1], [2, 3])):
        procs[name] = ranks.start(base, rs, 4, SLURM_JOB_ID="555")
        ssh_nodes.add(name, base)
    return ssh_nodes, bases, procs


def _cli(ssh_nodes, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gpumon", "attach", "--hosts", "nodea,nodeb",
                           "--ssh", ssh_nodes.ssh_cmd, "--remote-gpumon",
                           ssh_nodes.remote_gpumon, *args],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_once_lines_up_every_rank_of_every_node(two_nodes):
    ssh_nodes, _, procs = two_nodes
    r = _cli(ssh_nodes, "--once")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["HOST", "RANK", "PID", "DEV"]
    body = [x.split() for x in lines[1:5]]
    assert len(lines) == 6, r.stdout + r.stderr
    assert [(b[0], b[1], int(b[2])) for b in body] == [
        ("nodea", "0/4", procs["nodea"][0].pid), ("nodea", "1/4", procs["nodea"][1].pid),
        ("nodeb", "2/4", procs["nodeb"][0].pid), ("nodeb", "3/4", procs["nodeb"][1].pid)]
    # the imbalance across all ranks of all nodes names the heaviest and the lightest row
    unit = {"MiB": 1 << 20, "GiB": 1 << 30}
    peaks = {f"rank {b[1].split('/')[0]} on {b[0]}": float(b[8]) * unit[b[9]] for b in body}
    hi, lo = max(peaks, key=peaks.get), min(peaks, key=peaks.get)
    assert peaks[hi] > peaks[lo]  # the simulated ranks differ (uneven batches)
    assert lines[5].startswith("imbalance +"), lines[5]
    assert lines[5].index(hi) < lines[5].index(" vs ") < lines[5].index(lo), (lines[5], peaks)


def test_json_tags_every_line_with_host_pid_and_rank(two_nodes):
    ssh_nodes, _, procs = two_nodes
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", "--hosts", "nodea,nodeb",
                          "--ssh", ssh_nodes.ssh_cmd, "--remote-gpumon",
                          ssh_nodes.remote_gpumon, "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    want = {("nodea", procs["nodea"][0].pid, 0), ("nodea", procs["nodea"][1].pid, 1),
            ("nodeb", procs["nodeb"][0].pid, 2), ("nodeb", procs["nodeb"][1].pid, 3)}
    seen = set()
    try:
        end = time.monotonic() + 60
        while seen != want and time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                break
            m = json.loads(line)
            if m["type"] == "sample":
                seen.add((m["host"], m["pid"], m["rank"]))
                assert m["devices"][0]["allocated"] > 0
    finally:
        p.terminate()
        p.wait(10)
        p.stdout.close()
        p.stderr.close()
    assert seen == want


def _target(ssh_nodes, **kw):
    return ClusterTarget([ssh_node(n, ssh_nodes.ssh_cmd, ssh_nodes.remote_gpumon)
                          for n in ("nodea", "nodeb")], retry_s=0.3, retry_max_s=1.0, **kw)


def _serving(t):
    return sorted(k for k, m in t.members().items() if m.serving)


def test_a_node_that_drops_is_shown_and_reattached_while_the_other_streams(two_nodes):
    ssh_nodes, bases, procs = two_nodes
    t = _target(ssh_nodes)
    sub = t.subscribe()
    t.start()
    try:
        a = [f"nodea:{p.pid}" for p in procs["nodea"]]
        b = [f"nodeb:{p.pid}" for p in procs["nodeb"]]
        wait_for(lambda: _serving(t) == sorted(a + b), timeout=30, what="4 ranks serving")
        assert t.members()["nodeb:"].state == client.CONNECTED  # the node itself
        sub.drain()
        ssh_nodes.stop("nodeb")  # the node goes away: sshd and its sessions killed
        wait_for(lambda: t.members()["nodeb:"].state == client.UNREACHABLE, timeout=20,
                 what="nodeb shown unreachable")
        wait_for(lambda: all(t.members()[k].state == client.UNREACHABLE for k in b),
                 what="nodeb's ranks unreachable")
        line = t.members()[b[0]].line
        assert "on nodeb" in line and "reconnecting" in line
        # while it is away, a rank of it ends (it will not be there when the node returns)
        gone = procs["nodeb"][1]
        gone.kill()
        gone.wait(10)
        # the other node never stalls: its samples keep coming, ~10 Hz per rank
        sub.drain()
        time.sleep(2.0)
        per_key: dict = {}
        for _, m in sub.drain():
            if m["type"] == "sample":
                per_key[m["key"]] = per_key.get(m["key"], 0) + 1
        assert set(per_key) <= set(a) and all(per_key.get(k, 0) >= 10 for k in a), per_key
        # the node's own words come through while it cannot be reached
        wait_for(lambda: "refused" in t.members()["nodeb:"].line.lower(), timeout=15,
                 what="ssh's 'Connection refused' in the node's line")
        ssh_nodes.start("nodeb")
        wait_for(lambda: t.members().get(b[0]) and t.members()[b[0]].serving, timeout=30,
                 what="nodeb's rank 2 serving again")
        wait_for(lambda: t.members()[b[1]].state == client.EXITED, timeout=10,
                 what="the rank that ended meanwhile reported exited")
        assert "no longer there" in t.members()[b[1]].line
        assert t.members()["nodeb:"].state == client.CONNECTED
        assert all(t.members()[k].serving for k in a)
    finally:
        t.close()


def test_commands_go_through_to_each_node(two_nodes):
    ssh_nodes, bases, procs = two_nodes
    t = _target(ssh_nodes).start()
    try:
        keys = [f"nodea:{procs['nodea'][0].pid}", f"nodeb:{procs['nodeb'][1].pid}"]
        wait_for(lambda: all(k in _serving(t) for k in keys), timeout=30, what="serving")
        for k in keys:
            r = t.request(k, "reset_peaks")
            assert r == {"reset": [int(k.split(":")[1]) and (0 if "nodea" in k else 1)]}
        with pytest.raises(client.AgentError, match="unknown|no such|not"):
            t.request(keys[0], "no_such_command")
        # a snapshot: written on the node of its rank, the path comes back
        st = t.request(keys[1], "snapshot_start", {"who": "test"})
        assert st.get("recording") or st.get("state") or st, st
        res = t.request(keys[1], "snapshot_stop", {}, timeout=60)
        path = res.get("path")
        assert path and path.startswith(str(bases["nodeb"])), res
        import os
        assert os.path.getsize(path) > 0
        # a node that is down says so at once, without waiting for a timeout
        ssh_nodes.stop("nodea")
        wait_for(lambda: t.members()["nodea:"].state == client.UNREACHABLE, timeout=20,
                 what="nodea unreachable")
        t0 = time.monotonic()
        with pytest.raises(client.AgentError, match="nodea"):
            t.request(keys[0], "reset_peaks")
        assert time.monotonic() - t0 < 1.0
        assert t.request(keys[1], "reset_peaks") == {"reset": [1]}  # the other still works
    finally:
        t.close()


def test_an_unknown_host_is_one_line_and_status_1(ssh_nodes, tmp_path):
    ssh_nodes.add("nodea", tmp_path / "empty")
    r = subprocess.run([sys.executable, "-m", "gpumon", "attach", "--hosts", "nodea,nosuch.invalid",
                        "--ssh", ssh_nodes.ssh_cmd, "--remote-gpumon", ssh_nodes.remote_gpumon,
                        "--once", "--wait", "0"], capture_output=True, text=True, timeout=90,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpumon: host nosuch.invalid: "), r.stderr
    assert "Could not resolve" in err[0] or "not known" in err[0] or "resolve" in err[0]
    assert "no gpumon agents" in r.stdout  # nodea answered, with nothing on it


def test_the_users_ssh_config_is_used_proxyjump_included(two_nodes, tmp_path):
    """gpumon runs plain `ssh HOST`: what the user's config says applies. Here a host alias
    reaches node b only through node a (ProxyJump): its ranks come back under the alias, and
    with node a's sshd stopped the alias cannot be reached although node b's sshd is up."""
    ssh_nodes, _, procs = two_nodes
    cfg = tmp_path / "ssh_config_jump"
    b = ssh_nodes.nodes["nodeb"]["port"]
    cfg.write_text(f"Host viaa-to-b\n  HostName 127.0.0.1\n  Port {b}\n  ProxyJump nodea\n"
                   + ssh_nodes.config.read_text())
    ssh = f"{ssh_nodes.ssh} -F {cfg}"

    def once():
        return subprocess.run([sys.executable, "-m", "gpumon", "attach", "--hosts",
                               "viaa-to-b", "--ssh", ssh, "--remote-gpumon",
                               ssh_nodes.remote_gpumon, "--once", "--wait", "0"],
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    r = once()
    assert r.returncode == 0, r.stderr
    rows = [x.split() for x in r.stdout.splitlines()[1:3]]
    assert [(x[0], x[1], int(x[2])) for x in rows] == [
        ("viaa-to-b", "2/4", procs["nodeb"][0].pid), ("viaa-to-b", "3/4", procs["nodeb"][1].pid)]
    ssh_nodes.stop("nodea")  # the jump host goes: node b is up, but not reachable that way
    r = once()
    assert r.returncode == 1 and r.stderr.startswith("gpumon: host viaa-to-b: "), r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_hosts_job_follows_one_job_and_ends_when_every_rank_has(two_nodes, ranks):
    """--hosts --job 555: job 555's four ranks, not another job's rank on node a; once every
    rank has exited, --json ends by itself (it waited forever) with status 0, each node
    saying the job ended."""
    import threading
    ssh_nodes, bases, procs = two_nodes
    other = ranks.start(bases["nodea"], [0], 1, SLURM_JOB_ID="556")[0]
    r = _cli(ssh_nodes, "--job", "555", "--once")
    assert r.returncode == 0, r.stderr
    pids = [int(x.split()[2]) for x in r.stdout.splitlines()[1:] if x.startswith("node")]
    assert sorted(pids) == sorted(p.pid for ps in procs.values() for p in ps), r.stdout
    assert other.pid not in pids
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", "--hosts", "nodea,nodeb",
                          "--job", "555", "--ssh", ssh_nodes.ssh_cmd, "--remote-gpumon",
                          ssh_nodes.remote_gpumon, "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    watchdog = threading.Timer(90, p.kill)
    watchdog.start()
    try:
        seen = set()
        while len(seen) < 4:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            m = json.loads(line)
            if m["type"] == "sample":
                seen.add(m["pid"])
        t0 = time.monotonic()
        for ps in procs.values():
            for q in ps:
                ranks.stop(q)
        after = [json.loads(line) for line in p.stdout]  # until it ends by itself
        took = time.monotonic() - t0
        p.wait(10)
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
        err = p.stderr.read()
        p.stdout.close()
        p.stderr.close()
    assert p.returncode == 0, err
    assert took < 30, took
    states = [m for m in after if m.get("kind") == "state"]
    assert {m["pid"] for m in states if m["state"] == "exited"} == seen, states
    nodes = {m["host"]: m for m in states if m["pid"] is None}
    assert sorted(nodes) == ["nodea", "nodeb"] and all(
        m["state"] == "ended" and "every rank ended" in m["line"] for m in nodes.values()), nodes
    assert other.poll() is None  # the other job's rank was never touched
