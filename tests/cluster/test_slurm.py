"""`gpumon attach --slurm JOBID`: srun's command line and the job's nodes (unit tests), and a
real single-node Slurm (Debian's slurmctld and slurmd, started by the test with auth/none)
running a two-task job whose ranks have gpumon's agent; skipped, with the reason, where Slurm
is not installed or cannot be started here."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polling import wait_for, wait_until

from gpumon import client
from gpumon.client.remote import slurm_nodes, srun_node

ROOT = Path(__file__).resolve().parents[2]


# -- unit: the command lines -----------------------------------------------------------------------
def test_srun_command_line_one_task_on_one_node_beside_the_job():
    n = srun_node("4242", "gpu017", remote="/opt/venv/bin/gpumon")
    assert n.name == "gpu017" and n.via == "srun"
    assert n.argv == ["srun", "--jobid", "4242", "--overlap", "--nodes", "1", "--ntasks", "1",
                      "--nodelist", "gpu017", "--quiet", "/opt/venv/bin/gpumon", "relay",
                      "--host", "gpu017", "--job", "4242"]  # that job's processes only
    n = srun_node("7", "a", remote="python -m gpumon", jobs=["7", "6_1"])
    assert n.argv[-8:] == ["python", "-m", "gpumon", "relay", "--host", "a", "--job", "7,6_1"]


class FakeRun:
    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, argv, **kw):
        self.calls.append(argv)
        rc, out, err = self.answers[argv[0]]
        return subprocess.CompletedProcess(argv, rc, out, err)


def test_the_nodes_of_a_job_are_squeues_list_expanded_by_scontrol():
    run = FakeRun({"squeue": (0, "99 RUNNING gpu[001-002],gpu005\n", ""),
                   "scontrol": (0, "gpu001\ngpu002\ngpu005\n", "")})
    assert slurm_nodes("99", run=run) == ["gpu001", "gpu002", "gpu005"]
    assert run.calls[0] == ["squeue", "--noheader", "--jobs", "99", "--format", "%A %T %N"]
    assert run.calls[1] == ["scontrol", "show", "hostnames", "gpu[001-002],gpu005"]


@pytest.mark.parametrize("answer, said", [
    ((0, "", ""), "no Slurm job 99"),
    ((0, "99 PENDING \n", ""), "Slurm job 99 is pending, not running"),
    ((1, "", "slurm_load_jobs error: Invalid job id specified\n"),
     "no Slurm job 99 (squeue: slurm_load_jobs error: Invalid job id specified)"),
    # squeue's own prefix is not said twice ("squeue: squeue: error: ...")
    ((1, "", "squeue: error: Invalid user for SlurmUser root\n"),
     "squeue: error: Invalid user for SlurmUser root"),
])
def test_a_job_that_is_not_running_is_one_line(answer, said):
    with pytest.raises(client.AgentError) as e:
        slurm_nodes("99", run=FakeRun({"squeue": answer}))
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


@pytest.mark.parametrize("answer, said", [
    ((0, "99 RUNNING gpu01\n", ""), None),
    ((0, "99 COMPLETING gpu01\n", ""), "Slurm job 99 ended (completing)"),
    ((0, "", ""), "Slurm job 99 ended (finished, or not yours)"),
    ((1, "", "slurm_load_jobs error: Invalid job id specified\n"),
     "Slurm job 99 ended (squeue: slurm_load_jobs error: Invalid job id specified)"),
    # a controller that does not answer is no end: asked again later
    ((1, "", "slurm_load_jobs error: Unable to contact slurm controller\n"), None),
    # an array with an element still pending has not ended
    ((0, "100 COMPLETED gpu01\n101 PENDING \n", ""), None),
])
def test_the_job_watch_says_when_the_job_ended(answer, said):
    from gpumon.client.remote import slurm_watch
    assert slurm_watch("99", run=FakeRun({"squeue": answer}))() == said


@pytest.mark.parametrize("why, permanent", [
    ("srun: error: Unable to create step for job 5: Access/permission denied", True),
    ("srun: error: Unable to create step for job 5: Job/step already completing or completed",
     True),
    ("ssh: connect to host b port 22: Connection refused", False),
    ("ssh: Could not resolve hostname nosuch: Name or service not known", True),
    ("bash: line 1: gpumon: command not found", True),
    ("connection lost (ssh exited with status 255)", False),
    ("no word from the node for 15 s", False),
    ("gpumon: unrecognized arguments: --job 5 (see `gpumon relay --help`)", True),
])
def test_what_retrying_cannot_fix_is_not_retried(why, permanent):
    from gpumon.client.remote import is_permanent
    assert is_permanent(why) == permanent


def test_slurm_job_id_is_checked_and_without_slurm_one_line(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no squeue on the PATH
    r = subprocess.run([sys.executable, "-m", "gpumon", "attach", "--slurm", "12;rm", "--once"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("gpumon: --slurm '12;rm': a Slurm job id")
    r = subprocess.run([sys.executable, "-m", "gpumon", "attach", "--slurm", "12", "--once"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 1 and r.stderr == ("gpumon: squeue not found: --slurm needs "
                                              "Slurm's commands on this machine\n")
    r = subprocess.run([sys.executable, "-m", "gpumon", "attach", "--slurm", "12",
                        "--hosts", "a", "--once"], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 2 and "one or the other" in r.stderr
    for bad, said in ((["1", "--job", "5"], "--job goes with --hosts"),
                      (["--hosts", "a", "--job", "5;x"], "--job '5;x': one job id"),
                      (["--slurm", "7", "--job", "8"], "--slurm 7 follows job 7")):
        r = subprocess.run([sys.executable, "-m", "gpumon", "attach", *bad, "--once"],
                           capture_output=True, text=True, env=env, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith(f"gpumon: {said}"), (bad, r.stderr)


# -- a real single-node Slurm ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm(tmp_path_factory, monkeypatch):
    """slurmctld + slurmd on this machine (auth/none, one node named after this host), and
    SLURM_CONF pointing at them for every command of the test."""
    need = ["slurmctld", "slurmd", "srun", "sbatch", "squeue", "scontrol", "scancel"]
    missing = [c for c in need if not (shutil.which(c) or os.path.exists(f"/usr/sbin/{c}"))]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing; Debian: apt-get "
                    "install slurmctld slurmd slurm-client)")
    if os.geteuid() != 0:
        pytest.skip("a test Slurm needs root here (slurmd runs job steps as their user)")
    lib = [p for p in ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/slurm-wlm",
                       "/usr/lib64/slurm") if os.path.isdir(p)]
    if lib and not os.path.exists(os.path.join(lib[0], "auth_none.so")):
        pytest.skip("this Slurm has no auth/none plugin (a test cluster would need munge)")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    node = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=gpumontest
SlurmctldHost={node}(127.0.0.1)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SchedulerType=sched/builtin
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={max(8, os.cpu_count() or 2)} State=UNKNOWN
PartitionName=gpumon Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    import psutil

    def stepds():  # slurmstepd leaves its parent (it daemonises): found by name
        return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "slurmstepd"}
    stepd_before = stepds()
    daemons = []
    for exe in ("slurmctld", "slurmd"):
        path = shutil.which(exe) or f"/usr/sbin/{exe}"
        daemons.append(subprocess.Popen([path, "-D", "-f", str(conf)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, start_new_session=True))
    try:
        def idle():
            for p in daemons:
                if p.poll() is not None:
                    pytest.skip(f"Slurm did not start here: {p.args[0]}: "
                                f"{p.stderr.read().decode(errors='replace').strip()[-300:]}")
            r = subprocess.run(["sinfo", "--noheader", "--format", "%t"], capture_output=True,
                               text=True, timeout=10)
            return r.returncode == 0 and r.stdout.strip() == "idle"
        if not wait_until(idle, timeout=30, interval=0.2):
            pytest.skip("Slurm did not start here: its node never became idle "
                        f"({(d / 'slurmctld.log').read_text(errors='replace')[-300:]})")
        yield node
    finally:
        subprocess.run(["scancel", "--full", "--user", str(os.getuid())], capture_output=True,
                       timeout=10)
        wait_until(lambda: not subprocess.run(["squeue", "--noheader"], capture_output=True,
                                              text=True, timeout=10).stdout.strip(), timeout=10)
        for pid in stepds() - stepd_before:  # the steps of this test's jobs, if still there
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        for p in daemons:
            try:
                kids = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                kids = []
            p.terminate()
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for k in kids:
                try:
                    k.kill()
                except psutil.NoSuchProcess:
                    pass
            p.stderr.close()


JOB_RANK = ("import os, time\n"
            "os.environ['RANK'] = os.environ['SLURM_PROCID']\n"
            "os.environ['LOCAL_RANK'] = os.environ['SLURM_LOCALID']\n"
            "os.environ['WORLD_SIZE'] = os.environ['SLURM_NTASKS']\n"
            "import gpumon; gpumon.start()\n"
            "time.sleep(300)\n")


def test_attach_slurm_follows_a_two_task_job(slurm, gpumon_dir, tmp_path, monkeypatch):
    prog = tmp_path / "rank.py"
    prog.write_text(JOB_RANK)
    monkeypatch.setenv("GPUMON_SOURCE", "simulated")
    r = subprocess.run(["sbatch", "--parsable", "--ntasks", "2", "--output",
                        str(tmp_path / "job.out"), "--chdir", str(tmp_path), "--wrap",
                        f"srun --ntasks 2 {sys.executable} {prog}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    wait_for(lambda: len([p for p in client.scan().values() if p.state == "serving"]) == 2,
             timeout=60, what="the job's two ranks serving")
    cmd = [sys.executable, "-m", "gpumon", "attach", "--slurm", job, "--remote-gpumon",
           f"{sys.executable} -m gpumon"]
    r = subprocess.run(cmd + ["--once"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    rows = [x.split() for x in lines[1:3]]
    assert [(x[0], x[1]) for x in rows] == [(slurm, "0/2"), (slurm, "1/2")], r.stdout
    assert lines[3].startswith(("imbalance", "balanced")) or len(lines) == 3
    p = subprocess.Popen(cmd + ["--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL)
    seen = set()
    try:
        end = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                break
            m = json.loads(line)
            if m["type"] == "sample":
                seen.add((m["host"], m["rank"]))
    finally:
        p.terminate()
        p.wait(10)
        p.stdout.close()
        p.stderr.close()
    assert seen == {(slurm, 0), (slurm, 1)}
    # commands go both ways through srun: reset peaks, and a snapshot written on the node
    from gpumon.client.remote import ClusterTarget
    t = ClusterTarget([srun_node(job, slurm, remote=f"{sys.executable} -m gpumon")]).start()
    try:
        wait_for(lambda: len([k for k, m in t.members().items() if m.serving]) == 2,
                 timeout=30, what="both ranks through srun")
        key = sorted(k for k, m in t.members().items() if m.serving)[0]
        assert t.request(key, "reset_peaks") == {"reset": [t.members()[key].rank]}
        t.request(key, "snapshot_start", {"who": "test"})
        path = t.request(key, "snapshot_stop", {}, timeout=60).get("path")
        assert path and path.startswith(str(tmp_path)) and os.path.getsize(path) > 0, path
    finally:
        t.close()
    # the exporter on the node labels the ranks with the job
    r = subprocess.run([sys.executable, "-m", "gpumon", "export", "--once"],
                       capture_output=True, text=True, timeout=60)
    jobs = {line.split('job_id="')[1].split('"')[0] for line in r.stdout.splitlines()
            if line.startswith("gpumon_allocated_bytes{")}
    assert jobs == {job}


# -- two jobs of one user on one node; a job that ends; a job that is not yours ------------------
PLAIN_RANK = "import gpumon, time; gpumon.start(); time.sleep(300)\n"  # srun's variables only


def _sbatch(tmp_path, name, ntasks=2, *extra):
    prog = tmp_path / "plain_rank.py"
    prog.write_text(PLAIN_RANK)
    r = subprocess.run(["sbatch", "--parsable", "--ntasks", str(ntasks), "--job-name", name,
                        "--output", str(tmp_path / f"{name}.out"), "--chdir", str(tmp_path),
                        *extra, "--wrap", f"srun --ntasks {ntasks} {sys.executable} {prog}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _attach(job, *args, **kw):
    return [sys.executable, "-m", "gpumon", "attach", "--slurm", job, "--remote-gpumon",
            f"{sys.executable} -m gpumon", *args]


def test_slurm_shows_only_its_jobs_ranks_and_its_end(slurm, gpumon_dir, tmp_path, monkeypatch):
    """Two jobs of one user on one node, ranks started by plain srun (no torchrun: ranks
    from SLURM_PROCID/SLURM_NTASKS). --slurm J lists J's two ranks only; when J is cancelled,
    --json says so per rank and the node, and exits 0; the other job is untouched."""
    monkeypatch.setenv("GPUMON_SOURCE", "simulated")
    j1, j2 = _sbatch(tmp_path, "one"), _sbatch(tmp_path, "two")
    wait_for(lambda: len([p for p in client.scan().values() if p.state == "serving"]) == 4,
             timeout=60, what="the two jobs' four ranks serving")
    r = subprocess.run(_attach(j1, "--once"), capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    rows = [x.split() for x in r.stdout.splitlines() if x.startswith(slurm + " ")]
    assert [x[1] for x in rows] == ["0/2", "1/2"], r.stdout  # not 4 processes
    from gpumon.client import procs
    jobs = {procs.environ(int(x[2])).get("SLURM_JOB_ID") for x in rows}
    assert jobs == {j1}, (jobs, r.stdout)
    p = subprocess.Popen(_attach(j1, "--json"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL)
    watchdog = threading.Timer(90, p.kill)  # (a stream that never ends fails, not hangs)
    watchdog.start()
    try:
        lines = []
        while len({m["pid"] for m in lines if m["type"] == "sample"}) < 2:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            lines.append(json.loads(line))
        t0 = time.monotonic()
        subprocess.run(["scancel", j1], check=True, timeout=10)
        after = [json.loads(line) for line in p.stdout]  # until --json ends by itself
        took = time.monotonic() - t0
        err = p.stderr.read()
        p.wait(10)
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
    assert p.returncode == 0, err
    assert took < 30, took
    states = [m for m in after if m.get("kind") == "state"]
    ended_ranks = {m["rank"] for m in states if m["state"] == "exited"}
    assert ended_ranks == {0, 1}, states
    node = [m for m in states if m.get("host") == slurm and m["pid"] is None]
    assert node and node[-1]["state"] == "ended" and j1 in node[-1]["line"], node
    node_states = [m["state"] for m in lines + states if m.get("kind") == "state"
                   and m["pid"] is None]  # the node: not "unreachable" while it starts
    assert node_states == ["connecting", "connected", "ended"], node_states
    assert "unreachable" not in err and err.count("\n") <= 2, err  # no line per node per try
    # the other job runs on: its ranks are still served
    r = subprocess.run(_attach(j2, "--once"), capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and len([x for x in r.stdout.splitlines()
                                      if x.startswith(slurm + " ")]) == 2, r.stdout + r.stderr


def test_a_job_that_is_not_yours_is_one_line_not_retried(slurm, gpumon_dir, tmp_path,
                                                          monkeypatch):
    """srun into another user's job: "Access/permission denied" is said once and --json
    ends with status 1, instead of srun retried with back-off forever."""
    import pwd
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    monkeypatch.setenv("GPUMON_SOURCE", "simulated")
    job = _sbatch(tmp_path, "root-job", 1)
    wait_for(lambda: subprocess.run(["squeue", "--noheader", "--jobs", job, "--format", "%T"],
                                    capture_output=True, text=True).stdout.strip() == "RUNNING",
             timeout=30, what="the job running")
    import shutil
    import tempfile
    shared = Path(tempfile.mkdtemp(prefix="gpumon-slurm-conf-"))  # (pytest's folders are 0700)
    try:
        os.chmod(shared, 0o755)
        shutil.copy(os.environ["SLURM_CONF"], shared / "slurm.conf")
        os.chmod(shared / "slurm.conf", 0o644)
        env = dict(os.environ, HOME="/", GPUMON_DIR=str(shared / "gpumon"),
                   SLURM_CONF=str(shared / "slurm.conf"))
        r = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                            "--clear-groups", *_attach(job, "--json")], capture_output=True,
                           text=True, timeout=90, env=env, stdin=subprocess.DEVNULL, cwd="/")
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert r.returncode == 1, (r.returncode, r.stdout[-500:], r.stderr)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"gpumon: host {slurm}: "), r.stderr
    assert "denied" in err[0].lower() and "not retried" in err[0], err


def test_slurm_array_id_follows_every_running_element(slurm, gpumon_dir, tmp_path, monkeypatch):
    """--slurm ARRAYID: the ranks of every running element (one srun per node, through one
    element there, its relay following all of the array's); ARRAYID_TASK: that element only."""
    monkeypatch.setenv("GPUMON_SOURCE", "simulated")
    array = _sbatch(tmp_path, "arr", 1, "--array", "0-1")
    other = _sbatch(tmp_path, "other", 1)
    wait_for(lambda: len([p for p in client.scan().values() if p.state == "serving"]) == 3,
             timeout=60, what="two array elements and another job serving")
    from gpumon.client import procs

    def pids(spec):
        r = subprocess.run(_attach(spec, "--once"), capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr
        return {int(x.split()[2]) for x in r.stdout.splitlines() if x.startswith(slurm + " ")}
    both = pids(array)
    tasks = {procs.environ(p).get("SLURM_ARRAY_TASK_ID") for p in both}
    assert len(both) == 2 and tasks == {"0", "1"}, both
    # (Slurm gives the array's own id to one element: 1_1 is not "job 1", the whole array)
    one = pids(f"{array}_1")
    assert len(one) == 1 and procs.environ(next(iter(one))).get("SLURM_ARRAY_TASK_ID") == "1"
    assert not {p for p in both | one if procs.environ(p).get("SLURM_JOB_ID") == other}
