"""`gpumon ls` on an 80-column terminal: each row fits (the command is cut at a word with an
ellipsis); piped, the command keeps its 100 characters."""
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

from gpumon.commands.core import LS_FIXED, ls_command_width


def _ls_on_a_pty(cols: int) -> str:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "ls"], stdin=follower,
                         stdout=follower, stderr=follower, env=env)
    os.close(follower)
    out = b""
    try:
        while True:
            r, _, _ = select.select([leader], [], [], 30)
            if not r:
                break
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        p.wait(30)
        os.close(leader)
    return out.decode(errors="replace").replace("\r\n", "\n")


def test_ls_rows_fit_an_80_column_terminal(program):
    p = program(torch=False)  # its command line is a long `python -c` program
    text = _ls_on_a_pty(80)
    rows = [ln for ln in text.splitlines() if ln.strip().startswith(str(p.pid))]
    assert rows, text
    assert all(len(ln) <= 80 for ln in rows), rows
    assert rows[0].endswith("\u2026")  # cut, and marked so


def test_piped_ls_keeps_100_characters_of_the_command():
    class Pipe:
        def isatty(self):
            return False
    assert ls_command_width(Pipe()) == 100
    assert LS_FIXED + 20 <= 80
