"""Simulated ranks for the cluster tests: real Python processes with the agent started and the
simulated source serving at once, each with the environment torchrun (and Slurm) would give it,
in a socket directory of the test's choosing (one per "node")."""
from __future__ import annotations

import os
import subprocess
import sys
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
                                 stderr=subprocess.DEVNULL, text=True)
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
