"""The agent's log is the program's neighbour, never its burden (issue 30 items 1, 2, 4): it keeps
no descriptor open between lines, is rate-limited with a count of what it dropped, stays under
its size bound, and never writes through a symbolic link planted where the file goes."""
from __future__ import annotations

import logging
import os

import pytest

from gpumon.agent import log as agent_log


def _logger(path, **kw) -> tuple[logging.Logger, agent_log._BoundedFileHandler]:
    lg = logging.getLogger(f"gpumon.test.{path}")
    lg.propagate = False
    h = agent_log._BoundedFileHandler(str(path), **kw)
    h.setFormatter(logging.Formatter("%(asctime)s gpumon[%(process)d] %(levelname)s %(message)s"))
    h.addFilter(agent_log._RateLimit(burst=5, every_s=3600))
    lg.handlers[:] = [h]
    lg.setLevel(logging.INFO)
    return lg, h


def test_a_fault_that_repeats_costs_a_few_lines_and_says_how_many_were_dropped(tmp_path,
                                                                              monkeypatch):
    """Before: 75,693 tracebacks (21.6 MB) in ~10 s from one failing accept."""
    lg, h = _logger(tmp_path / "agent.log")
    for i in range(10_000):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            lg.exception("accept failed %d", i)
    text = (tmp_path / "agent.log").read_text()
    assert text.count("accept failed") == 5 and text.count("Traceback") == 5
    # the next line that passes says how many were dropped
    h.filters[0].tokens = 1.0
    lg.warning("later")
    text = (tmp_path / "agent.log").read_text()
    assert "9995 messages suppressed" in text and text.rstrip().endswith("later")


def test_the_file_stays_bounded(tmp_path):
    lg, h = _logger(tmp_path / "agent.log", max_bytes=4096)
    h.filters[:] = []  # no rate limit: only the size bound
    for i in range(2000):
        lg.info("line %d %s", i, "x" * 60)
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.log", "agent.log.1"]
    assert max(sizes) <= 4096 and "line 1999" in (tmp_path / "agent.log").read_text()


def test_no_descriptor_is_kept_between_lines(tmp_path):
    """A program that closes every fd must never get a line of ours in its own files."""
    lg, _ = _logger(tmp_path / "agent.log")
    before = set(os.listdir("/proc/self/fd"))
    lg.warning("one")
    assert set(os.listdir("/proc/self/fd")) == before
    assert "one" in (tmp_path / "agent.log").read_text()


def test_a_planted_link_is_not_followed(tmp_path):
    """The log's name a symbolic link to a file of someone else's: nothing is written there."""
    victim = tmp_path / "their-file"
    victim.write_text("theirs\n")
    d = tmp_path / "logs"
    d.mkdir(mode=0o700)
    os.symlink(victim, d / "agent.log")
    lg, _ = _logger(d / "agent.log")
    lg.warning("ours")
    assert victim.read_text() == "theirs\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
def test_a_folder_of_another_user_is_not_written(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    lg, _ = _logger(d / "agent.log")
    lg.warning("ours")
    assert os.listdir(d) == []
