"""The `slow` list in tests/conftest.py names tests that exist: an entry left behind by a
renamed test would silently stop marking it (and `-m "not slow"` would run it again)."""
import re

from conftest import ROOT, SLOW


def test_every_slow_entry_names_a_test_file_or_function_that_exists():
    stale = []
    for entry in SLOW:
        path, _, name = entry.partition("::")
        f = ROOT / path
        if not f.is_file():
            stale.append(entry)
        elif name and not re.search(rf"^(async )?def {re.escape(name)}", f.read_text(), re.M):
            stale.append(entry)
    assert not stale, stale


def test_the_cluster_tests_that_start_real_systems_are_slow():
    for f in ("test_ssh.py", "test_prometheus.py", "test_slurm.py"):
        assert f"tests/cluster/{f}" in SLOW
