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
    assert r.feed(b'{"ok":1}\n') == [b'{"ok":1}']


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
