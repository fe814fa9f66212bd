"""Issue 33, item 2: every byte named. Allocations with no Python frame (autograd's backward
thread with stacks='python') are named by what gpumon knows: the .grad the agent saw at the
optimizer step ("gradients of <model>"), the autograd node in their C++ frames, the phase they
were made in (the sidecar's timeline); no group says "<no stack recorded>" when gpumon recorded
the file itself."""
import json
import types

from gpumon.snapshot import Snapshot
from gpumon.snapshot import report
from gpumon.snapshot.analysis import NO_PY_STACK
from gpumon.snapshot.frames import stackless_name

MiB = 1 << 20
PY = [{"filename": "/home/u/model.py", "line": 9, "name": "forward"}]
BWD_CPP = [{"filename": "Functions.cpp", "line": 1,
            "name": "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"}]


def _loop(sidecar: dict | None = None, grads: bool = True, cpp_backward: bool = False):
    """One training step as the trace records it with stacks='python': forward (Python
    frames), backward (no frame: autograd's thread) making two gradients and a temporary,
    the optimizer step (Python frames) at which the two gradients are live."""
    ev = []

    def add(action, addr, size, frames, t):
        ev.append({"action": action, "addr": addr, "size": size, "frames": frames,
                   "time_us": t, "stream": 0})
    add("free_completed", 0x7000_0000, 16 * MiB, [], 10)          # an old buffer freed
    add("alloc", 0x1000_0000, 2 * MiB, PY, 100)                  # activation (forward)
    add("alloc", 0x2000_0000, 4 * MiB, BWD_CPP if cpp_backward else [], 210)  # grad of w1
    add("alloc", 0x3000_0000, 2 * MiB, [], 220)                   # grad of w2
    add("alloc", 0x4000_0000, 1 * MiB, [], 230)                   # backward temporary
    add("free_requested", 0x1000_0000, 2 * MiB, PY, 240)
    add("free_completed", 0x1000_0000, 2 * MiB, PY, 240)
    add("alloc", 0x5000_0000, 3 * MiB, PY, 310)                   # optimizer temporary
    add("free_requested", 0x5000_0000, 3 * MiB, PY, 320)
    add("free_completed", 0x5000_0000, 3 * MiB, PY, 320)
    side = {"format": "gpumon-snapshot-meta", "version": 1, "kind": "manual",
            "stacks": "python", "pid": 7,
            "timeline": {"clock": "time_us", "steps": [{"step": 5, "start_us": 50, "end_us": 400,
                         "phases": [{"phase": "forward", "start_us": 50, "end_us": 200},
                                    {"phase": "backward", "start_us": 200, "end_us": 300},
                                    {"phase": "optimizer", "start_us": 300, "end_us": 400}]}]}}
    if grads:
        side["grads"] = {"clock": "time_us", "names": ["0.weight", "1.weight"],
                         "owners": ["TinyNet"], "owner_of": [0, 0],
                         "steps": [{"time_us": 305, "device": 0,
                                    "ptr": [0x2000_0000, 0x3000_0000],
                                    "size": [4 * MiB, 2 * MiB], "name": [0, 1],
                                    "param_ptr": [0x8000_0000, 0x8100_0000]}]}
    if sidecar is not None:
        side = sidecar
    # the parameters, live before the recording began (the dump's segments hold them)
    blocks = [{"address": a, "size": n, "requested_size": n, "state": "active_allocated"}
              for a, n in ((0x8000_0000, 4 * MiB), (0x8100_0000, 2 * MiB))]
    seg = {"device": 0, "address": 0x8000_0000, "total_size": 20 * MiB, "blocks": blocks}
    return Snapshot({"segments": [seg], "device_traces": [ev]}, "loop.pickle", side)


def test_stackless_name_order():
    assert stackless_name((), "backward", None, "TinyNet") == "gradients of TinyNet"
    cpp = (("Functions.cpp", 1, BWD_CPP[0]["name"]),)
    assert stackless_name(cpp, "backward") == "autograd MmBackward0"
    assert stackless_name((), "backward", "model.layers.3") == "made in backward of model.layers.3"
    assert stackless_name((), "backward") == "made in backward"
    assert stackless_name() is None


def test_gradients_and_backward_temporaries_are_named_at_the_peak():
    snap = _loop()
    tr = snap.trace()
    keys = {g.key: g.bytes for g in tr.groups_at(tr.peak_index)}
    assert keys == {"<gradients of TinyNet>": 6 * MiB, "<made in backward>": 1 * MiB,
                    "model.py:9 forward": 3 * MiB, "<parameters of TinyNet>": 6 * MiB}, keys
    s = json.loads(report.summary_json(report.summary(snap)))
    assert all(g["where"] != NO_PY_STACK for g in s["top_at_peak"])
    assert "<gradients of TinyNet>" in report.summary_text(report.summary(snap))
    from gpumon.tui.view.frame import stack_lines
    g = next(g for g in tr.groups_at(tr.peak_index) if "gradients" in g.key)
    lines = stack_lines(tr, "group", g)
    assert "the .grad of 0.weight (gpumon saw it at the optimizer step)" in lines


def test_a_grad_the_agent_saw_beats_its_autograd_node():
    tr = _loop(cpp_backward=True).trace()
    keys = {g.key for g in tr.groups_at(tr.peak_index)}
    assert "<gradients of TinyNet>" in keys and "<autograd MmBackward0>" not in keys
    # without the agent's grads, the C++ frames name it
    tr = _loop(grads=False, cpp_backward=True).trace()
    keys = {g.key: g.bytes for g in tr.groups_at(tr.peak_index)}
    assert keys["<autograd MmBackward0>"] == 4 * MiB
    assert keys["<made in backward>"] == 3 * MiB


def test_no_group_says_no_stack_recorded_when_gpumon_recorded_it():
    side = {"format": "gpumon-snapshot-meta", "version": 1, "stacks": "python"}
    tr = _loop(sidecar=side).trace()
    keys = {g.key for g in tr.groups_at(tr.peak_index)}
    assert NO_PY_STACK not in keys
    assert "<C++ with no Python caller>" in keys
    # a file with no sidecar: what the trace says, and no more
    tr = _loop(sidecar={}).trace()
    assert NO_PY_STACK in {g.key for g in tr.groups_at(tr.peak_index)}


def test_hostile_grads_in_a_sidecar_are_ignored():
    for bad in ({"steps": "x"}, {"steps": [{"time_us": "1", "ptr": [1], "name": [0]}]},
                {"steps": [{"time_us": 305, "ptr": [0x2000_0000], "name": [99]}],
                 "names": "nope"}, [], {"names": [1, 2], "owner_of": "x",
                                        "steps": [{"time_us": 305, "ptr": [0x2000_0000],
                                                   "name": [5]}]}):
        side = {"format": "gpumon-snapshot-meta", "stacks": "python", "grads": bad}
        tr = _loop(sidecar=side).trace()
        assert sum(g.bytes for g in tr.groups_at(tr.peak_index)) == tr.peak


def test_grad_log_takes_plain_numbers_at_the_hook():
    from gpumon.agent.grads import GradLog

    def grad(ptr, n):
        return types.SimpleNamespace(is_sparse=False, data_ptr=lambda: ptr, nbytes=n,
                                     device=types.SimpleNamespace(index=0, type="cuda"))
    p1 = types.SimpleNamespace(grad=grad(0x2000_0000, 4 * MiB), shape=(1024, 1024),
                               data_ptr=lambda: 0x9000_0000)
    p2 = types.SimpleNamespace(grad=None, shape=(3,))
    p3 = types.SimpleNamespace(grad=grad(0x3000_0000, 2 * MiB), shape=(512, 1024),
                               data_ptr=lambda: 0xA000_0000)
    opt = types.SimpleNamespace(param_groups=[{"params": [p1, p2]}, {"params": [p3]}])
    log = GradLog()
    log.on_step_pre(opt, (), {})
    log.on_step_pre(types.SimpleNamespace(param_groups=None), (), {})   # never raises
    d = log.export()
    assert d["steps"][0]["ptr"] == [0x2000_0000, 0x3000_0000]
    assert d["steps"][0]["size"] == [4 * MiB, 2 * MiB]
    assert d["steps"][0]["param_ptr"] == [0x9000_0000, 0xA000_0000]
    assert d["names"] == ["param_groups[0][0] (1024, 1024)", "param_groups[1][0] (512, 1024)"]
    assert d["owners"] == ["SimpleNamespace's parameters"] and d["owner_of"] == [0, 0]
    json.dumps(d)  # plain data for the sidecar


# -- on the real GPU fixtures (tests/fixtures/snapshots, recorded by gpumon's own recorder) ----
import os  # noqa: E402

import pytest  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "snapshots")


@pytest.mark.parametrize("name", ["transformer", "linear_adam"])
def test_real_fixture_has_no_unnamed_group_at_the_peak(name):
    from gpumon.snapshot import open_snapshot
    snap = open_snapshot(os.path.join(FIXTURES, f"{name}.pickle"))
    tr = snap.trace()
    keys = [g.key for g in tr.groups_at(tr.peak_index)]
    assert NO_PY_STACK not in keys, keys
    assert NO_PY_STACK not in report.summary_text(report.summary(snap))


def test_real_all_stacks_fixture_opens_every_group_with_python():
    """scripts/make_snapshot_fixtures.py --only transformer_all (on a GPU) makes the file."""
    from gpumon.snapshot import open_snapshot
    path = os.path.join(FIXTURES, "transformer_all.pickle")
    if not os.path.exists(path):
        pytest.skip("no transformer_all.pickle yet (made on a GPU: gpu_session.sh fixtures)")
    snap = open_snapshot(path)
    tr = snap.trace()
    checked = 0
    for g in tr.groups_at(tr.peak_index):
        fid = tr.el_fid[g.elements[0]]
        if not fid:
            continue
        has_py = any(f[0].endswith(".py") for f in tr.frames(fid))
        first = report._group_dict(tr, g)["largest_stack"][0]
        assert first.split(":")[0].endswith(".py") == has_py, (g.key, first)
        checked += 1
    assert checked
