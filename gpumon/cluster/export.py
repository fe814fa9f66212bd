"""`gpumon export`: every local agent's figures as Prometheus metrics, one exporter per node.

A front end of ``client.LocalTarget(None)`` (every agent of this user on this node): a thread
drains the target's subscription once per ``interval`` and keeps the latest figures of each
member; a prometheus_client collector turns them into metric families when scraped (``/metrics``)
or when the textfile is written (``--textfile DIR``: ``DIR/gpumon.prom``, written to a temporary
file and renamed, so node_exporter never reads half a file). Members that end are dropped;
new ones appear at the next drain. Each agent is asked (its ``stream`` command) for at most
STREAM_HZ live samples a second on the exporter's connection: the program's own rate, and what
other clients get, stay as they are; the exporter reads a tenth of the messages.

Labels (the same set on every per-device series; an empty value is an absent label to
Prometheus): ``host``, ``rank``, ``local_rank``, ``world_size``, ``device``, ``gpu_uuid``,
``job_id`` (the process's SLURM_JOB_ID, else its Kubernetes pod name), ``pid`` (empty unless
``pid_label``, or where two processes would otherwise share one series: e.g. two programs
without RANK on one GPU), and DCGM's spellings of two of them, so a PromQL join with
dcgm-exporter's series needs no label_replace: ``UUID`` (= gpu_uuid) and ``Hostname``
(= host).

Staleness: ``gpumon_last_sample_age_seconds`` says, per series, how long ago the exporter got
the member's last sample (an agent streams one a second to it). A member silent for more than
``stale_s`` (STALE_S, ``--stale-after``: a stopped or hung process) is left out of every
per-device series and of ``gpumon_agents``, and counted in ``gpumon_stale_agents`` instead; its
figures come back with its next sample.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Any, Iterable

from gpumon.agent.jobenv import job_of  # (also what the tests import from here)

LABELS = ("host", "rank", "local_rank", "world_size", "device", "gpu_uuid", "job_id", "pid",
          "UUID", "Hostname")
STALE_S = 15.0  # a member whose last sample is older than this is left out (see above)
DEFAULT_PORT = 9808
DEFAULT_INTERVAL_S = 5.0
TEXTFILE_NAME = "gpumon.prom"
STREAM_HZ = 1.0  # live samples a second the exporter asks each agent for

# (metric name, help, sample field) for the per-device gauges read from the latest sample
GAUGES = (
    ("gpumon_allocated_bytes", "Bytes allocated by PyTorch's caching allocator "
     "(torch.cuda.memory_allocated)", "allocated"),
    ("gpumon_reserved_bytes", "Bytes reserved by PyTorch's caching allocator "
     "(torch.cuda.memory_reserved)", "reserved"),
    ("gpumon_active_bytes", "Bytes in active blocks of the caching allocator", "active"),
    ("gpumon_peak_allocated_bytes", "Peak allocated bytes since start or the last peak reset "
     "(torch.cuda.max_memory_allocated)", "peak_allocated"),
    ("gpumon_peak_reserved_bytes", "Peak reserved bytes since start or the last peak reset",
     "peak_reserved"),
    ("gpumon_peak_active_bytes", "Peak active bytes since start or the last peak reset",
     "peak_active"),
    ("gpumon_inactive_split_bytes", "Bytes in inactive split blocks (fragmentation)",
     "inactive_split"),
    ("gpumon_process_used_bytes", "GPU memory of this process as NVML sees it", "proc_used"),
    ("gpumon_device_used_bytes", "GPU memory used on the whole device (NVML)", "nvml_used"),
    ("gpumon_device_total_bytes", "GPU memory of the device (NVML)", "nvml_total"),
    ("gpumon_segments", "Segments (cudaMalloc'ed blocks) the allocator holds", "segments"),
)
COUNTERS = (
    ("gpumon_alloc_retries", "cudaMalloc retries after flushing the allocator's cache "
     "(num_alloc_retries)", "alloc_retries"),
    ("gpumon_ooms", "Out-of-memory errors raised by the allocator (num_ooms)", "ooms"),
)
ROLE_ORDER = ("parameters", "gradients", "optimizer_state", "activations", "allocator_cache",
              "non_pytorch")
ENDED_STATES = ("exited", "no_process", "launcher", "helper")
MODULE_TOP_K = 10  # modules exported from the last per-module measurement (bounded labels)




def _s(v: Any) -> str:
    return "" if v is None else str(v)


class _Member:
    __slots__ = ("key", "pid", "hello", "job", "devices", "step", "breakdown", "served",
                 "last_at", "modules")

    def __init__(self, key: str) -> None:
        self.key = key
        self.pid: int | None = None
        self.hello: dict[str, Any] = {}
        self.job = ""
        self.devices: list[dict[str, Any]] = []   # the latest sample's
        self.step: dict[str, Any] | None = None   # the last step event
        self.breakdown: dict[str, Any] | None = None  # the last breakdown event
        self.served = False                        # an agent's hello (not NVML's)
        self.last_at: float | None = None          # when its last figures came (clock)
        self.modules: dict[str, Any] | None = None  # the last per-module measurement


class ExportState:
    """The latest figures of each member of a target, fed the target's messages (``apply``),
    turned into metric families on demand (``families``). Thread-safe."""

    def __init__(self, host: str | None = None, pid_label: bool = False,
                 environ: Any = None, stale_s: float = STALE_S,
                 clock: Any = None) -> None:
        import time
        self.host = host or socket.gethostname()
        self.stale_s = stale_s
        self.clock = clock or time.time
        self.pid_label = pid_label
        self._environ = environ  # pid -> dict (tests); default: /proc/PID/environ
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self.messages = 0
        self.new_agents: list[str] = []  # keys whose agent said hello since the last look

    def _env(self, pid: int | None) -> dict[str, str]:
        if pid is None:
            return {}
        if self._environ is not None:
            return self._environ(pid)
        from gpumon.client import procs
        return procs.environ(pid)

    def apply_all(self, items: Iterable[tuple[float, dict[str, Any]]]) -> None:
        with self._lock:
            for recv_t, msg in items:
                self._apply(msg, recv_t)

    def apply(self, msg: dict[str, Any], recv_t: float | None = None) -> None:
        with self._lock:
            self._apply(msg, recv_t)

    def _apply(self, msg: dict[str, Any], recv_t: float | None = None) -> None:
        self.messages += 1
        key = msg.get("key")
        kind = msg.get("type")
        if key is None:
            return
        if kind == "state":
            if msg.get("state") in ENDED_STATES:
                self._members.pop(key, None)
            return
        m = self._members.get(key)
        if kind == "hello":
            if m is None:
                m = self._members[key] = _Member(key)
            m.pid = msg.get("pid")
            m.hello = msg
            m.served = msg.get("source") != "nvml"
            m.job = msg.get("job_id") or (job_of(self._env(m.pid)) if m.pid else "")
            m.devices, m.step, m.breakdown, m.modules = [], None, None, None
            if m.served:
                self.new_agents.append(key)
            return
        if m is None:
            return
        if kind == "sample":
            m.devices = msg.get("devices") or []
            m.last_at = self.clock() if recv_t is None else recv_t
        elif kind == "history":
            samples = msg.get("samples") or []
            if samples:
                m.devices = samples[-1].get("devices") or []
                m.last_at = self.clock() if recv_t is None else recv_t
        elif kind == "event":
            ev = msg.get("kind")
            if ev == "step":
                m.step = msg
            elif ev == "breakdown":
                m.breakdown = msg
            elif ev == "modules" and msg.get("ok"):
                m.modules = msg

    def have_figures(self, keys: set[str]) -> bool:
        """Whether each of keys has said hello and sent its device figures."""
        with self._lock:
            return all(k in self._members and self._members[k].devices for k in keys)

    def member_count(self) -> int:
        with self._lock:
            return sum(1 for m in self._members.values() if self._live(m, self.clock()))

    def _live(self, m: _Member, now: float) -> bool:
        """A serving agent whose last figures are at most stale_s old (one that has sent none
        yet is live: it just connected)."""
        return m.served and (m.last_at is None or now - m.last_at <= self.stale_s)

    # -- metric families ------------------------------------------------------------------------
    def families(self) -> list[Any]:
        from prometheus_client.core import Metric

        def family(name: str, doc: str, kind: str = "gauge") -> Any:
            return Metric(name, doc, kind)
        gauges = {name: family(name, doc) for name, doc, _ in GAUGES}
        nonpt = family("gpumon_non_pytorch_bytes", "GPU memory of the process outside "
                       "PyTorch's allocator: NVML's process figure minus reserved (CUDA "
                       "context, cuBLAS/NCCL workspaces, ...)")
        roles = family("gpumon_role_bytes", "GPU memory by role (parameters, gradients, "
                       "optimizer_state, activations, allocator_cache, non_pytorch), from the "
                       "agent's last breakdown")
        step_peak = family("gpumon_step_peak_bytes", "The last measured step's peak allocated "
                           "bytes on this device; phase: where it was reached (empty unless "
                           "exact)")
        step_no = family("gpumon_step", "The last measured step's number")
        counters = {name: family(name, doc, "counter") for name, doc, _ in COUNTERS}
        agents = family("gpumon_agents", "Serving gpumon agents on this node whose last sample "
                        "is at most the stale time old")
        stale = family("gpumon_stale_agents", "Connected gpumon agents silent for longer "
                       "than the stale time (a stopped or hung process): their series are "
                       "left out")
        age = family("gpumon_last_sample_age_seconds", "Seconds since the exporter got this "
                     "process's last sample")
        mod_bytes = family("gpumon_module_bytes", f"The last per-module measurement (gpumon "
                           f"modules): the {MODULE_TOP_K} modules holding the most at its "
                           "peak, bytes by part (params, grads, optimizer_state, activations, "
                           "backward)")
        with self._lock:
            now = self.clock()
            rows = self._rows(now)
            live = sum(1 for m in self._members.values() if self._live(m, now))
            agents.add_sample("gpumon_agents", {"host": self.host}, live)
            stale.add_sample("gpumon_stale_agents", {"host": self.host},
                             sum(1 for m in self._members.values() if m.served) - live)
        for labels, d, m in rows:
            if m.last_at is not None:
                age.add_sample("gpumon_last_sample_age_seconds", labels,
                               round(max(0.0, now - m.last_at), 3))
            for name, _, field in GAUGES:
                v = d.get(field)
                if v is not None:
                    gauges[name].add_sample(name, labels, v)
            for name, _, field in COUNTERS:
                v = d.get(field)
                if v is not None:
                    counters[name].add_sample(name + "_total", labels, v)
            used, res = d.get("proc_used"), d.get("reserved")
            if used is not None and res is not None:
                nonpt.add_sample("gpumon_non_pytorch_bytes", labels, max(0, used - res))
            idx = d.get("index")
            bd = _device_of(m.breakdown, idx)
            if bd is not None:
                for role in ROLE_ORDER:
                    v = (bd.get("now") or {}).get(role)
                    if role == "non_pytorch" and v is None and used is not None \
                            and res is not None:
                        v = max(0, used - res)  # (the agent without NVML leaves it to us)
                    if v is not None:
                        roles.add_sample("gpumon_role_bytes", {**labels, "role": role}, v)
            sd = _device_of(m.step, idx)
            if sd is not None and sd.get("peak") is not None:
                exact = bool(sd.get("peak_exact"))
                step_peak.add_sample("gpumon_step_peak_bytes", {
                    **labels, "phase": _s(sd.get("peak_phase")) if exact else "",
                    "exact": "true" if exact else "false"}, sd["peak"])
                if m.step.get("step") is not None:
                    step_no.add_sample("gpumon_step", labels, m.step["step"])
            if m.modules is not None and m.modules.get("device") == idx:
                for path, part, v in module_samples(m.modules):
                    mod_bytes.add_sample("gpumon_module_bytes",
                                         {**labels, "module": path, "part": part}, v)
        return [*gauges.values(), nonpt, roles, step_peak, step_no, mod_bytes,
                *counters.values(), agents, stale, age]

    def _rows(self, now: float) -> list[tuple[dict[str, str], dict[str, Any], _Member]]:
        """(labels, device figures, member) of each live serving member's devices. Labels
        without a value are left out; pid is there where asked, or where two series would
        otherwise be one (two programs without RANK on one GPU)."""
        rows = []
        for m in self._members.values():
            if not self._live(m, now):
                continue
            h = m.hello
            uuids = {d.get("index"): d.get("uuid") for d in h.get("devices") or []}
            for d in m.devices:
                idx = d.get("index")
                uuid = _s(uuids.get(idx))
                values = (self.host, _s(h.get("rank")), _s(h.get("local_rank")),
                          _s(h.get("world_size")), _s(idx), uuid, m.job,
                          _s(m.pid) if self.pid_label else "", uuid, self.host)
                rows.append((dict(zip(LABELS, values)), d, m))
        seen: dict[tuple, int] = {}
        for labels, _, _ in rows:
            k = tuple(labels.values())
            seen[k] = seen.get(k, 0) + 1
        for labels, _, m in rows:
            if seen[tuple(labels.values())] > 1:
                labels["pid"] = _s(m.pid)
        return [({k: v for k, v in labels.items() if v != ""}, d, m) for labels, d, m in rows]


def module_samples(result: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(module, part, bytes) of the MODULE_TOP_K modules that hold the most of their own at
    the measurement's peak: a bounded number of series however large the model."""
    from gpumon.model.modules import ModuleReport
    try:
        rep = ModuleReport.from_result(result)
    except ValueError:
        return []
    out = []
    for row in rep.top(MODULE_TOP_K):
        for part, v in (("params", row.params + row.buffers), ("grads", row.grads),
                        ("optimizer_state", row.optimizer_state),
                        ("activations", row.act_at_peak), ("backward", row.bwd_at_peak)):
            out.append((row.label, part, v))
    return out


def _device_of(event: dict[str, Any] | None, idx: Any) -> dict[str, Any] | None:
    if not event:
        return None
    for d in event.get("devices") or []:
        if d.get("index") == idx:
            return d
    return None


class StateCollector:
    """A prometheus_client collector over an ExportState."""

    def __init__(self, state: ExportState) -> None:
        self.state = state

    def collect(self):
        yield from self.state.families()

    def describe(self):
        return []  # collected at scrape time only


class Exporter:
    """Follows every agent of this node and keeps ``state`` current: the target's messages are
    drained once per ``interval`` seconds (one wake-up, whatever the number of agents)."""

    def __init__(self, target: Any = None, host: str | None = None, pid_label: bool = False,
                 interval: float = DEFAULT_INTERVAL_S, environ: Any = None,
                 max_hz: float | None = STREAM_HZ, stale_s: float = STALE_S) -> None:
        if target is None:
            from gpumon import client
            target = client.LocalTarget(None, nvml_s=None, poll_s=1.0)
        self.target = target
        self.interval = interval
        self.max_hz = max_hz
        self.state = ExportState(host, pid_label, environ, stale_s=stale_s)
        from prometheus_client import CollectorRegistry
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StateCollector(self.state))
        self._sub = target.subscribe()
        self._stop = threading.Event()
        self._drain_lock = threading.Lock()

    def start(self) -> "Exporter":
        self.target.start()
        self.drain()
        return self

    def drain(self) -> None:
        with self._drain_lock:  # (the scrape's and the loop's drains apply in order)
            self.state.apply_all(self._sub.drain())
            new, self.state.new_agents = self.state.new_agents, []
        if new and self.max_hz:
            threading.Thread(target=self._slow_down, args=(new,), daemon=True,
                             name="gpumon-export-stream").start()

    def _slow_down(self, keys: list[str]) -> None:
        """Ask each new agent for at most max_hz live samples to this exporter (its own
        rate, and what other clients get, are unchanged): the figures a scrape sees are at
        most 1/max_hz old, for a tenth of the messages. An agent without the command (an
        older gpumon) keeps streaming at its rate."""
        from gpumon.client import AgentError
        for key in keys:
            try:
                self.target.request(key, "stream", {"max_hz": self.max_hz}, timeout=2.0)
            except (AgentError, OSError):
                pass

    def settle(self, timeout: float = 5.0) -> None:
        """Until every serving agent's figures are in (its history or a sample), or timeout:
        what --once prints right after connecting, however loaded the machine is."""
        import time
        end = time.monotonic() + timeout
        while True:
            self.drain()
            serving = {k for k, m in self.target.members().items() if m.serving}
            if self.state.have_figures(serving) or time.monotonic() > end:
                return
            time.sleep(0.05)

    def write_textfile(self, directory: str) -> str:
        """DIR/gpumon.prom, atomically (a temporary file in DIR, then rename)."""
        from prometheus_client import generate_latest

        from gpumon.agent import paths
        from gpumon.agent.snapshot_files import _umask
        path = os.path.join(directory, TEXTFILE_NAME)
        data = generate_latest(self.registry)
        # Through a checked descriptor of DIR (a link planted there is not followed), readable
        # by node_exporter as prometheus_client's own writer leaves it (0666 & ~umask).
        paths.write_file(path, lambda f: f.write(data), mode=0o666 & ~_umask(),
                         hint="pass a textfile directory of yours or root's")
        return path

    def run(self, textfile: str | None = None, until: Any = None) -> None:
        """Drain (and write the textfile) every interval until stop() or until()."""
        while not self._stop.is_set() and not (until and until()):
            self.drain()
            if textfile:
                self.write_textfile(textfile)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop()
        self.target.close()

    def text(self) -> bytes:
        from prometheus_client import generate_latest
        self.drain()
        return generate_latest(self.registry)


def serve(exporter: Exporter, address: str, port: int) -> Any:
    """/metrics on address:port (prometheus_client's server, in a daemon thread); every scrape
    drains the target first, so figures are as fresh as the agents' last samples."""
    from prometheus_client import start_http_server

    class Draining(StateCollector):
        def collect(self):
            exporter.drain()
            yield from super().collect()

    from prometheus_client import CollectorRegistry
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Draining(exporter.state))
    exporter.registry = reg
    server, thread = start_http_server(port, addr=address, registry=reg)
    return server

