"""Simulated ranks for the cluster tests: real Python processes with the agent started and the
simulated source serving at once, each with the environment torchrun (and Slurm) would give it,
in a socket directory of the test's choosing (one per "node")."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumon import client
from polling import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent

RANK_PROGRAM = ("import gpumon, sys, time\n"
                "gpumon.start()\n"
                "print('up', flush=True)\n"
                "sys.stdin.read()\n")  # until the test closes our stdin (or kills us)


def sim_env(base: Path, rank: int, world: int, local_rank: int, **extra: str) -> dict:
    e = dict(os.environ, GPUMON_DIR=str(base), GPUMON_SOURCE="simulated",
             GPUMON_SIM_READY="now", GPUMON_RATE="10", RANK=str(rank), WORLD_SIZE=str(world),
             LOCAL_RANK=str(local_rank), GPUMON_SIM_STEP="0.5")
    e.pop("GPUMON", None)
    e.update(extra)
    return e


def socket_dir_of(base: Path) -> Path:
    return base / f"gpumon-{os.getuid()}"


class Ranks:
    """Simulated ranks on "nodes" (socket directories)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, base: Path, ranks: list[int], world: int, **extra: str
              ) -> list[subprocess.Popen]:
        d = socket_dir_of(base)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        out = []
        for i, r in enumerate(ranks):
            p = subprocess.Popen([sys.executable, "-c", RANK_PROGRAM],
                                 env=sim_env(base, r, world, i, **extra),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, cwd=base)
            self.procs.append(p)
            out.append(p)
        for p in out:
            assert p.stdout.readline() == "up\n"
            wait_for(lambda: (d / f"{p.pid}.sock").exists(), what=f"rank pid {p.pid}'s socket")
        return out

    def stop(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            p.kill()
        p.wait(10)

    def close(self) -> None:
        for p in self.procs:
            self.stop(p)
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except OSError:
                    pass


def _started_here(base: str) -> dict[int, str]:
    """{pid: command line} of the live processes whose command line or environment names this
    worker's temporary folder: what its tests started (daemons with their config files there,
    sessions and relays with a GPUMON_DIR there, Slurm's steps with SLURM_CONF there)."""
    import psutil
    out = {}
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["pid"] == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        try:
            hit = base in cmd or any(base in v for v in p.environ().values())
        except (psutil.Error, OSError):
            continue
        if hit:
            out[p.info["pid"]] = cmd[:200]
    return out


@pytest.fixture(autouse=True)
def nothing_left_running(tmp_path_factory):
    """After each cluster test, no process it started is still there: sshd and its sessions,
    relays, Prometheus, slurmctld/slurmd/slurmstepd, exporters, ranks (teardown runs after the
    test's own fixtures). What is left is killed, then named in the failure."""
    import psutil
    base = str(tmp_path_factory.getbasetemp()) + os.sep  # (pytest-1 is not pytest-10)
    before = set(_started_here(base))
    yield

    def left_now():
        return {k: v for k, v in _started_here(base).items() if k not in before}
    left = left_now()
    end = time.monotonic() + 10  # what is ending (a relay after its session's EOF): a moment
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = left_now()
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"processes left running after the test: {left}"


@pytest.fixture
def ranks():
    r = Ranks()
    yield r
    r.close()


def scan_in(base: Path) -> dict:
    old = os.environ.get("GPUMON_DIR")
    os.environ["GPUMON_DIR"] = str(base)
    try:
        return client.scan()
    finally:
        if old is None:
            os.environ.pop("GPUMON_DIR", None)
        else:
            os.environ["GPUMON_DIR"] = old


# -- a real OpenSSH server on localhost, one port per "node" -------------------------------------
SSHD = "/usr/sbin/sshd"


class SshNodes:
    """sshd listeners on 127.0.0.1, one per node name, each giving its sessions a GPUMON_DIR of
    its own (sshd_config SetEnv), with a host key and an authorized key made for the test, and
    an ssh client config naming the nodes: what `--ssh "ssh -F CONFIG"` uses."""

    def __init__(self, root: Path) -> None:
        import shutil
        self.root = root
        self.ssh = shutil.which("ssh")
        keygen = shutil.which("ssh-keygen")
        if not (os.path.exists(SSHD) and self.ssh and keygen):
            pytest.skip("OpenSSH server or client not installed (Debian: apt-get install "
                        "openssh-server openssh-client)")
        root.mkdir(mode=0o700, exist_ok=True)
        for name in ("host_key", "client_key"):
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)],
                           check=True, capture_output=True)
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        os.chmod(root / "authorized_keys", 0o600)
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        self.nodes: dict[str, dict] = {}
        self.config = root / "ssh_config"

    def add(self, name: str, gpumon_base: Path | None, env: dict | None = None) -> None:
        """A node whose sessions get GPUMON_DIR=gpumon_base (None: no GPUMON_DIR, so gpumon
        looks where it would on a real node) and the variables of env (XDG_RUNTIME_DIR, as
        pam_systemd gives a login; TMPDIR)."""
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = self.root / f"sshd_{name}"
        setenv = {**({"GPUMON_DIR": gpumon_base} if gpumon_base else {}), **(env or {})}
        pythonpath = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
        cfg.write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {self.root / 'host_key'}
PidFile {self.root / f'sshd_{name}.pid'}
AuthorizedKeysFile {self.root / 'authorized_keys'}
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
PrintMotd no
LogLevel ERROR
SetEnv {" ".join(f"{k}={v}" for k, v in setenv.items())} PYTHONPATH={pythonpath}
""")
        self.nodes[name] = {"port": port, "cfg": cfg, "proc": None}
        self._write_client_config()
        self.start(name)

    def _write_client_config(self) -> None:
        import getpass
        lines = []
        for name, n in self.nodes.items():
            lines += [f"Host {name}", "  HostName 127.0.0.1", f"  Port {n['port']}"]
        lines += ["Host *", f"  User {getpass.getuser()}",
                  f"  IdentityFile {self.root / 'client_key'}", "  IdentitiesOnly yes",
                  "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null",
                  "  LogLevel ERROR", "  ConnectTimeout 5"]
        self.config.write_text("\n".join(lines) + "\n")

    def start(self, name: str) -> None:
        import socket
        n = self.nodes[name]
        n["proc"] = subprocess.Popen([SSHD, "-D", "-e", "-f", str(n["cfg"])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)

        def listening():
            if n["proc"].poll() is not None:
                raise AssertionError(f"sshd exited: {n['proc'].stderr.read().decode()}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", n["port"])) == 0
        wait_for(listening, what=f"sshd of {name} listening")

    def stop(self, name: str) -> None:
        """The node goes away: its listener and every session of it (relays included)."""
        import psutil
        n = self.nodes[name]
        p = n["proc"]
        if p is None:
            return
        try:
            kids = psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        p.kill()
        for k in kids:
            try:
                k.kill()
            except psutil.NoSuchProcess:
                pass
        p.wait(10)
        p.stderr.close()
        n["proc"] = None

    @property
    def ssh_cmd(self) -> str:
        return f"{self.ssh} -F {self.config}"

    @property
    def remote_gpumon(self) -> str:
        return f"{sys.executable} -m gpumon"

    def close(self) -> None:
        for name in list(self.nodes):
            self.stop(name)


@pytest.fixture
def ssh_nodes(tmp_path_factory):
    n = SshNodes(tmp_path_factory.mktemp("ssh"))
    yield n
    n.close()
