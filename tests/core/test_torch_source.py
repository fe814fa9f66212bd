"""The real torch source against a fake ``torch`` in sys.modules that records every call, so
we can see on a CPU-only machine that it waits for the program's CUDA init and never touches
(so never creates a context on) a device the program has not used."""
import sys
import types

import pytest

from gpumon.agent import sources
from gpumon.agent.sources import TorchSource


def nested_stats(alloc, reserved, peak):
    def stat(cur, pk=None):
        return {"all": {"current": cur, "peak": pk if pk is not None else cur,
                        "allocated": cur, "freed": 0}}
    return {
        "allocated_bytes": stat(alloc, peak), "reserved_bytes": stat(reserved),
        "active_bytes": stat(alloc, peak), "requested_bytes": stat(alloc - 10),
        "inactive_split_bytes": stat(reserved - alloc), "segment": stat(3),
        "num_alloc_retries": 1, "num_ooms": 0, "num_device_alloc": 4, "num_device_free": 1,
    }


class FakeTorch(types.ModuleType):
    def __init__(self, n_devices=4):
        super().__init__("torch")
        self.__version__ = "9.9.9+fake"
        self.calls = []
        self.initialized = False
        self.contexts = set()  # devices the "program" has used
        calls, ctx, me = self.calls, self.contexts, self

        def touch(what, i):
            calls.append((what, i))
            if i not in ctx:
                raise AssertionError(f"{what}({i}) on a device the program never used")

        class C:
            @staticmethod
            def _cuda_getDeviceCount():
                return n_devices

            @staticmethod
            def _cuda_hasPrimaryContext(i):
                calls.append(("hasPrimaryContext", i))  # a query: creates nothing
                return i in ctx

            @staticmethod
            def _cuda_memoryStats(i):
                touch("memoryStats", i)
                return nested_stats(100 + i, 200 + i, 150 + i)

            @staticmethod
            def _cuda_resetPeakMemoryStats(i):
                touch("resetPeak", i)

        class Cuda:
            @staticmethod
            def is_initialized():
                return me.initialized

            @staticmethod
            def get_device_properties(i):
                touch("get_device_properties", i)
                return types.SimpleNamespace(name=f"Fake GPU {i}", total_memory=1 << 34,
                                             uuid=f"0000-{i}")

            @staticmethod
            def get_allocator_backend():
                return "native"

            @staticmethod
            def mem_get_info(*a):
                raise AssertionError("mem_get_info creates a CUDA context")

            @staticmethod
            def memory_stats(*a):
                raise AssertionError("memory_stats flattens (180 us): use the raw call")

        self._C = C
        self.cuda = Cuda


@pytest.fixture
def fake_torch(monkeypatch):
    t = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", t)
    return t


def test_waits_for_the_programs_cuda_init_and_first_context(fake_torch):
    src = TorchSource()
    assert not src.ready()
    assert fake_torch.calls == []  # not even a query before the program initialised CUDA
    fake_torch.initialized = True
    assert not src.ready()  # initialised, but no device used yet
    fake_torch.contexts.add(2)
    assert src.ready()


def test_reads_only_the_devices_the_program_used(fake_torch):
    fake_torch.initialized = True
    fake_torch.contexts.add(2)
    src = TorchSource()
    assert src.ready()
    src.setup()
    assert src.device_indices() == [2]
    assert src.device_info() == [{"index": 2, "name": "Fake GPU 2", "total": 1 << 34,
                                  "uuid": "GPU-0000-2"}]  # NVML's form, as DCGM labels it
    (d,) = src.read()
    assert d["index"] == 2 and d["allocated"] == 102 and d["reserved"] == 202
    assert d["peak_allocated"] == 152 and d["requested"] == 92 and d["inactive_split"] == 100
    assert (d["segments"], d["alloc_retries"], d["device_alloc"], d["device_free"]) == (3, 1, 4, 1)
    src.reset_peaks()
    # Every call that names a device names device 2, except the context query itself.
    assert {i for what, i in fake_torch.calls if what != "hasPrimaryContext"} == {2}
    assert src.info()["torch"] == "9.9.9+fake"
    assert src.info()["allocator"]["backend"] == "native"


def test_a_device_used_later_is_picked_up(fake_torch, monkeypatch):
    fake_torch.initialized = True
    fake_torch.contexts.add(1)
    src = TorchSource()
    assert src.ready()
    src.setup()
    monkeypatch.setattr(TorchSource, "DEVICE_PERIOD", 0.0)
    assert src.refresh() is False  # nothing new
    fake_torch.contexts.add(0)
    assert src.refresh() is True
    assert [d["index"] for d in src.read()] == [0, 1]
    assert {i for what, i in fake_torch.calls if what != "hasPrimaryContext"} == {0, 1}


def test_old_torch_without_some_stats_gives_none_not_a_crash(fake_torch, monkeypatch):
    fake_torch.initialized = True
    fake_torch.contexts.add(0)
    old = nested_stats(5, 6, 7)
    del old["requested_bytes"], old["num_device_alloc"], old["num_device_free"]
    monkeypatch.setattr(fake_torch._C, "_cuda_memoryStats", staticmethod(lambda i: old))
    src = TorchSource()
    assert src.ready()
    src.setup()
    (d,) = src.read()
    assert d["allocated"] == 5 and d["requested"] is None and d["device_alloc"] is None


def test_nvml_failures_are_values_not_errors(fake_torch, monkeypatch):
    """No NVML here (no driver): the source still reads, with NVML figures None and a reason."""
    fake_torch.initialized = True
    fake_torch.contexts.add(0)
    src = TorchSource()
    assert src.ready()
    src.setup()
    if src.nvml.ok:
        pytest.skip("NVML works on this machine")
    assert isinstance(src.info()["nvml"], str) and "\n" not in src.info()["nvml"]
    (d,) = src.read()
    assert d["nvml_used"] is None and d["nvml_total"] is None and d["proc_used"] is None


def test_nvml_cadence_keeps_the_process_list_rare(fake_torch, monkeypatch):
    """The ~400 us process list: at the first read, then only after reserved moved (>= 1 s
    later) or every 5 s, or when a caller asks for fresh figures; device memory at <= 2 Hz."""
    fake_torch.initialized = True
    fake_torch.contexts.add(0)
    clock = [100.0]
    monkeypatch.setattr(sources, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    reserved = [200]
    monkeypatch.setattr(fake_torch._C, "_cuda_memoryStats",
                        staticmethod(lambda i: nested_stats(100, reserved[0], 150)))
    calls = []

    class FakeNvml:
        ok = True
        error = None

        def memory(self, h):
            calls.append("mem")
            return 1000, 5000

        def process_used(self, h, pids):
            calls.append("proc")
            return 900

    src = TorchSource()
    assert src.ready()
    src.setup()
    src.nvml = FakeNvml()

    def read_at(t, **kw):
        clock[0] = 100.0 + t
        calls.clear()
        d = src.read(**kw)[0]
        assert (d["nvml_used"], d["nvml_total"], d["proc_used"]) == (1000, 5000, 900)
        return list(calls)

    assert read_at(0.0) == ["mem", "proc"]
    assert read_at(0.05) == []
    assert read_at(0.2) == []               # device memory: every 0.5 s
    assert read_at(0.6) == ["mem"]
    assert read_at(1.5) == ["mem"]          # reserved unchanged: no process list
    reserved[0] = 400
    assert read_at(1.55) == ["proc"]        # reserved moved, last list 1.55 s ago
    reserved[0] = 600
    assert read_at(1.6) == []               # moved again, but within 1 s
    assert read_at(7.0) == ["mem", "proc"]  # the 5 s period
    assert read_at(7.01, fresh=True) == ["mem", "proc"]
