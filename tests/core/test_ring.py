"""The ring buffer and the history it hands to a new client, without threads or sockets."""
import json
import socket

from gpumon import protocol
from gpumon.agent import core, server
from gpumon.agent.sources import SimulatedSource


class CountingSource(SimulatedSource):
    pass


def make_agent(rate=10.0):
    a = core.Agent(SimulatedSource(devices=[0, 1]), rate_hz=rate)
    return a


def test_ring_holds_ten_minutes_at_10hz_and_is_bounded():
    a = make_agent(10.0)
    assert a._ring.maxlen >= 600 * 10
    n = a._ring.maxlen + 123
    for _ in range(n):
        a._sample()
    assert len(a._ring) == a._ring.maxlen
    assert a._ring_first == 123
    first = json.loads(a._ring[0])
    last = json.loads(a._ring[-1])
    assert first["seq"] == 123 and last["seq"] == n - 1


def test_ring_grows_with_rate_to_keep_ten_minutes_within_a_cap():
    a = make_agent(10.0)
    for _ in range(50):
        a._sample()
    a.set_rate(50.0)
    assert a._ring.maxlen >= 600 * 50
    assert len(a._ring) == 50 and json.loads(a._ring[0])["seq"] == 0
    a.set_rate(1000.0)
    assert a._ring.maxlen == core.MAX_RING


def test_samples_have_every_field():
    a = make_agent()
    a._sample()
    s = json.loads(a._ring[-1])
    for f in protocol.SAMPLE_FIELDS:
        assert f in s
    assert [d["index"] for d in s["devices"]] == [0, 1]
    for d in s["devices"]:
        assert set(protocol.DEVICE_FIELDS) <= set(d)
        assert d["allocated"] <= d["reserved"] <= d["nvml_used"] <= d["nvml_total"]
        assert d["peak_allocated"] >= d["allocated"]


def _drain_history(a, c):
    """Run the agent's history filler until done, reading what it sends."""
    got = []
    while True:
        a._fill_history(c)
        data = bytes(c.out)
        c.out.clear()
        for line in data.splitlines():
            m = protocol.decode(line)
            assert m["type"] == "history"
            assert len(m["samples"]) <= protocol.HISTORY_CHUNK
            got.append(m)
        if not c.in_history:
            return got


def test_history_chunks_cover_the_ring_in_order_and_end_with_last():
    a = make_agent()
    for _ in range(1234):
        a._sample()
    s1, s2 = socket.socketpair()
    c = server.Client(s1, 0)
    c.cursor = a._ring_first
    msgs = _drain_history(a, c)
    assert [m["last"] for m in msgs] == [False] * (len(msgs) - 1) + [True]
    seqs = [s["seq"] for m in msgs for s in m["samples"]]
    assert seqs == list(range(1234))
    s1.close(), s2.close()


def test_history_of_an_empty_ring_is_one_empty_last_chunk():
    a = make_agent()
    s1, s2 = socket.socketpair()
    c = server.Client(s1, 0)
    msgs = _drain_history(a, c)
    assert msgs == [{"type": "history", "last": True, "samples": []}]
    s1.close(), s2.close()


def test_history_cursor_that_fell_off_the_ring_jumps_to_the_oldest():
    a = make_agent()
    for _ in range(a._ring.maxlen + 10):
        a._sample()
    s1, s2 = socket.socketpair()
    c = server.Client(s1, 0)
    c.cursor = 0  # older than anything kept
    msgs = _drain_history(a, c)
    assert msgs[0]["samples"][0]["seq"] == a._ring_first
    s1.close(), s2.close()


def test_extras_merge_and_a_failing_extra_is_removed():
    a = make_agent()
    calls = []

    def good():
        return {"phase": "forward", "step": 4, "custom": 1}

    def bad():
        calls.append(1)
        raise RuntimeError("boom")

    core.register_sample_extra(good)
    core.register_sample_extra(bad)
    try:
        a._sample()
        a._sample()
        s = json.loads(a._ring[-1])
        assert s["phase"] == "forward" and s["step"] == 4 and s["custom"] == 1
        assert len(calls) == 1 and bad not in core._sample_extras
    finally:
        for f in (good, bad):
            if f in core._sample_extras:
                core._sample_extras.remove(f)


def test_simulated_step_shape():
    """The scripted step behaves like a training step: the optimizer's first step allocates
    state, reserved never drops except at a retry, retries happen."""
    t = [0.0]
    src = SimulatedSource(devices=[0], step_s=1.0, retry_every=3, clock=lambda: t[0])
    seen = []
    while t[0] < 8.0:
        d = src.read()[0]
        seen.append((src.step, src.phase, d))
        t[0] += 0.01
    phases = {p for _, p, _ in seen}
    assert {"forward", "backward", "optimizer"} <= phases
    fwd0 = max(d["allocated"] for s, p, d in seen if s == 0 and p == "data")
    fwd1 = max(d["allocated"] for s, p, d in seen if s == 1 and p == "data")
    assert fwd1 - fwd0 >= 2 * src.params * 0.99  # AdamW state, allocated at the first step
    assert seen[-1][2]["alloc_retries"] >= 1
    for (_, _, a), (_, _, b) in zip(seen, seen[1:]):
        if b["alloc_retries"] == a["alloc_retries"]:
            assert b["reserved"] >= a["reserved"]
        assert b["reserved"] >= b["allocated"]


def test_ring_keeps_to_a_byte_budget_but_never_below_ten_minutes_at_10hz():
    a = core.Agent(SimulatedSource(devices=list(range(8))), rate_hz=100.0)
    a._sample()
    a._maintain(0.0)  # learns the sample size
    size = len(a._ring[-1])
    assert a._ring.maxlen * size <= core.RING_BYTES
    assert a._ring.maxlen >= 600 * 10
    a.set_rate(10.0)
    assert a._ring.maxlen == 6000  # 10 minutes at 10 Hz, whatever the size
    one = core.Agent(SimulatedSource(devices=[0]), rate_hz=100.0)
    one._sample()
    one._maintain(0.0)
    assert one._ring.maxlen == 60_000  # small samples: the full 10 minutes at 100 Hz
