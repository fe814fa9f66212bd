"""The fault campaign of issue 22: a real training loop under the agent (simulated memory
source, a small AdamW loop on the CPU), attacked the way a careless user or another program
would, scenario by scenario. For each it reports the attempts, whether the program and its
agent survived, whether the losses equal a run without gpumon bit for bit, the median step-time
ratio against that run, and the program's RSS growth over the attack.

    python benchmarks/faults.py                      # the whole campaign (~10 min on 2 cores)
    python benchmarks/faults.py --only malformed,exits --scale 0.2
    GPUMON_PHASES=0 python benchmarks/faults.py     # the victims without phase tracking

Needs root for the scenarios that mount file systems (full disk, read-only) and run a client
as another user (a user `gpumon-other` is made with useradd if missing); without root they are
reported as skipped. Results are appended to benchmarks/faults.md (or --out). The fast cases
of the same suite run in CI: tests/faults/.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import pwd
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from faults.harness import (VICTIM, Raw, Victim, cmd_line, control_losses,  # noqa: E402
                            gpumon, ping_ok)

OTHER_USER = "gpumon-other"
CLIENT = r'''
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    first = s.recv(65536)
    s.sendall(b'{"v": 1, "type": "cmd", "id": 1, "cmd": "status", "args": {}}\n')
    print("refused" if b'"type":"error"' in first[:200] else "up", flush=True)
except OSError as e:
    print("refused " + type(e).__name__, flush=True)
    sys.exit(0)
time.sleep(float(sys.argv[2]))
'''


class Result:
    def __init__(self, name: str) -> None:
        self.name = name
        self.attempts = 0
        self.survived: bool | None = None
        self.losses_equal: bool | None = None
        self.ratio: float | None = None
        self.rss_kib: int | None = None
        self.notes: list[str] = []
        self.skipped: str | None = None
        # (victim, its twin without gpumon run alongside, rss at start, rss at end)
        self.victims: list[list] = []

    def row(self) -> str:
        if self.skipped:
            return f"| {self.name} | - | skipped: {self.skipped} | | | | |"

        def yn(x):
            return "n/a" if x is None else ("yes" if x else "**NO**")
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.3f}"
        rss = "n/a" if self.rss_kib is None else f"{self.rss_kib:+d} KiB"
        return (f"| {self.name} | {self.attempts} | {yn(self.survived)} | {yn(self.losses_equal)}"
                f" | {ratio} | {rss} | {'; '.join(self.notes)} |")


class Campaign:
    def __init__(self, work: Path, scale: float) -> None:
        self.work = work
        self.scale = scale
        self.n = 0
        self.results: list[Result] = []

    def count(self, full: int, least: int = 1) -> int:
        return max(least, int(round(full * self.scale)))

    def victim(self, res: Result, twin: bool = True, **kw) -> Victim:
        """A victim under the agent and, alongside it under the same load, its twin: the same
        program without gpumon (the reference for the losses and the step times)."""
        self.n += 1
        kw.setdefault("torch_loop", True)
        env = kw.pop("env", {}) or {}
        v = Victim(self.work / f"{res.name}-{self.n}", env=env, **kw)
        t = None
        if twin:
            t = Victim(self.work / f"{res.name}-{self.n}-twin", agent=False,
                       env={k: x for k, x in env.items() if not k.startswith("GPUMON")},
                       torch_loop=kw["torch_loop"])
        for w in (v, t):  # warm: the first steps and the agent's start are not the attack's
            if w is not None:
                w.wait_steps(256)
        res.victims.append([v, t, v.rss_kib() or 0, None])
        return v

    def end(self, res: Result, v: Victim) -> bool:
        """Finish v and its twin (note RSS first); True if v exited 0, nothing on stderr."""
        for row in res.victims:
            if row[0] is v:
                row[3] = v.rss_kib()
                if row[1] is not None:
                    row[1].finish(120)
        rc = v.finish(120)
        ok = rc == 0 and not v.stderr()
        if not ok:
            res.notes.append(f"exit {rc}, stderr {v.stderr()[-200:]!r}")
        return ok

    @staticmethod
    def config(v: Victim) -> tuple[bool, dict]:
        return v.env.get("T_TORCH") == "1", {k: v.env[k] for k in ("T_WIDTH", "T_LOADER")
                                              if k in v.env}

    def judge_all(self) -> None:
        """Every result, after one run without gpumon per configuration as long as the
        longest victim of that configuration (its losses are the reference)."""
        longest: dict = {}
        for r in self.results:
            for v, *_ in r.victims:
                if v.proc.poll() is None:
                    v.kill()
                torch_loop, env = self.config(v)
                key = (torch_loop, tuple(sorted(env.items())))
                longest[key] = max(longest.get(key, 0), len(v.losses()))
        for (torch_loop, env), n in longest.items():
            if n:
                control_losses(self.work, n, torch_loop, dict(env))
        for r in self.results:
            self.judge(r)

    def judge(self, res: Result) -> None:
        """Losses equal bit for bit to a run without gpumon, step-time ratio to the twin run
        alongside (same load), RSS growth."""
        eq, ratios, growth = [], [], []
        for v, twin, r0, r1 in res.victims:
            for w in (v, twin):
                if w is not None and w.proc.poll() is None:
                    w.kill()
            got = v.losses()
            if v.proc.returncode == 0 and got:
                torch_loop, env = self.config(v)
                eq.append(got == control_losses(self.work, len(got), torch_loop, env))
            if twin is not None and v.proc.returncode == 0 and twin.proc.returncode == 0:
                a, b = v.step_times()[50:], twin.step_times()[50:]
                if a and b:
                    ratios.append(statistics.median(a) / statistics.median(b))
            if r0 and r1:
                growth.append(r1 - r0)
        if eq:
            res.losses_equal = all(eq)
        if ratios:
            res.ratio = statistics.median(ratios)
        if growth:
            res.rss_kib = max(growth)


# -- scenarios --------------------------------------------------------------------------------
def s_baseline(c: Campaign, r: Result) -> None:
    """The agent at 10 Hz with one client streaming: the reference for the ratios below."""
    v = c.victim(r, rate=10)
    raw = Raw(v.sock)
    time.sleep(10 * max(c.scale, 0.3))
    r.attempts = 1
    r.survived = ping_ok(v.sock) and c.end(r, v)
    raw.close()


def s_kill9(c: Campaign, r: Result) -> None:
    """Client processes connected and in the middle of a command, killed with SIGKILL."""
    v = c.victim(r)
    n = c.count(100, 10)
    for batch in range(0, n, 10):
        ps = [subprocess.Popen([sys.executable, "-S", "-c", CLIENT, str(v.sock), "60"],
                               stdout=subprocess.PIPE, text=True) for _ in range(min(10, n - batch))]
        for p in ps:
            p.stdout.readline()
        for p in ps:
            p.kill()
            p.wait()
            p.stdout.close()
        r.attempts += len(ps)
    time.sleep(1.0)
    st = Raw(v.sock).request("status")["result"]
    r.notes.append(f"{len(st['clients'])} clients left connected")
    r.survived = ping_ok(v.sock) and c.end(r, v)


def s_slow_readers(c: Campaign, r: Result) -> None:
    """Clients that never read, and clients that read one byte a second, for longer than the
    stall limit (30 s); a normal client meanwhile must get every sample."""
    v = c.victim(r, rate=50)
    stuck = []
    for _ in range(c.count(20, 4)):
        s = socket.socket(socket.AF_UNIX)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(str(v.sock))
        stuck.append(s)
    trickle = [Raw(v.sock) for _ in range(c.count(5, 2))]
    normal = Raw(v.sock)
    r.attempts = len(stuck) + len(trickle)
    seq0 = normal.request("status", mid=1)["result"]["seq"]
    t_end = time.monotonic() + max(35.0, 40 * c.scale)
    while time.monotonic() < t_end:
        for t in trickle:
            t.s.setblocking(False)
            try:
                t.s.recv(1)
            except OSError:
                pass
        try:  # the normal client reads everything that came
            normal.s.settimeout(1.0)
            normal.buf += normal.s.recv(1 << 20)
            normal.buf = normal.buf[normal.buf.rfind(b"\n") + 1:]  # read and dropped
        except OSError:
            pass
    st = normal.request("status", mid=2)["result"]
    r.notes.append(f"{len(st['clients'])} of {r.attempts + 1} clients still connected after "
                   f"{max(35.0, 40 * c.scale):.0f} s; {st['seq'] - seq0} samples taken")
    for s in stuck + [t.s for t in trickle]:
        s.close()
    r.survived = ping_ok(v.sock) and c.end(r, v)


def s_cycles(c: Campaign, r: Result) -> None:
    """Connect, read a little (or nothing), disconnect; half of them mid-history."""
    v = c.victim(r, rate=100)
    time.sleep(2)  # some history to be cut
    for i in range(c.count(200, 20)):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(v.sock))
        if i % 2:
            s.recv(100)
        s.close()
        r.attempts += 1
    r.survived = ping_ok(v.sock) and c.end(r, v)


def s_many(c: Campaign, r: Result) -> None:
    """50 clients at once, each reading the stream."""
    v = c.victim(r, rate=20)
    n = c.count(50, 5)
    got = []
    lock = threading.Lock()
    go = threading.Barrier(n)

    def reader():
        go.wait()
        try:
            x = Raw(v.sock, timeout=30)
            k = 0
            end = time.monotonic() + 5
            while time.monotonic() < end:
                m = x.next(timeout=5)
                k += bool(m and m.get("type") == "sample")
            x.close()
        except (OSError, AssertionError):
            k = -1
        with lock:
            got.append(k)
    ts = [threading.Thread(target=reader) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    r.attempts = n
    r.notes.append(f"samples per client in 5 s: min {min(got)}, max {max(got)}")
    r.survived = min(got) > 0 and ping_ok(v.sock) and c.end(r, v)


def garbage(rng: random.Random) -> bytes:
    """One malformed or hostile line (the newline included)."""
    def value(depth=0):
        k = rng.randrange(12 if depth < 4 else 8)
        return [lambda: None, lambda: rng.random() < 0.5, lambda: rng.randrange(-10 ** 6, 10 ** 6),
                lambda: rng.choice([0.0, -1.0, 1e308, 1e-308, 3.5]),
                lambda: "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(20))),
                lambda: rng.choice(["", "/", "../../etc/passwd", "\u202e", "x" * 5000, "~"]),
                lambda: 10 ** rng.randrange(1, 60), lambda: -(10 ** 40),
                lambda: [value(depth + 1) for _ in range(rng.randrange(4))],
                lambda: {str(value(depth + 1))[:20]: value(depth + 1) for _ in range(rng.randrange(4))},
                lambda: [value(depth + 1)], lambda: {"out": value(depth + 1)}][k]()
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b"") + b"\n"
    if kind == 1:
        return rng.choice([b"[", b"{", b'{"a":']) * rng.randrange(30, 20000) + b"\n"
    if kind == 2:
        return rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000, b"true",
                           b'"\\ud800"', b"\xff\xfe"]) + b"\n"
    cmds = ["ping", "status", "sample", "reset_peaks", "set_rate", "snapshot_start",
            "snapshot_stop", "snapshot_status", "phases_status", "phases_breakdown", "nope"]
    msg = {"v": rng.choice([1, 1, 1, True, 1.0, "1", 2, None]), "type": rng.choice(["cmd"] * 5 + ["hello", 3]),
           "id": rng.choice([rng.randrange(1 << 30), -1, True, 1.5, 10 ** 30, None]),
           "cmd": rng.choice(cmds + [value()]),
           "args": rng.choice([{}, None, [], value(), {"rate_hz": value()}, {"seconds": value()},
                               {"out": value(), "stacks": value(), "max_entries": value()}])}
    if isinstance(msg["args"], dict) and isinstance(msg["args"].get("out"), str):
        msg["args"]["out"] = "/proc/forbidden/" + msg["args"]["out"][:40]  # never a real place
    if msg["cmd"] == "set_rate" and isinstance(msg["args"], dict):
        msg["args"].setdefault("rate_hz", rng.choice([0.05, 5, 20, 1000, 1e9]))
    try:
        line = json.dumps(msg, allow_nan=True).encode()
    except (TypeError, ValueError):
        line = b'{"v":1}'
    if kind == 3:
        line = line[: rng.randrange(1, len(line))]
    return line + b"\n"


def s_malformed(c: Campaign, r: Result) -> None:
    """Tens of thousands of malformed and hostile lines over 16 connections (a seeded
    generator: random bytes, deep nesting, non-finite and huge numbers, wrong types for every
    field and argument of every command); a ping from another client after each thousand."""
    v = c.victim(r)
    n = c.count(30000, 500)
    rng = random.Random(22)
    lines = [garbage(rng) for _ in range(n)]
    conns = [Raw(v.sock, timeout=600) for _ in range(16)]
    pings_ok = [0, 0]

    def send(k):
        for i in range(k, n, 16):
            try:
                conns[k].s.sendall(lines[i])
            except OSError:
                try:  # the agent may drop a client: reconnect
                    conns[k] = Raw(v.sock, timeout=600)
                except (OSError, ValueError, AssertionError):
                    return  # the agent is gone: the scenario fails below

    def drain(k):
        while True:
            try:
                if not conns[k].s.recv(1 << 20):
                    return
            except OSError:
                return
    senders = [threading.Thread(target=send, args=(k,)) for k in range(16)]
    for k in range(16):
        threading.Thread(target=drain, args=(k,), daemon=True).start()
    for t in senders:
        t.start()
    t0 = time.monotonic()
    while any(t.is_alive() for t in senders):
        pings_ok[0] += 1
        pings_ok[1] += ping_ok(v.sock)
        time.sleep(1.0)
    r.attempts = n
    r.notes.append(f"sent in {time.monotonic() - t0:.0f} s (paced by the agent); "
                   f"{pings_ok[1]}/{pings_ok[0]} pings answered meanwhile")
    time.sleep(1.0)
    for x in conns:
        x.close()
    r.survived = ping_ok(v.sock) and c.end(r, v)


def ensure_other_user() -> int | None:
    try:
        return pwd.getpwnam(OTHER_USER).pw_uid
    except KeyError:
        pass
    if os.getuid() != 0:
        return None
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", OTHER_USER], check=False,
                   capture_output=True)
    try:
        return pwd.getpwnam(OTHER_USER).pw_uid
    except KeyError:
        return None


def as_other(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={OTHER_USER}", f"--regid={OTHER_USER}",
                           "--init-groups", "--"] + argv, capture_output=True, text=True, **kw)


def s_other_uid(c: Campaign, r: Result) -> None:
    """A client of another uid (a real second user, setpriv): against this user's agent; and
    this user's client against an agent of the other user (the agent's SO_PEERCRED check)."""
    if ensure_other_user() is None:
        r.skipped = "needs root (useradd, setpriv)"
        return
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    v = c.victim(r)
    n = c.count(125, 10)
    outs = []
    for _ in range(n):
        p = as_other([py, "-S", "-c", CLIENT, str(v.sock), "0"], timeout=30)
        outs.append(p.stdout.strip())
    refused = sum(o.startswith("refused") for o in outs)
    r.attempts += n
    # An agent of the other user (stdlib only: the system python, gpumon on its path), its
    # socket directory made readable so that our client can reach it.
    base = Path(tempfile.mkdtemp(prefix="gpumon-other-", dir="/tmp"))
    base.chmod(0o1777)
    src = base / "src"
    shutil.copytree(ROOT / "gpumon", src / "gpumon", ignore=shutil.ignore_patterns("tui", "__pycache__"))
    os.chmod(src, 0o755)
    for d, _, fs in os.walk(src):
        os.chmod(d, 0o755)
        for f in fs:
            os.chmod(os.path.join(d, f), 0o644)
    prog = ("import os, time, gpumon; a = gpumon.start(source='simulated'); a.serving.wait(20); "
            "os.chmod(a.socket_path.parent, 0o755); os.chmod(a.socket_path, 0o777); "
            "print(a.socket_path, flush=True); time.sleep(30)")
    other = subprocess.Popen(["setpriv", f"--reuid={OTHER_USER}", f"--regid={OTHER_USER}",
                              "--init-groups", "--", "env", f"PYTHONPATH={src}",
                              # no torch in that program: the simulated source serves at once
                              # (by default it waits for torch, as the torch source for CUDA)
                              "GPUMON_SIM_READY=now", f"GPUMON_DIR={base}", py, "-c", prog],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = other.stdout.readline().strip()
    m = c.count(25, 5)
    by_agent = 0
    for _ in range(m):
        try:
            x = Raw(Path(path))
            by_agent += x.hello.get("type") == "error" and "not the same user" in x.hello["error"]
            x.close()
        except (OSError, ValueError):
            pass
    other.kill()
    other.wait()
    shutil.rmtree(base, ignore_errors=True)
    r.attempts += m
    r.notes.append(f"{refused}/{n} of the other user's connects refused; {by_agent}/{m} of ours "
                   "refused by the other user's agent")
    r.survived = refused == n and by_agent == m and ping_ok(v.sock) and c.end(r, v)


def s_forks(c: Campaign, r: Result) -> None:
    """DataLoader workers forked every epoch (2 per epoch) while a client streams: no socket of
    a child appears, the parent's stays, the client never sees an EOF."""
    before = {p.name for p in c.work.glob("sockets/*/*.sock")}  # other scenarios' victims
    v = c.victim(r, env={"T_LOADER": "1"})
    raw = Raw(v.sock, timeout=30)
    forks0 = _forks(v)
    end = time.monotonic() + max(10.0, 60 * c.scale)
    socks, eof = set(), False
    while time.monotonic() < end:
        socks |= {p.name for p in v.sock.parent.glob("*.sock")} - before
        try:
            if raw.next(timeout=5) is None:
                eof = True
                break
        except OSError:
            eof = True
            break
    r.attempts = _forks(v) - forks0
    r.notes.append(f"sockets seen: {sorted(socks)}; client EOF: {eof}")
    raw.close()
    r.survived = socks == {v.sock.name} and not eof and ping_ok(v.sock) and c.end(r, v)


def _forks(v: Victim) -> int:
    """Forks so far: the DataLoader makes 2 workers per epoch of 8 steps."""
    try:
        return len(v.out_path.read_text().split()) // 8 * 2
    except OSError:
        return 0


EXITS = {
    "normal": "", "sys.exit(3)": "raise SystemExit(3)", "os._exit(4)": "os._exit(4)",
    "exception": "raise RuntimeError('the program fails')", "SIGTERM": "os.kill(os.getpid(), 15)",
    "SIGINT": "os.kill(os.getpid(), 2); time.sleep(5)", "SIGKILL": "os.kill(os.getpid(), 9)",
}


def s_exits(c: Campaign, r: Result) -> None:
    """Every way out of the program, with a client attached: the exit status is the one
    without gpumon, nothing of gpumon's on stderr, the socket goes (or, after SIGKILL or
    os._exit, is never listed), the client sees EOF."""
    bad = []
    for name, code in EXITS.items():
        prog = VICTIM + "\n" + code + "\n"
        rcs = []
        for agent in (False, True):
            d = c.work / f"exit-{c.n}-{agent}"
            c.n += 1
            d.mkdir(parents=True)
            stop = d / "stop"
            e = dict(os.environ, T_AGENT="1" if agent else "0", T_TORCH="1", T_STOP=str(stop),
                     PYTHONPATH=str(ROOT))
            p = subprocess.Popen([sys.executable, "-c", prog], env=e, cwd=d,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            x = None
            if agent:
                end = time.monotonic() + 60
                while time.monotonic() < end and p.poll() is None and x is None:
                    found = [a for a in _discover() if a.pid == p.pid]
                    if found:
                        x = Raw(found[0].path, timeout=30)
                    time.sleep(0.05)
            time.sleep(0.3)
            stop.touch()
            p.wait(120)
            err = p.stderr.read().decode(errors="replace")
            p.stderr.close()
            rcs.append((p.returncode, "gpumon" in err))
            if agent:
                eof = False
                if x is not None:
                    try:
                        while x.next(timeout=10) is not None:
                            pass
                        eof = True
                    except (OSError, ValueError):
                        eof = True
                listed = any(a.pid == p.pid for a in _discover())
                if listed or not eof:
                    bad.append(f"{name}: listed after exit {listed}, client EOF {eof}")
        r.attempts += 1
        if rcs[0][0] != rcs[1][0] or rcs[1][1]:
            bad.append(f"{name}: status {rcs[1][0]} with gpumon, {rcs[0][0]} without"
                       + (" (gpumon on stderr)" if rcs[1][1] else ""))
    r.notes.append("; ".join(bad) or f"{len(EXITS)} ways out: statuses equal, sockets gone, "
                   "clients saw EOF")
    r.survived = not bad


def _discover():
    from gpumon import client
    return client.discover()


def mount(kind: str, size: str = "1m", ro: bool = False) -> Path | None:
    d = Path(tempfile.mkdtemp(prefix=f"gpumon-{kind}-"))
    opts = f"size={size},mode=0755" + (",ro" if ro else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True)
    return d if p.returncode == 0 else None


def umount(d: Path) -> None:
    subprocess.run(["umount", str(d)], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


def fill(path: Path) -> None:
    """Write until the file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def s_disk(c: Campaign, r: Result) -> None:
    """Full and read-only disks: snapshots to a full tmpfs (kept recording, retried after
    space is freed), to a read-only one; the agent's own folder on a read-only and on a full
    file system (no socket: the program runs on, silently); `gpumon run` there."""
    full, ro = mount("full", "1m"), mount("ro", "1m", ro=True)
    if full is None or ro is None:
        r.skipped = "needs root (mount -t tmpfs)"
        return
    notes = []
    try:
        v = c.victim(r)
        x = Raw(v.sock)
        fill(full / "filler")
        rep = x.request("snapshot_start", {"out": str(full) + "/"}, mid=1)
        notes.append(f"start on a full disk: {'error' if not rep['ok'] else 'ok'}")
        if rep["ok"]:
            rep = x.request("snapshot_stop", {}, mid=2)
            still = x.request("snapshot_status", mid=3)["result"]["recording"]
            notes.append(f"stop: {rep.get('error', 'ok')[:60]}...; still recording {still}")
            (full / "filler").unlink()
            rep = x.request("snapshot_stop", {}, mid=4)
            notes.append(f"retry after freeing: {'ok' if rep['ok'] else rep['error'][:60]}")
        rep = x.request("snapshot_start", {"out": str(ro / "s.pickle")}, mid=5)
        notes.append(f"read-only: {'refused' if not rep['ok'] else 'accepted?'}")
        r.attempts += 3
        x.close()
        ok = ping_ok(v.sock) and c.end(r, v)
        for where, env in (("read-only", {"GPUMON_DIR": str(ro)}),
                           ("full", {"GPUMON_DIR": str(full / "sub")})):
            if where == "full":
                fill(full / "filler")
            w = Victim(c.work / f"disk-{where}-{c.n}", env=env, wait=False)
            c.n += 1
            time.sleep(3)
            alive = w.alive()
            r.victims.append([w, None, 0, None])
            ok = alive and c.end(r, w) and ok
            g = gpumon("run", "--", "true", env=env)
            one = (g.returncode == 1 and len(g.stderr.strip().splitlines()) == 1) or (
                g.returncode == 0 and not g.stderr)
            notes.append(f"GPUMON_DIR {where}: program ran on {alive}; gpumon run: exit "
                         f"{g.returncode}, {g.stderr.strip()[:100]!r}")
            r.attempts += 2
            ok = ok and one
        r.survived = ok
    finally:
        umount(full)
        umount(ro)
    r.notes.extend(notes)


def s_phases(c: Campaign, r: Result) -> None:
    """phases_breakdown from 10 clients, as fast as the agent allows, during training
    (issue 22's item 1: it crashed the program with SIGSEGV)."""
    v = c.victim(r)
    end = time.monotonic() + max(10.0, 60 * c.scale)
    counts = []

    def hammer():
        n = 0
        try:
            x = Raw(v.sock, timeout=30)
            mid = 0
            while time.monotonic() < end:
                mid += 1
                n += bool(x.request("phases_breakdown", mid=mid, timeout=30).get("ok"))
        except (OSError, AssertionError, ValueError):
            pass
        counts.append(n)
    ts = [threading.Thread(target=hammer) for _ in range(10)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    r.attempts = sum(counts)
    r.survived = v.alive() and ping_ok(v.sock) and c.end(r, v)
    if not r.survived:
        r.notes.append(f"program status {v.proc.returncode}")


def s_flood(c: Campaign, r: Result) -> None:
    """3,000 phases_breakdown in one write, then a client asking 1000 Hz (refused) and the
    highest rate it may set (20 Hz) for the rest of the run."""
    v = c.victim(r)
    x = Raw(v.sock, timeout=120)
    data = b"".join(cmd_line("phases_breakdown", mid=i) for i in range(3000))
    threading.Thread(target=lambda: _quiet(x.s.sendall, data), daemon=True).start()
    y = Raw(v.sock)
    rep = y.request("set_rate", {"rate_hz": 1000}, mid=1)
    notes = [f"1000 Hz: {'refused' if not rep['ok'] else 'ACCEPTED'}"]
    rep = y.request("set_rate", {"rate_hz": 20}, mid=2)
    notes.append(f"20 Hz: {'ok' if rep['ok'] else rep['error']}")
    time.sleep(max(5.0, 20 * c.scale))
    r.attempts = 3002
    x.close()
    y.close()
    r.notes.extend(notes)
    r.survived = ping_ok(v.sock) and c.end(r, v)
    if not r.survived:
        r.notes.append(f"program status {v.proc.returncode}")


def _quiet(fn, *a):
    try:
        fn(*a)
    except OSError:
        pass


def s_snapshot_args(c: Campaign, r: Result) -> None:
    """snapshot_start with seconds 1e308 / Infinity / NaN / 0 / -1 and non-string outs: every
    reply an error, nothing recording, no file, nothing on the program's stderr; a 1 s
    recording stops by itself."""
    v = c.victim(r)
    x = Raw(v.sock)
    bad = [b'{"seconds": 1e308}', b'{"seconds": Infinity}', b'{"seconds": NaN}',
           b'{"seconds": 0}', b'{"seconds": -1}', b'{"out": []}', b'{"out": 1.5}',
           b'{"out": {"a": 1}}', b'{"max_entries": 1000000000000}', b'{"steps": true}']
    wrong = 0
    for i, a in enumerate(bad):
        m = x.send_paced(b'{"v": 1, "type": "cmd", "id": %d, "cmd": "snapshot_start", "args": %s}\n'
                         % (i + 10, a), i + 10)
        wrong += m.get("ok") is True or x.request("snapshot_status", mid=99)["result"]["recording"]
    rep = x.request("snapshot_start", {"seconds": 1.0}, mid=50)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30 and any(
            x.request("snapshot_status", mid=51)["result"][k] for k in ("recording", "dumping")):
        time.sleep(0.1)
    stopped = not x.request("snapshot_status", mid=52)["result"]["recording"]
    r.attempts = len(bad) + 1
    r.notes.append(f"{wrong} accepted; the 1 s recording stopped by itself: {stopped}")
    x.close()
    files = [p.name for p in v.workdir.iterdir()
             if p.name not in ("losses.txt", "stderr.txt", "times.txt", "stop", "gpumon-snapshots")]
    r.survived = rep["ok"] and not wrong and stopped and not files and c.end(r, v)


def s_client_reader(c: Campaign, r: Result) -> None:
    """gpumon's own client against a hostile agent: garbage lines between valid samples; the
    reader thread must deliver every valid sample."""
    from gpumon import client
    rng = random.Random(7)
    path = Path(tempfile.mkdtemp()) / "fake.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)
    n = c.count(10000, 200)
    hello = {"v": 1, "type": "hello", "pid": os.getpid(), "devices": [], "commands": []}
    sample = {"type": "sample", "seq": 0, "t": 1.0, "devices": []}

    def serve():
        s, _ = srv.accept()
        s.sendall(json.dumps(hello).encode() + b"\n")
        for i in range(n):
            s.sendall(garbage(rng) + json.dumps({**sample, "seq": i}).encode() + b"\n")
        s.close()
    threading.Thread(target=serve, daemon=True).start()
    conn = client.AgentConnection.connect(path, timeout=10)
    seqs = []
    while True:
        m = conn.recv(timeout=30)
        if m is None:
            break
        if m.get("type") == "sample" and set(m) == set(sample):
            seqs.append(m["seq"])
    conn.close()
    srv.close()
    r.attempts = n
    r.survived = seqs[-n:] == list(range(n)) if len(seqs) >= n else False
    r.notes.append(f"{len(seqs)} valid samples of {n} delivered (garbage that parses as a "
                   "sample counts too)")


SCENARIOS = {
    "baseline": s_baseline, "kill9": s_kill9, "slow_readers": s_slow_readers, "cycles": s_cycles,
    "many": s_many, "malformed": s_malformed, "other_uid": s_other_uid, "forks": s_forks,
    "exits": s_exits, "disk": s_disk, "phases": s_phases, "flood": s_flood,
    "snapshot_args": s_snapshot_args, "client_reader": s_client_reader,
}


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() + (
            "+dirty" if subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "gpumon"],
                                       capture_output=True, text=True).stdout.strip() else "")
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    ap.add_argument("--scale", type=float, default=1.0, help="attempts and durations x this")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "faults.md"))
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(SCENARIOS)
    work = Path(tempfile.mkdtemp(prefix="gpumon-faults-"))
    os.environ["GPUMON_DIR"] = str(work / "sockets")
    c = Campaign(work, a.scale)
    t0 = time.monotonic()
    for name in names:
        r = Result(name)
        t = time.monotonic()
        try:
            SCENARIOS[name](c, r)
        except Exception as e:  # a broken scenario is reported, the campaign goes on
            r.survived = False
            r.notes.append(f"scenario error: {type(e).__name__}: {e}")
        r.notes.append(f"{time.monotonic() - t:.0f} s")
        if not r.survived:  # a failed scenario may leave its victims running: stopped here,
            for v, twin, *_ in r.victims:  # or the reference run grows as long as they ran
                for w in (v, twin):
                    if w is not None:
                        w.kill()
        c.results.append(r)
        print(r.name, "survived" if r.survived else "did NOT survive", flush=True)
    c.judge_all()
    import torch
    lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M')}, commit {commit()}, scale {a.scale}",
             "",
             f"{platform.node()}: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; Python "
             f"{platform.python_version()}, torch {torch.__version__}; victim: AdamW on "
             "Linear(64,256)+GELU+Linear(256,64), batch 32, CPU, one thread, agent on the "
             "simulated source, phase tracking "
             f"{'off (GPUMON_PHASES=0)' if os.environ.get('GPUMON_PHASES') == '0' else 'on'}. "
             f"{time.monotonic() - t0:.0f} s in all.", "",
             "| scenario | attempts | survived | losses equal | step-time ratio | RSS growth | notes |",
             "|---|---|---|---|---|---|---|"] + [r.row() for r in c.results]
    done = [r for r in c.results if not r.skipped]
    lines.append(f"\n{sum(bool(r.survived) for r in done)} of {len(done)} scenarios survived; "
                 f"losses equal in {sum(bool(r.losses_equal) for r in done if r.losses_equal is not None)}"
                 f" of {sum(r.losses_equal is not None for r in done)}; "
                 f"{sum(r.attempts for r in done)} attempts.")
    out = Path(a.out)
    if not out.exists():
        out.write_text("# Fault campaign (issue 22)\n\nWritten by `benchmarks/faults.py`; newest "
                       "last. Losses equal: every step's loss, bit for bit, against the same "
                       "loop run without gpumon for as many steps. Step-time ratio: median step "
                       "with the agent and the attack over the median step of a twin without "
                       "gpumon run alongside, under the same load (the `baseline` row is the "
                       "agent alone; on a shared 2-core VM the spread between runs is +-10% or "
                       "more). RSS growth: the program's, from the attack's start to its end "
                       "(max over its runs).\n")
    with out.open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if all(r.survived for r in done):
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"kept {work} (agent logs in {work / 'sockets'})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
