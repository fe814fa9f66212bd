"""The three ways an agent starts (gpumon.start(), `gpumon run`, GPUMON=1 + the .pth line), and
that a process which never uses CUDA never shows up."""
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from gpumon import client
from gpumon.agent import bootstrap

from .conftest import gpumon_cmd, wait_for

ROOT = Path(__file__).resolve().parents[2]


def popen(args, env=None, **kw):
    e = dict(os.environ)
    e.pop("GPUMON", None)
    e.pop("GPUMON_SOURCE", None)
    e.update(env or {})
    return subprocess.Popen(args, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture
def procs():
    ps = []
    yield ps
    for p in ps:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


def run_cmd(*cmd):
    return [sys.executable, "-m", "gpumon", "run", "--", *cmd]


def test_gpumon_run_starts_an_agent_in_the_python_child(procs):
    # exec: the command keeps gpumon run's pid, so `gpumon attach <that pid>` just works.
    p = popen(run_cmd(sys.executable, "-c", "import time; time.sleep(60)"),
              env={"GPUMON_SOURCE": "simulated"})
    procs.append(p)
    (addr,) = wait_for(lambda: client.discover(p.pid), what="agent under gpumon run")
    assert addr.pid == p.pid
    with client.AgentConnection.connect(addr) as c:
        assert c.hello["source"] == "simulated"
        assert c.request("ping")["pong"]


def test_gpumon_run_keeps_the_users_sitecustomize_and_exit_status(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    prog = ("import os, sys; import gpumon.agent.core as c; "
            "print(os.environ.get('USER_SITECUSTOMIZE'), c.current_agent() is not None); "
            "sys.exit(3)")
    r = gpumon_cmd("run", "--", sys.executable, "-c", prog,
                   env={"PYTHONPATH": os.pathsep.join([str(user), str(ROOT)])})
    assert r.returncode == 3
    assert r.stdout.split() == ["ran", "True"]
    assert r.stderr == ""


def test_gpumon_run_errors_are_one_line():
    r = gpumon_cmd("run")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nothing to run" in r.stderr
    r = gpumon_cmd("run", "--", "no-such-command-gpumon")
    assert r.returncode == 127 and r.stderr == "gpumon: command not found: no-such-command-gpumon\n"
    r = gpumon_cmd("run", "--rate", "0", "--", "true")
    assert r.returncode == 2 and "--rate" in r.stderr


def test_a_process_that_never_uses_cuda_never_appears(procs):
    """torch imported and used on the CPU, the real (torch) source: the agent waits, at no cost,
    and never serves; the agent itself never imports torch into a program without it."""
    pytest.importorskip("torch")
    prog = r"""
import sys, time
import gpumon.agent.core as core
a = core.current_agent()
time.sleep(0.6)
print("no-torch", a is not None and a.alive, "torch" in sys.modules, flush=True)
import torch
x = (torch.ones(256, 256) @ torch.ones(256, 256)).sum()
time.sleep(1.0)  # four of the agent's readiness polls
print("cpu-torch", a.alive, a.serving.is_set(), torch.cuda.is_initialized(), flush=True)
sys.stdin.readline()
"""
    p = subprocess.Popen(run_cmd(sys.executable, "-c", prog), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={k: v for k, v in os.environ.items() if k != "GPUMON_SOURCE"})
    procs.append(p)
    assert p.stdout.readline().split() == ["no-torch", "True", "False"]
    assert p.stdout.readline().split() == ["cpu-torch", "True", "False", "False"]
    assert client.discover() == []  # nothing serves...
    r = gpumon_cmd("ls")  # ...but ls names the process and says why
    assert r.returncode == 0
    row = next(line.split() for line in r.stdout.splitlines()[1:] if line.split()[0] == str(p.pid))
    assert row[3] == "waiting"
    assert (f"pid {p.pid}: gpumon's agent is loaded, waiting for the program's first CUDA call"
            in r.stdout.splitlines())
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(30)
    # as it ends, the command gpumon run became says why there were never figures (issue 32
    # item 1), in one line, and nothing else
    from gpumon.agent.core import NEVER_USED_CUDA
    assert p.stderr.read() == NEVER_USED_CUDA + "\n"
    assert not list(client.socket_dir().glob("*.served"))


def test_a_run_whose_program_served_says_nothing_at_its_end(procs):
    """The simulated source serves at once: the run used "CUDA", so no line at its end."""
    r = subprocess.run(run_cmd(sys.executable, "-c", "import time; time.sleep(0.5)"),
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GPUMON_SOURCE": "simulated", "GPUMON_SIM_READY": "now"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not list(client.socket_dir().glob("*.served"))


def test_the_pth_line_starts_an_agent_only_when_GPUMON_is_set(tmp_path, procs):
    """The .pth line, processed by site.py from a real site dir: the user site dir where the
    interpreter reads it at start; inside a virtual environment (which turns the user site off)
    the same site.addsitedir() that reads site-packages at start, called first thing."""
    base = tmp_path / "userbase"
    site_dir = Path(sysconfig.get_path("purelib", f"{os.name}_user", vars={"userbase": str(base)}))
    site_dir.mkdir(parents=True)
    (site_dir / bootstrap.PTH_NAME).write_text(bootstrap.PTH_LINE)
    env = {"PYTHONUSERBASE": str(base)}
    user_site = subprocess.run([sys.executable, "-c", "import site; print(site.ENABLE_USER_SITE)"],
                               capture_output=True, text=True, env={**os.environ, **env})
    pre = "" if user_site.stdout.strip() == "True" else \
        f"import site; site.addsitedir({str(site_dir)!r}); "

    def prog(code):
        return [sys.executable, "-c", pre + code]
    check = "import sys; print('gpumon' in sys.modules, 'gpumon.agent.core' in sys.modules)"
    r = subprocess.run(prog(check), capture_output=True, text=True,
                       env={**os.environ, **env, "GPUMON": "0"})
    assert r.stdout.split() == ["False", "False"] and r.stderr == ""
    r = subprocess.run(prog(check), capture_output=True, text=True,
                       env={**os.environ, **env, "GPUMON": "1", "GPUMON_SOURCE": "simulated"})
    assert r.stdout.split() == ["True", "True"], r.stdout + r.stderr  # the line did load it
    p = popen(prog("import time; time.sleep(60)"),
              env={**env, "GPUMON": "1", "GPUMON_SOURCE": "simulated"})
    procs.append(p)
    (addr,) = wait_for(lambda: client.discover(p.pid), what="agent started by the .pth")
    # A broken configuration stays silent: the program runs as if gpumon were not there.
    r = subprocess.run(prog("print('ok')"), capture_output=True, text=True,
                       env={**os.environ, **env, "GPUMON": "1", "GPUMON_SOURCE": "bogus"})
    assert r.stdout == "ok\n" and r.stderr == "" and r.returncode == 0


def test_the_wheel_ships_the_pth_at_its_root(tmp_path):
    # Build from a copy: an in-tree build would leave build/ in the shared checkout.
    import shutil
    src = tmp_path / "src"
    shutil.copytree(ROOT / "gpumon", src / "gpumon",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out), str(src)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    if r.returncode != 0 and "setuptools" in r.stderr and "No module" in r.stderr:
        pytest.skip("setuptools is not installed here")
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        assert z.read(bootstrap.PTH_NAME).decode() == bootstrap.PTH_LINE
