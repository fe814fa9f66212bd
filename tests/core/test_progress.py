"""Plain commands show progress (Rich's own spinner and elapsed time, on stderr) for work that
takes seconds, only on a terminal: piped output stays exactly as it was."""
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from gpumon.commands.args import progress

SNAP = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots" / "transformer.pickle"


def test_no_terminal_no_progress(capsys):
    with progress("working"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_view_on_a_terminal_says_what_it_reads_while_it_reads():
    """`gpumon view FILE --summary` on a pseudo-terminal: the spinner names the file and its
    size (a 51 MiB file took 10 s of blank screen before)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "view", str(SNAP), "--summary"],
                         stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    out = b""
    try:
        while True:
            r, _, _ = select.select([leader], [], [], 60)
            if not r:
                break
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        p.wait(60)
        os.close(leader)
    text = out.decode(errors="replace")
    assert p.returncode == 0, text[-2000:]
    size = SNAP.stat().st_size
    shown = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 1024:.0f} KiB"
    assert f"reading transformer.pickle ({shown})" in text, text[:2000]
    assert "peak allocated" in text  # and then the summary itself
