"""Every pid argument of every command: not a positive whole number is one line, status 2
(issue 16: `gpumon attach -5 --once` printed a traceback)."""
import pytest

from .conftest import gpumon

COMMANDS = [["attach", "{pid}", "--once"], ["attach", "{pid}", "--json"], ["attach", "{pid}"],
            ["snapshot", "{pid}", "--status"], ["inject", "{pid}"], ["detach", "{pid}"],
            ["estimate", "--params", "1e6", "--check", "{pid}"]]


def _one_line_status_2(argv, bad):
    r = gpumon(*[a.format(pid=bad) for a in argv])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"gpumon: {bad!r} is not a process id: a pid is a positive whole "
                        "number (see `gpumon ls`)\n")


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_every_command_refuses_a_negative_pid(argv):
    _one_line_status_2(argv, "-5")


@pytest.mark.parametrize("bad", ["0", "abc", "1.5", "", "99999999999999999999x"])
def test_what_is_not_a_pid(bad):
    _one_line_status_2(["attach", "{pid}", "--once"], bad)
