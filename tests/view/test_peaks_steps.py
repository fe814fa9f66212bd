"""Issue 17, in `gpumon view`: the peak both as requested (memory_viz) and as allocated in
blocks (torch.cuda.max_memory_allocated), rebuilt to the byte from the trace and the segments;
the step and phase the peak fell in (the sidecar's phases, torch's Optimizer.step START and
END); the phases on the timeline; the event line within 80 columns."""
import json
from pathlib import Path

import pytest
from textual.widgets import Static

from gpumon.snapshot import Snapshot, analysis, open_snapshot, report
from gpumon.snapshot.synth import training_snapshot
from gpumon.tui.view.app import ViewApp
from gpumon.tui.view.frame import chart_rows, event_text, head_text

MiB = 1 << 20
A, B, S = 0x7F0000000000, 0x7F0002000000, 0x7F0004000000
FIX = Path(__file__).resolve().parent.parent / "fixtures" / "snapshots"


def _ev(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "frames": [{"filename": "/p/train.py", "line": t, "name": "f"}]}


def _blocks_file():
    """A 20 MiB segment: 9.5 MiB splits it, then 10,695,475 B would leave 314,368 B: the
    allocator keeps that block whole (11,010,048 B). Freed; in a new 22 MiB segment 20,700,000 B
    asks more (the requested peak) but its block is split (20,700,160 B: below the block
    peak of the first two)."""
    big = 20 * MiB
    ev = [_ev("segment_alloc", A, big, 1), _ev("alloc", A, 9961472, 2),
          _ev("alloc", A + 9961472, 10695475, 3),
          _ev("free_requested", A, 9961472, 4), _ev("free_completed", A, 9961472, 5),
          _ev("free_requested", A + 9961472, 10695475, 6),
          _ev("free_completed", A + 9961472, 10695475, 7),
          _ev("segment_alloc", B, 22 * MiB, 8), _ev("alloc", B, 20_700_000, 9),
          _ev("segment_alloc", S, 2 * MiB, 10), _ev("alloc", S, 100, 11)]
    segs = [{"device": 0, "address": A, "total_size": big, "stream": 0,
             "segment_type": "large", "blocks": [{"address": A, "size": big,
                                                  "state": "inactive"}]},
            {"device": 0, "address": B, "total_size": 22 * MiB, "stream": 0,
             "segment_type": "large",
             "blocks": [{"address": B, "size": 20_700_160, "requested_size": 20_700_000,
                         "state": "active_allocated"},
                        {"address": B + 20_700_160, "size": 22 * MiB - 20_700_160,
                         "state": "inactive"}]},
            {"device": 0, "address": S, "total_size": 2 * MiB, "stream": 0,
             "segment_type": "small",
             "blocks": [{"address": S, "size": 512, "requested_size": 100,
                         "state": "active_allocated"},
                        {"address": S + 512, "size": 2 * MiB - 512, "state": "inactive"}]}]
    return {"segments": segs, "device_traces": [ev]}


def test_block_replay_keeps_unsplit_remainders_and_peaks_elsewhere():
    tr = Snapshot(_blocks_file(), "b.pickle").trace()
    # memory_viz's count: a free at its free_requested when free_completed follows at once
    assert list(tr.allocated) == [0, 9961472, 9961472 + 10695475, 10695475, 10695475, 0, 0, 0,
                                  20_700_000, 20_700_000, 20_700_100]
    # torch counts a block out at free_requested
    assert list(tr.allocated_blocks) == [0, 9961472, 20971520, 11010048, 11010048, 0, 0, 0,
                                         20_700_160, 20_700_160, 20_700_672]
    assert (tr.peak, tr.peak_index) == (20_700_100, 10)
    assert (tr.peak_blocks, tr.peak_blocks_index) == (20971520, 2)
    assert tr.blocks_exact and tr.block_rule_misses == 0
    s = report.summary(Snapshot(_blocks_file(), "b.pickle"))
    assert s["peak_blocks"] == {"bytes": 20971520, "event": 2, "time_s": 2e-6, "in": None,
                                "exact": True}
    txt = report.summary_text(s)
    assert "19.74 MiB requested, as memory_viz counts" in txt
    assert "20.00 MiB in blocks, as torch.cuda.max_memory_allocated() counts  (event 2)" in txt


def test_block_rule_misses_are_counted_when_the_dump_disagrees():
    d = _blocks_file()
    d["segments"][1]["blocks"][0]["size"] = 22 * MiB   # the dump says: not split
    d["segments"][1]["blocks"].pop()
    tr = Snapshot(d).trace()
    assert tr.block_rule_misses == 1 and tr.allocated_blocks[-1] == 22 * MiB + 512


FILES = sorted(FIX.glob("*.pickle"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_block_replay_on_real_files(path):
    s = open_snapshot(path)
    tr = s.trace()
    assert tr.blocks_exact and tr.block_rule_misses == 0
    live = sum(b["size"] for seg in tr.segments for b in seg["blocks"]
               if b["state"] == "active_allocated")
    assert tr.allocated_blocks[-1] == live
    assert all(b >= a for a, b in zip(tr.allocated, tr.allocated_blocks))
    # a block is its request rounded up to 512 B, or in the large pool up to 1 MiB more (an
    # unsplit remainder)
    for j, b in enumerate(tr.el_block):
        r = max(512, (tr.el_size[j] + 511) // 512 * 512)
        assert b == r if r <= MiB else r <= b <= r + MiB, (j, b, r)
    side = json.loads(Path(str(path) + ".json").read_text()).get("oom") or {}
    if side.get("allocated") is not None:   # torch.cuda.memory_allocated() at the OOM
        assert tr.allocated_blocks[tr.n - 1] == side["allocated"]


def test_transformer_fixture_peaks_differ_by_the_rounding():
    tr = open_snapshot(FIX / "transformer.pickle").trace()
    assert (tr.peak, tr.peak_blocks) == (121419496, 122665984)


def _timeline_snapshot():
    tl = []
    data, _ = training_snapshot(steps=4, layers=3, timeline=tl, seed=2)
    data["external_annotations"] = []   # a recording started mid-run: none from torch
    return data, tl


def test_peak_step_and_phase_from_the_sidecar():
    data, tl = _timeline_snapshot()
    s = Snapshot(data, "t.pickle", {"timeline": {"clock": "time_us", "steps": tl}})
    tr = s.trace()
    t = tr.time_us[tr.peak_index]
    want = [(st["step"], ph["phase"]) for st in tl for ph in st["phases"]
            if ph["start_us"] <= t < (ph["end_us"] if ph["end_us"] is not None else 2**62)]
    assert len(want) == 1
    at = s.step_at(tr.peak_index)
    assert (at["step"], at["phase"]) == want[0] and at["source"] == "gpumon"
    summ = report.summary(s)
    assert summ["peak"]["in"]["text"] == f"in step {want[0][0]}, {want[0][1]}"
    assert f"in step {want[0][0]}, {want[0][1]})" in report.summary_text(summ)
    # every event of every phase span is in that phase
    for e0, e1, step, phase in s.phase_spans():
        for i in (e0, e1):
            assert s.step_at(i)["phase"] == phase and s.step_at(i)["step"] == step
    assert {p[3] for p in s.phase_spans()} >= {"forward", "backward", "optimizer"}


def test_inside_an_optimizer_step_from_torchs_start_and_end():
    data, _ = training_snapshot(steps=3, layers=3, seed=2)
    s = Snapshot(data, "t.pickle")
    opt = s.optimizer_steps()
    assert len(opt) == 3 and all(a < b for a, b in opt)
    a, b = opt[0]
    inside = s.step_at((a + b) // 2)
    # the old reading, from END alone, was "after 0 of 3 optimizer steps"
    assert inside["text"] == "in optimizer step 1 of 3"
    assert s.step_at(b + 1)["text"] == "after 1 of 3 optimizer steps"
    assert s.step_at(max(0, a - 1))["text"] == "after 0 of 3 optimizer steps"


def test_phases_marked_on_the_timeline():
    data, tl = _timeline_snapshot()
    s = Snapshot(data, "t.pickle", {"timeline": {"clock": "time_us", "steps": tl}})
    tr = s.trace()
    rows = chart_rows(tr, 0, tr.n, 0, s.step_boundaries(), -1, True, 80, 20,
                      s.phase_spans())
    marks = "".join(t for t, _ in rows[-2])[13:]
    assert set(marks) <= set("fbo·|^▲ ") and {"f", "b", "o"} <= set(marks)
    spans = s.phase_spans()
    for c, ch in enumerate(marks):
        if ch in "fbo":
            e = (tr.n * c + tr.n * (c + 1)) // (2 * 67)
            ph = next(p[3] for p in spans if p[0] <= e <= p[1])
            assert ph[0] == ch, (c, ch, ph)
    rows = chart_rows(tr, 0, tr.n, 0, s.step_boundaries(), -1, True, 80, 20)
    assert not set("".join(t for t, _ in rows[-2])) & set("fbo")


def _long_names_snapshot():
    data, tl = _timeline_snapshot()
    return Snapshot(data, "/runs/a-rather-long-snapshot-name-of-a-real-training-run-on-"
                          "the-cluster-rank0.pickle",
                    {"timeline": {"clock": "time_us", "steps": tl}})


def test_event_and_head_lines_fit_80_columns():
    s = _long_names_snapshot()
    tr = s.trace()
    tr.window_offset = 12_345_678  # a window deep in a long trace: the longest numbers
    for i in range(0, tr.n, 7):
        lines = event_text(s, tr, i, 78).split("\n")
        assert len(lines) == 3 and all(len(x) <= 78 for x in lines), lines
        assert "alloc" in lines[0] and "res" in lines[0] and "step" in lines[0], lines[0]
        assert lines[2].startswith("←→")
        wide = event_text(s, tr, i, 198).split("\n")
        assert "allocated" in wide[0] and "reserved" in wide[0] and "(peak" in wide[0]
    tr.window_offset = 0
    h = head_text(s, tr, width=78)
    assert len(h) <= 78 and "…" in h and h.endswith(f"peak {report.fmt_bytes(tr.peak)}")
    assert "the-cluster-rank0.pickle  dev 0" in head_text(s, tr, width=198)


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
async def test_event_line_does_not_wrap_in_the_app(size):
    app = ViewApp(_long_names_snapshot())
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        for key in ("p", "home", "end", "p", "comma"):
            await pilot.press(key)
            await pilot.pause()
            ev = app.query_one("#event", Static)
            lines = str(ev.render()).split("\n")
            assert len(lines) == 3 and all(len(x) <= size[0] - 2 for x in lines), lines
            assert lines[2].startswith("←→"), lines
            assert "step" in lines[0]
        head = str(app.query_one("#head", Static).render())
        assert len(head) <= size[0] - 2 and "peak" in head


def reference_blocks(tr):
    """The block replay event by event, the plain way (what DeviceTrace._block_replay does
    with a sweep over the large blocks only): (series, block sizes)."""
    import bisect
    n, act, addr, size = tr.n, tr.action, tr.addr, tr.size
    A_ALLOC, A_FREE_REQ, A_FREE_DONE = 0, 1, 2
    dump = {}
    for seg in tr.segments:
        for b, ba, bs in analysis.segment_blocks(seg):
            if b.get("state") == "active_allocated":
                dump[ba] = bs
    segs = {s.address: s.total for s in tr.segments_at(-1)}
    starts = sorted(segs)
    rnd = [max(512, (z + 511) // 512 * 512) for z in tr.el_size]
    bs = list(rnd)
    live, used = {}, []
    for j in range(len(bs)):
        if tr.el_start[j] < 0:
            if tr.el_end[j] >= n and tr.el_addr[j] in dump:
                bs[j] = dump[tr.el_addr[j]]
            live[tr.el_addr[j]] = j
    used = sorted(live)
    free_at = [n] * len(bs)
    asked = set()
    nxt = 0
    for i in range(n):
        a = act[i]
        if a == A_ALLOC and nxt < tr.n_allocs and tr.el_start[nxt] == i:
            j, ad, r = nxt, addr[i], rnd[nxt]
            nxt += 1
            b = r
            if r > MiB:
                k = bisect.bisect_right(starts, ad) - 1
                end = max(starts[k] + segs[starts[k]], ad + r) if k >= 0 else ad + r
                u = bisect.bisect_right(used, ad)
                if u < len(used):
                    end = min(end, used[u])
                if end - ad - r <= MiB:
                    b = end - ad
            if tr.el_end[j] >= n and ad in dump:
                b = dump[ad]
            bs[j] = b
            if ad not in live:
                bisect.insort(used, ad)
            live[ad] = j
        elif a == A_FREE_REQ and live.get(addr[i]) is not None and live[addr[i]] not in asked:
            asked.add(live[addr[i]])
            free_at[live[addr[i]]] = i
        elif a == A_FREE_DONE and addr[i] in live:
            j = live.pop(addr[i])
            if j not in asked:
                free_at[j] = i
            used.remove(addr[i])
        elif a in (3, 5):   # segment_alloc / segment_map
            if addr[i] not in segs:
                bisect.insort(starts, addr[i])
            segs[addr[i]] = segs.get(addr[i], 0) + size[i]
        elif a in (4, 6) and addr[i] in segs:
            if segs[addr[i]] > size[i]:
                segs[addr[i]] -= size[i]
            else:
                del segs[addr[i]]
                starts.remove(addr[i])
    series, cur = [], sum(b for j, b in enumerate(bs) if tr.el_start[j] < 0)
    ev = {}
    for j, b in enumerate(bs):
        if tr.el_start[j] >= 0:
            ev[tr.el_start[j]] = ev.get(tr.el_start[j], 0) + b
        if free_at[j] < n:
            ev[free_at[j]] = ev.get(free_at[j], 0) - b
    for i in range(n):
        cur += ev.get(i, 0)
        series.append(cur)
    return series, bs


def _stream_file():
    """A block used on another stream: its free_requested comes long before its
    free_completed (torch counts it out at the first)."""
    d = _blocks_file()
    ev = d["device_traces"][0]
    t = ev[-1]["time_us"]
    ev += [_ev("alloc", A, 3 * MiB, t + 1), _ev("free_requested", A, 3 * MiB, t + 2),
           _ev("alloc", A + 3 * MiB, 5 * MiB, t + 3), _ev("free_completed", A, 3 * MiB, t + 4)]
    d["segments"][0]["blocks"] = [
        {"address": A, "size": 3 * MiB, "state": "inactive"},
        {"address": A + 3 * MiB, "size": 5 * MiB, "requested_size": 5 * MiB,
         "state": "active_allocated"},
        {"address": A + 8 * MiB, "size": 12 * MiB, "state": "inactive"}]
    return d


def _files_for_reference():
    out = [Snapshot(_blocks_file()), Snapshot(_stream_file())]
    for seed, kind in ((1, None), (2, "fragmented"), (3, "full")):
        data, _ = training_snapshot(steps=3, layers=4, seed=seed, max_entries=300,
                                    oom_at_step=1 if kind else None, oom_kind=kind or "huge",
                                    capacity=300 << 20)
        out.append(Snapshot(data))
    out += [open_snapshot(p) for p in FILES]
    return out


@pytest.mark.parametrize("k", range(3 + 2 + len(FILES)))
def test_block_replay_equals_the_plain_event_by_event_replay(k):
    s = _files_for_reference()[k]
    tr = s.trace()
    series, bs = reference_blocks(tr)
    assert list(tr.allocated_blocks) == series
    assert tr.el_block == bs


def test_a_late_free_request_counts_the_block_out_at_the_request():
    tr = Snapshot(_stream_file()).trace()
    n0 = 11
    assert list(tr.allocated_blocks[n0:]) == [20_700_672 + 3 * MiB, 20_700_672,
                                              20_700_672 + 5 * MiB, 20_700_672 + 5 * MiB]
    assert list(tr.allocated[n0:]) == [20_700_100 + 3 * MiB, 20_700_100 + 3 * MiB,
                                       20_700_100 + 8 * MiB, 20_700_100 + 5 * MiB]


def test_html_marks_the_phases_under_the_axis():
    import re
    data, tl = _timeline_snapshot()
    s = Snapshot(data, "t.pickle", {"timeline": {"clock": "time_us", "steps": tl}})
    page = report.html_page(s)
    rects = re.findall(r'<rect class="phase" data-phase="(\w+)" data-first="(\d+)" '
                       r'data-last="(\d+)" x="([\d.]+)"', page)
    spans = s.phase_spans()
    assert [(p, int(a), int(b)) for p, a, b, _x in rects] == [(p, a, b) for a, b, _s, p in spans]
    n = s.trace().n
    for _p, a, _b, x in rects:   # the band starts where its first event starts on the axis
        assert abs(float(x) - (80 + (1100 - 90) * int(a) / n)) < 0.06   # (events are columns)
    assert "in step " in page and "phases of gpumon's tracker" in page
    plain = report.html_page(Snapshot(training_snapshot(steps=2, layers=2)[0], "p.pickle"))
    assert 'class="phase"' not in plain and "phases of gpumon" not in plain


def test_expandable_segments_split_every_remainder():
    d = _blocks_file()
    d["allocator_settings"] = {"expandable_segments": True}
    tr = Snapshot(d).trace()
    # 10,695,475 B is its rounded size, not the 11,010,048 B block of the default allocator
    assert tr.allocated_blocks[2] == 9961472 + 10695680 and not tr.blocks_exact


def test_a_recording_with_its_sidecar_opens_with_steps_and_phases(tmp_path):
    """End to end: gpumon's recorder (simulated source) writes the pickle and the sidecar's
    timeline; `gpumon view` reads both: phases on the chart, the peak's step and phase."""
    from gpumon.agent import snapshot as snap
    from capture.fakes import Events  # tests/capture (tests/ is on sys.path)
    rec = snap.Recorder(None, backend=snap.SimulatedBackend(None), broadcast=Events(), pid=1,
                        cwd=str(tmp_path))
    rec.start({}, "pid:1")
    facts = rec.stop({}, "pid:1")
    s = open_snapshot(facts["path"])
    assert s.sidecar.get("timeline") and s.phase_spans()
    tr = s.trace()
    at = s.step_at(tr.peak_index)
    assert at and at["source"] == "gpumon" and at["phase"] in ("forward", "backward",
                                                                "optimizer", "other")
    t = tr.time_us[tr.peak_index]
    want = [(st["step"], ph["phase"]) for st in s.sidecar["timeline"]["steps"]
            for ph in st["phases"] if ph["start_us"] <= t and (ph["end_us"] is None or
                                                                t < ph["end_us"])]
    assert (at["step"], at["phase"]) == want[0]
    assert at["text"] in report.summary_text(report.summary(s))
