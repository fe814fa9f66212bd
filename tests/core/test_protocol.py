import json

import pytest
from hypothesis import given, settings, strategies as st

from gpumon import protocol
from gpumon.protocol import LineReader, ProtocolError


def test_roundtrip_and_framing():
    msg = {"type": "sample", "seq": 3, "devices": [{"index": 0, "allocated": 1 << 40}]}
    line = protocol.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.decode(line) == msg
    assert protocol.decode(line.rstrip(b"\n")) == msg


def test_encode_refuses_nan_and_oversize():
    with pytest.raises(ValueError):
        protocol.encode({"type": "x", "v": float("nan")})
    with pytest.raises(ProtocolError):
        protocol.encode({"type": "x", "blob": "a" * protocol.MAX_MESSAGE_BYTES})


@pytest.mark.parametrize("line", [b"", b"not json", b"[1,2]", b'{"type": 3}', b'{"no": "type"}',
                                  b"\xff\xfe", b'"str"'])
def test_decode_rejects(line):
    with pytest.raises(ProtocolError):
        protocol.decode(line)


def test_check_hello_version():
    with pytest.raises(ProtocolError, match="v99"):
        protocol.check_hello({"type": "hello", "v": 99})
    with pytest.raises(ProtocolError, match="expected hello"):
        protocol.check_hello({"type": "sample", "v": protocol.VERSION})
    assert protocol.check_hello({"type": "hello", "v": protocol.VERSION})


def test_command_shape():
    c = protocol.command(7, "set_rate", {"rate_hz": 5})
    assert c == {"v": protocol.VERSION, "type": "cmd", "id": 7, "cmd": "set_rate",
                 "args": {"rate_hz": 5}}


def test_linereader_splits_across_chunks():
    r = LineReader()
    assert r.feed(b'{"a":') == []
    assert r.feed(b'1}\n{"b"') == [b'{"a":1}']
    assert r.feed(b":2}\n\n") == [b'{"b":2}', b""]


def test_linereader_overflow_then_recovers():
    r = LineReader(limit=16)
    with pytest.raises(ProtocolError):
        r.feed(b"x" * 17)
    # The rest of the overlong line is skipped up to its newline: one line, one error.
    assert r.feed(b"x" * 40) == []
    assert r.feed(b'tail\n{"ok":1}\n') == [b'{"ok":1}']


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decode_random_bytes_never_crashes(data):
    try:
        msg = protocol.decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, dict) and isinstance(msg["type"], str)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=20), st.integers(8, 128))
def test_linereader_random_chunks(chunks, limit):
    """Whatever arrives: lines come out whole and in order, or ProtocolError; never more."""
    r = LineReader(limit=limit)
    out = []
    stream = b"".join(chunks)
    overflowed = False
    for c in chunks:
        try:
            out.extend(r.feed(c))
        except ProtocolError:
            overflowed = True
    for line in out:
        assert b"\n" not in line
    if not overflowed:
        # Without an overflow, output + pending buffer reconstruct the stream exactly.
        assert b"".join(l + b"\n" for l in out) + bytes(r._buf) == stream


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                         max_size=4),
                    max_leaves=20))
def test_any_plain_payload_roundtrips(payload):
    msg = {"type": "event", "payload": payload}
    assert protocol.decode(protocol.encode(msg)) == json.loads(json.dumps(msg))


_figure = st.one_of(st.none(), st.integers(min_value=-2 ** 70, max_value=2 ** 70))


def _sample(devices, phase="forward", step=3):
    return {"type": "sample", "seq": 7, "t": 1764800000.125, "cost_us": 21.5,
            "devices": devices, "phase": phase, "step": step}


@settings(max_examples=300, deadline=None)
@given(devices=st.lists(st.fixed_dictionaries({f: _figure for f in protocol.DEVICE_FIELDS}),
                        max_size=8),
       phase=st.one_of(st.none(), st.text(max_size=20)),
       step=st.one_of(st.none(), st.integers(min_value=0, max_value=2 ** 40)),
       t=st.floats(min_value=0, max_value=4e9), cost=st.floats(min_value=0, max_value=1e6))
def test_sample_template_equals_json(devices, phase, step, t, cost):
    msg = _sample(devices, phase, step)
    msg["t"], msg["cost_us"] = t, cost
    data = protocol.encode_sample(msg)
    assert b"\n" not in data
    assert json.loads(data) == msg == json.loads(protocol.encode(msg))


def test_sample_template_falls_back_to_json_for_anything_else():
    dev = {f: 1 for f in protocol.DEVICE_FIELDS}
    odd = [
        dict(_sample([dict(dev, allocated=True)])),              # a bool is not an int
        dict(_sample([dict(dev, allocated=1.5)])),               # a float figure
        dict(_sample([dict(dev, extra_field=1)])),               # a device field the template lacks
        dict(_sample([dev]), tracker_note="x \"quoted\"\n"),     # a sample extra's own key
        dict(_sample([dev], phase={"nested": 1})),
        dict(_sample([dev]), seq=True),
    ]
    short = dict(dev)
    del short["proc_used"]
    odd.append(_sample([short]))
    for msg in odd:
        assert json.loads(protocol.encode_sample(msg)) == msg
    with pytest.raises(ValueError):
        protocol.encode_sample(dict(_sample([dev]), t=float("nan")))
    with pytest.raises(ValueError):
        protocol.encode_sample(_sample([dict(dev, allocated=float("inf"))]))
