import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def gpumon_dir(tmp_path_factory, monkeypatch):
    """Every test gets its own socket directory, so agents of different tests never meet: the
    directory where the sockets are (``$GPUMON_DIR/gpumon-<uid>``, made here as gpumon would)."""
    base = tmp_path_factory.mktemp("gpumon-sock")
    monkeypatch.setenv("GPUMON_DIR", str(base))
    d = base / f"gpumon-{os.getuid()}"
    d.mkdir(mode=0o700)
    # The simulated source serves at once in tests, unless a test sets "torch": it then waits,
    # as the torch source waits for CUDA, until the program imports torch.
    monkeypatch.setenv("GPUMON_SIM_READY", "now")
    # gpumon view's cache of loaded snapshots: the test's own (never the user's ~/.cache)
    monkeypatch.setenv("GPUMON_VIEW_CACHE_DIR", str(base / "view-cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return d


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_in_the_checkout():
    """A test's program writes its snapshots into its own cwd: the checkout's
    gpumon-snapshots/ (where a user's own demo snapshots go) gets nothing from the tests."""
    d = ROOT / "gpumon-snapshots"
    before = set(d.rglob("*")) if d.exists() else set()
    yield
    new = (set(d.rglob("*")) if d.exists() else set()) - before
    assert not new, f"tests left files in the checkout: {sorted(map(str, new))[:5]}"


@pytest.fixture
def python():
    return sys.executable


# Tests that take more than ~5 s on a 2-core machine (measured with --durations=30): marked
# `slow` here, in one place, so `pytest -m "not slow"` gives a quick loop while the whole suite
# (scripts/test.sh, CI) still runs them. By file, or file::name prefix.
SLOW = (
    "tests/estimate/test_cpu_peak.py",
    "tests/estimate/test_live_check.py::test_check_",
    "tests/estimate/test_measure.py::test_tiny_transformer_eager_meta_equals_direct_cpu",
    "tests/inject/test_inject.py::test_inject_read_detach_into_torch_process",
    "tests/inject/test_inject.py::test_torch_source_waits_for_cuda_and_detach_removes_it",
    "tests/faults/test_phases.py",
    "tests/phases/test_frameworks.py",
    "tests/phases/test_counters_program.py",
    "tests/faults/test_client.py::test_ls_and_attach_say_one_line_for_a_deeply_nested_hello",
    "tests/faults/test_inputs.py::test_a_deep_line_cannot_overflow_the_c_stack",
    "tests/phases/test_agent_integration.py::test_step_and_breakdown_events_and_status",
    "tests/phases/test_breakdown_thread.py",
    "tests/core/test_cli.py::test_demo_once",
    "tests/core/test_protocol.py::test_any_plain_payload_roundtrips",
    "tests/core/test_protocol.py::test_sample_template_equals_json",
    "tests/core/test_start_paths.py::test_a_process_that_never_uses_cuda_never_appears",
    "tests/view/test_fuzz.py",
    "tests/client/test_waiting.py::test_snapshot_steps_before_cuda_is_armed_",
    "tests/tui/test_interrupt_screens.py::test_demo_on_a_terminal_",
    "tests/modules/test_agent_run.py",
    # a victim process per mode (torch, dynamo, export: ~6-8 s each on an idle 2-core VM); the
    # process ops start DDP/FSDP2 ranks and spawn workers, twice (plain, gpumon run)
    "tests/compat/test_model_ops.py",
    "tests/compat/test_process.py::test_ctrl_c_during_start_up_is_the_plain_programs",
    "tests/compat/test_process.py::test_at_the_fd_limit_a_client_costs_nothing",
    # real systems started by the test: sshd, Prometheus, Slurm (~16 s together on an idle
    # 2-core machine, ~49 s on a loaded one)
    "tests/cluster/test_ssh.py",
    "tests/cluster/test_prometheus.py",
    "tests/cluster/test_slurm.py",
    "tests/cluster/test_discovery_places.py::test_the_relay_over_sshd",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        nodeid = item.nodeid
        if any(nodeid.startswith(s) for s in SLOW):
            item.add_marker(pytest.mark.slow)
