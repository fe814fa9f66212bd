"""One convention for every command: exit 0 ok, 1 runtime failure, 2 usage error; every error
is one line on stderr that starts with `gpumon: ` (once), without a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpumon.commands.core import clip

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SNAP = FIXTURES / "snapshots" / "linear_adam.pickle"
README = Path(__file__).resolve().parents[2] / "README.md"


def gpumon(*argv, timeout=60):
    """gpumon with stdout and stdin not a terminal (a pipe, as `| cat` gives)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMON",)}
    return subprocess.run([sys.executable, "-m", "gpumon", *argv], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def one_line(r):
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("gpumon: ") and not line.startswith("gpumon: gpumon"), line
    assert "Traceback" not in r.stderr
    return line


@pytest.mark.parametrize("argv,status,says", [
    # no terminal for a live view: usage (the command needs --json/--once/--summary there)
    (["attach", str(os.getpid())], 2, "--json"),
    (["view", str(SNAP)], 2, "--summary"),
    # bad input: one line, runtime failure
    (["attach", str(os.getpid()), "--estimate", str(README), "--once"], 1, "not JSON"),
    (["attach", "2147483646", "--once"], 1, "2147483646"),
    (["view", str(README)], 1, "README.md"),
    # a file that exists but is corrupt is bad input for every command that reads one: 1
    (["diff", str(SNAP), str(README)], 1, "README.md"),
    (["estimate", "--config", str(README)], 1, "not valid JSON"),
    (["estimate", "--load", str(README)], 1, "not JSON"),
    (["estimate", "--config", "/no/such/config.json"], 1, "no such config"),
    # bad command line
    (["attach", "PID"], 2, "not a process id"),
    (["run"], 2, "nothing to run"),
    (["estimate", "--params", "1e9", "--gpu", "80", "--fit"], 2, "has no unit"),
    (["view", str(SNAP), "--summary", "--after", "0"], 2, "--after"),
])
def test_status_and_one_prefixed_line(argv, status, says):
    r = gpumon(*argv)
    assert r.returncode == status, (r.returncode, r.stderr)
    assert says in one_line(r)


def test_an_estimate_that_is_json_but_not_an_estimate_is_refused_with_once(tmp_path):
    est = tmp_path / "est.json"
    est.write_text('{"peak_bytes": "lots"}')
    r = gpumon("attach", str(os.getpid()), "--estimate", str(est), "--once")
    assert r.returncode == 1 and "is not a gpumon estimate" in one_line(r)


def test_clip_cuts_at_a_word_with_an_ellipsis():
    cmd = "/usr/bin/python3 examples/train.py --batch-size 16 --learning-rate 0.0003 --epochs 9"
    short = clip(cmd, 60)
    assert len(short) <= 60 and short.endswith("\u2026")
    assert cmd.startswith(short[:-1]) and cmd[len(short) - 1] == " "  # whole words only
    assert clip("python a.py", 60) == "python a.py"
    assert clip("x" * 100, 10) == "x" * 9 + "\u2026"  # one long word: cut, but still marked
