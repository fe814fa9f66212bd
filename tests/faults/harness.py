"""The fault suite's victim and its tools, shared by tests/faults/ (fast cases, CI) and
benchmarks/faults.py (the long campaign).

The victim is a training program under the agent (simulated memory source): with torch, a
small AdamW loop on the CPU; without, a pure-Python loop. Either writes one loss per step, as
float.hex, to its stdout (a file), so a run under attack can be compared bit for bit with a
run without gpumon; step times go to another file. It stops when its stop file appears or
after T_STEPS steps, and exits 0.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

VICTIM = r'''
import os, sys, signal, time
e = os.environ
if e.get("T_SIGPIPE") == "default":   # as many C extensions and launchers leave it
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
if e.get("T_RECURSION"):              # programs that recurse deeply raise the limit
    sys.setrecursionlimit(int(e["T_RECURSION"]))
steps_max = int(e.get("T_STEPS", "100000000"))
stop = e.get("T_STOP")
times = open(e["T_TIMES"], "w") if e.get("T_TIMES") else None
torch_loop = e.get("T_TORCH") == "1"
if torch_loop:
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    W = int(e.get("T_WIDTH", "64"))
    model = torch.nn.Sequential(torch.nn.Linear(W, 4 * W), torch.nn.GELU(),
                                torch.nn.Linear(4 * W, W))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(32, W, generator=g) for _ in range(8)]
    loader = None
    if e.get("T_LOADER"):  # DataLoader worker processes, forked every epoch
        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return data[i]
        loader = torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=2,
                                             multiprocessing_context="fork")
if e.get("T_AGENT") == "1":
    import gpumon
    agent = gpumon.start(source="simulated", rate_hz=float(e.get("T_RATE", "10")))
    if torch_loop:
        gpumon.watch(model, opt)
    end = time.time() + 60  # until it serves, or has given up (a directory it refused)
    while agent is not None and agent.alive and not agent.serving.wait(0.05) \
            and time.time() < end:
        pass
out = sys.stdout
if e.get("T_FDLIMIT"):  # near its fd limit: all but T_FDLIMIT descriptors held
    import resource
    core = sys.modules.get("gpumon.agent.core")  # (under gpumon run: once its agent serves,
    a = core.current_agent() if core else None   # else it may find no descriptor for a socket)
    if a is not None:
        a.serving.wait(60)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    held = []
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    for _ in range(int(e["T_FDLIMIT"])):
        os.close(held.pop())
files = []


def close_all_and_open_files():
    """A daemon's close-all (os.closerange) after gpumon started, then files of its own, which
    get the lowest numbers: the agent's old ones. Each loss from then on goes to each file."""
    global times, files
    if times is not None:
        times.close()
    os.closerange(3, 65536)
    if times is not None:
        times = open(e["T_TIMES"], "a")
    files = [open(os.path.join(e["T_FILES"], "f%d.txt" % i), "w") for i in range(4)]


if e.get("T_FILES") and not e.get("T_CLOSE_WHEN"):  # files opened after gpumon started
    files = [open(os.path.join(e["T_FILES"], "f%d.txt" % i), "w") for i in range(4)]
copies = 0
x = 12345


def batches():
    while True:
        if loader is not None:
            yield from loader
        else:
            yield from data


it = batches() if torch_loop else None
for step in range(steps_max):
    t0 = time.perf_counter()
    if torch_loop:
        xb = next(it)
        loss = ((model(xb) - xb) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
    else:
        for _ in range(2000):
            x = (x * 1103515245 + 12345) % 2147483648
        value = x / 2147483648.0
    out.write(value.hex() + "\n")
    for f in files:
        f.write(value.hex() + "\n")
    if torch_loop and e.get("T_COPY") and step % 16 == 0:  # an EMA / best-model copy
        import copy
        copies += len(list(copy.deepcopy(model).parameters())) > 0
    if times is not None:
        times.write("%.7f\n" % (time.perf_counter() - t0))
    if stop and step % 8 == 0 and os.path.exists(stop):
        break
    if e.get("T_FDLIMIT") and step % 64 == 0:  # the program's own short-lived file use
        os.close(os.open(os.devnull, os.O_RDONLY))
    if e.get("T_CLOSE_WHEN") and not files and step % 8 == 0 and os.path.exists(e["T_CLOSE_WHEN"]):
        close_all_and_open_files()
    if step % 256 == 255 and times is not None:  # progress visible from outside
        times.flush()
out.flush()
for f in files:
    f.close()
if times is not None:
    times.close()
if e.get("T_EXIT") == "os_exit":
    os._exit(0)
'''


class Victim:
    """One victim process. ``sock``: its agent's socket (None without an agent)."""

    def __init__(self, workdir: Path, *, agent: bool = True, torch_loop: bool = False,
                 env: dict | None = None, rate: float = 20.0, steps: int | None = None,
                 cwd: Path | None = None, wait: bool = True, timeout: float = 60.0,
                 via: str = "start") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.stop_file = workdir / "stop"
        self.out_path = workdir / "losses.txt"
        self.err_path = workdir / "stderr.txt"
        self.times_path = workdir / "times.txt"
        e = dict(os.environ)
        for k in ("GPUMON", "GPUMON_SOURCE", "GPUMON_RATE", "GPUMON_MAX_RATE"):
            e.pop(k, None)
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [
            p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
        e.update(T_AGENT="1" if agent else "0", T_TORCH="1" if torch_loop else "0",
                 T_RATE=str(rate), T_STOP=str(self.stop_file), T_TIMES=str(self.times_path))
        if steps is not None:
            e["T_STEPS"] = str(steps)
        e.update(env or {})
        argv = [sys.executable, "-c", VICTIM]
        self.via = via
        if via == "run" and agent:  # the agent from `gpumon run`'s sitecustomize, not start()
            e["T_AGENT"] = "0"
            e.setdefault("GPUMON_SOURCE", "simulated")
            e.setdefault("GPUMON_RATE", str(rate))
            argv = [sys.executable, "-m", "gpumon", "run", "--"] + argv
        self.env = e
        self.t0 = time.monotonic()
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=err, env=e, cwd=str(cwd or workdir))
        self.pid = self.proc.pid
        self.sock: Path | None = None
        if agent and wait:
            self.sock = self.wait_socket(timeout)

    def socket_dir(self) -> Path:
        code = "from gpumon.agent.core import socket_dir; print(socket_dir())"
        r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True,
                           text=True, timeout=60)
        return Path(r.stdout.strip())

    def wait_socket(self, timeout: float = 60.0) -> Path:
        path = self.socket_dir() / f"{self.pid}.sock"
        end = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"victim exited with {self.proc.returncode}: "
                                     f"{self.stderr()[-2000:]}")
            if time.monotonic() > end:
                raise AssertionError(f"no agent socket {path} after {timeout} s")
            time.sleep(0.02)
        return path

    def wait_steps(self, n: int, timeout: float = 120.0) -> None:
        """Until it has made n steps (seen in its step-time file, flushed every 256 steps)."""
        end = time.monotonic() + timeout
        while len(self.step_times()) < n and self.alive() and time.monotonic() < end:
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float = 60.0) -> int:
        """Ask it to stop (stop file), wait, return its exit status (-N: killed by signal N)."""
        self.stop_file.touch()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def losses(self) -> list[str]:
        return self.out_path.read_text().split()

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def step_times(self) -> list[float]:
        try:
            return [float(x) for x in self.times_path.read_text().split()]
        except (OSError, ValueError):
            return []

    def rss_kib(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def threads(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/task"))
        except OSError:
            return 0


_control_cache: dict[tuple, list[str]] = {}


def control_losses(workdir: Path, steps: int, torch_loop: bool, env: dict | None = None) -> list[str]:
    """The losses of the same program without gpumon, for ``steps`` steps (cached)."""
    key = (torch_loop, tuple(sorted((env or {}).items())))
    have = _control_cache.get(key)
    if have is not None and len(have) >= steps:
        return have[:steps]
    v = Victim(workdir / f"control-{len(_control_cache)}-{steps}", agent=False,
               torch_loop=torch_loop, steps=max(steps, 1), env=env)
    rc = v.proc.wait(600)
    assert rc == 0, v.stderr()
    _control_cache[key] = v.losses()
    return _control_cache[key][:steps]


def unharmed(v: Victim, workdir: Path, env: dict | None = None) -> tuple[bool, str]:
    """After finish(): exit status 0, nothing on stderr, losses equal bit for bit to a run
    without gpumon. (ok, why not)."""
    rc = v.proc.returncode
    if rc != 0:
        return False, f"exit status {rc}"
    if v.stderr():
        return False, f"wrote on the program's stderr: {v.stderr()[-500:]!r}"
    got = v.losses()
    torch_loop = v.env.get("T_TORCH") == "1"
    ref_env = {k: v.env[k] for k in ("T_WIDTH", "T_LOADER") if k in v.env}
    want = control_losses(workdir, len(got), torch_loop, ref_env)
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        return False, f"losses differ from step {first} ({got[first]} vs {want[first]})"
    return True, ""


# -- raw clients -----------------------------------------------------------------------------
def cmd_line(cmd: str, args: dict | None = None, mid: int = 1) -> bytes:
    return json.dumps({"v": 1, "type": "cmd", "id": mid, "cmd": cmd,
                       "args": args or {}}).encode() + b"\n"


class Raw:
    """A bare client: a socket, a line reader, no thread; for sending what gpumon's own client
    never would."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout)
        self.s.connect(str(path))
        self.buf = b""
        self.hello = self.next()

    def send(self, data: bytes) -> None:
        self.s.sendall(data)

    def next(self, timeout: float = 10.0) -> dict | None:
        """The next message (None at EOF)."""
        self.s.settimeout(timeout)
        while b"\n" not in self.buf:
            data = self.s.recv(262144)
            if not data:
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def wait(self, pred, timeout: float = 10.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            m = self.next(max(0.01, end - time.monotonic()))
            if m is None:
                raise AssertionError("EOF from the agent")
            if pred(m):
                return m

    def reply(self, mid: int, timeout: float = 10.0) -> dict:
        return self.wait(lambda m: m.get("type") == "reply" and m.get("id") == mid, timeout)

    def error(self, timeout: float = 10.0) -> dict:
        return self.wait(lambda m: m.get("type") == "error", timeout)

    def request(self, cmd: str, args: dict | None = None, mid: int = 1,
                timeout: float = 10.0) -> dict:
        """The reply; a command over its rate limit is sent again when the agent says."""
        end = time.monotonic() + timeout
        while True:
            self.send(cmd_line(cmd, args, mid))
            rep = self.reply(mid, max(0.01, end - time.monotonic()))
            err = rep.get("error") or ""
            if "a second per client; try again in" not in err or time.monotonic() > end:
                return rep
            time.sleep(float(err.rsplit("try again in ", 1)[1].split()[0]))

    def send_paced(self, line: bytes, mid: int, timeout: float = 10.0) -> dict:
        """Send a raw command line with id mid; its reply (or a protocol error), sent again
        while over the rate limit."""
        end = time.monotonic() + timeout
        while True:
            self.send(line)
            m = self.wait(lambda m: m.get("type") == "error" or m.get("id") == mid,
                          max(0.01, end - time.monotonic()))
            err = m.get("error") or ""
            if "a second per client; try again in" not in err or time.monotonic() > end:
                return m
            time.sleep(float(err.rsplit("try again in ", 1)[1].split()[0]))

    def close(self) -> None:
        try:
            self.s.close()
        except OSError:
            pass


def ping_ok(path: Path, timeout: float = 10.0) -> bool:
    """The agent at path accepts, says hello and answers a ping."""
    try:
        r = Raw(path, timeout)
        try:
            return bool(r.request("ping", mid=7, timeout=timeout).get("ok"))
        finally:
            r.close()
    except (OSError, AssertionError, ValueError):
        return False


def _cli_env(env: dict | None) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [
        p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e.update(env or {})
    return e


def gpumon(*args: str, env: dict | None = None, timeout: float = 60.0,
           cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True,
                          text=True, timeout=timeout, env=_cli_env(env), cwd=cwd)


def gpumon_many(argvs: list[list[str]], env: dict | None = None,
                timeout: float = 60.0) -> list[subprocess.CompletedProcess]:
    """Several gpumon commands at once (their start-up dominates); results in order."""
    e = _cli_env(env)
    procs = [subprocess.Popen([sys.executable, "-m", "gpumon", *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=e)
             for a in argvs]
    out = []
    for a, p in zip(argvs, procs):
        try:
            o, r = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, r = p.communicate()
        out.append(subprocess.CompletedProcess([*a], p.returncode, o, r))
    return out


def one_clear_line(r: subprocess.CompletedProcess, status: int = 1) -> bool:
    """Exit `status` (1: a runtime failure, 2: a usage error) and exactly one line on stderr,
    starting with ``gpumon``, no traceback."""
    lines = r.stderr.strip().splitlines()
    return (r.returncode == status and len(lines) == 1 and lines[0].startswith("gpumon")
            and "Traceback" not in r.stderr)
