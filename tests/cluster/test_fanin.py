"""The fan-in without ssh: ClusterTarget over local `gpumon relay` processes (each node its own
GPUMON_DIR), a transport that hangs, a relay that says hostile things, and the live view's
Overview with ranks of two nodes."""
from __future__ import annotations

import asyncio
import sys

import pytest

from polling import wait_for

from gpumon import client
from gpumon.client.remote import ClusterTarget, Node


def local_node(name, base):
    return Node(name, ["env", f"GPUMON_DIR={base}", sys.executable, "-m", "gpumon", "relay",
                       "--host", name], "local")


@pytest.fixture
def two_local_nodes(ranks, tmp_path):
    bases = {"n1": tmp_path / "n1", "n2": tmp_path / "n2"}
    procs = {"n1": ranks.start(bases["n1"], [0, 1], 3), "n2": ranks.start(bases["n2"], [2], 3)}
    return bases, procs


def test_a_hung_transport_is_a_drop_after_stall_s_and_the_other_node_streams(
        two_local_nodes, tmp_path):
    bases, procs = two_local_nodes
    hung = Node("hung", [sys.executable, "-c", "import time; time.sleep(60)"], "local")
    t = ClusterTarget([local_node("n1", bases["n1"]), hung], stall_s=1.0, retry_s=0.2,
                      retry_max_s=0.5)
    sub = t.subscribe()
    t.start()
    try:
        wait_for(lambda: len([m for m in t.members().values() if m.serving]) == 2,
                 what="n1's two ranks")
        wait_for(lambda: "no word from the node for 1 s" in t.members()["hung:"].line,
                 timeout=10, what="the hung node named as such")
        assert t.members()["hung:"].state == client.UNREACHABLE
        samples = [m for _, m in sub.drain() if m["type"] == "sample"]
        assert {m["host"] for m in samples} == {"n1"} and len(samples) >= 10
    finally:
        t.close()


def test_hostile_relay_output_is_ignored_and_a_wrong_version_named(tmp_path):
    script = tmp_path / "bad_relay.py"
    script.write_text(
        "import sys, time\n"
        "print('Welcome to node x (a login banner on stdout)')\n"
        "print('{\"type\": \"state\", \"key\": \"1\", \"pid\": 1, \"state\": [' * 40)\n"
        "print('{\"type\": \"state\", \"key\": 7, \"state\": \"serving\"}')\n"
        "print('{\"type\": \"relay\", \"v\": 99, \"host\": \"x\"}', flush=True)\n"
        "time.sleep(30)\n")
    t = ClusterTarget([Node("x", [sys.executable, str(script)], "local")], retry_s=5)
    t.start()
    try:
        wait_for(lambda: "protocol v99" in t.members()["x:"].line, timeout=10,
                 what="the version named")
        assert set(t.members()) == {"x:"}  # nothing of the garbage became a member
    finally:
        t.close()


def test_json_and_commands_over_local_relays(two_local_nodes):
    bases, procs = two_local_nodes
    t = ClusterTarget([local_node("n1", bases["n1"]), local_node("n2", bases["n2"])])
    t.start()
    try:
        key = f"n2:{procs['n2'][0].pid}"
        wait_for(lambda: t.members().get(key) and t.members()[key].serving, what="n2 serving")
        assert t.members()[key].hello["host"] == "n2"
        assert t.members()[key].rank == 2
        assert t.request(key, "ping")["pid"] == procs["n2"][0].pid
        with pytest.raises(client.AgentError, match="not part of this target"):
            t.request("n3:1", "ping")
    finally:
        t.close()


async def test_the_overview_lines_up_ranks_of_two_nodes_with_their_host(two_local_nodes):
    pytest.importorskip("textual")
    from gpumon.tui.attach_app import AttachApp, OverviewPane
    bases, procs = two_local_nodes
    t = ClusterTarget([local_node("n1", bases["n1"]), local_node("n2", bases["n2"])])
    app = AttachApp(t, fps=10)
    async with app.run_test(size=(160, 40)) as pilot:
        loop = asyncio.get_running_loop()
        end = loop.time() + 30

        def ready():
            ov = app.query(OverviewPane)
            return ov and len(ov.first().table._content()[0]) == 3 and \
                ov.first().table._content()[1] is not None
        while not ready():
            assert loop.time() < end, "overview of 3 ranks not shown"
            await pilot.pause(0.1)
        ov = app.query_one(OverviewPane)
        rows, caption = ov.table._content()
        names = [c for c, _ in ov.table.COLUMNS]
        assert names[:4] == ["", "process", "host", "dev"]
        assert [(r[1].plain, r[2]) for r in rows] == [("rank 0", "n1"), ("rank 1", "n1"),
                                                       ("rank 2", "n2")]
        text = caption.plain
        assert "across 3 devices" in text or ("imbalance" in text and " on n" in text), text
        # tab titles name the host too
        titles = [str(tab.label) for tab in app.query("Tab")]
        assert any(x.startswith("n2 rank 2 cuda:0") for x in titles), titles
        # keys go through to every node: reset peaks from the Overview reaches all 3 ranks
        await pilot.press("r")
        while len([n for n in app._notifications if "peaks reset" in n.message]) < 3:
            assert loop.time() < end + 15, [n.message for n in app._notifications]
            await pilot.pause(0.1)
        await pilot.press("q")


def test_once_names_an_unreachable_node_without_promising_a_retry(tmp_path, capsys):
    """`attach --hosts x --once` said "...; reconnecting in 1 s" and then exited: with --once
    there is no retry, so the line says only what failed (status 1)."""
    import io

    from gpumon.commands.cluster import once_cluster
    down = Node("down", [sys.executable, "-c",
                         "import sys; sys.stderr.write('ssh: connect to host down port 22: "
                         "Connection refused\\n'); sys.exit(255)"], "local")
    out = io.StringIO()
    rc = once_cluster(ClusterTarget([down], retry_s=0.2, retry_max_s=0.5), 3.0, out=out)
    err = capsys.readouterr().err
    assert rc == 1, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpumon: ") and "down" in lines[0], err
    assert "Connection refused" in lines[0] and "reconnecting" not in lines[0], lines[0]


def _text_of(widget, width: int) -> list[str]:
    from rich.console import Console
    c = Console(width=width, record=True, color_system=None, legacy_windows=False)
    c.print(widget.render())
    return c.export_text().splitlines()


async def test_at_80x24_the_overview_shows_whole_hosts_and_figures_and_a_node_down_once(
        ranks, tmp_path):
    """At 80 columns every cell of the Overview was cut ("ho…", "no…", "2.73 G…"): two nodes
    could not be told apart. Now whole cells, fewer columns. A node that drops is one notice
    line (not one more per rank) and the top bar counts processes, not nodes, and says how many
    nodes are down."""
    pytest.importorskip("textual")
    from gpumon.tui.attach_app import AttachApp
    bases = {"node-one": tmp_path / "n1", "node-two": tmp_path / "n2"}
    procs = {"node-one": ranks.start(bases["node-one"], [0, 1], 3),
             "node-two": ranks.start(bases["node-two"], [2], 3)}
    flag = tmp_path / "node-two-down"
    down_script = (f"test -e {flag} && {{ echo 'ssh: connect to host node-two port 22: "
                   f"Connection refused' >&2; exit 255; }}; exec env GPUMON_DIR={bases['node-two']}"
                   f" {sys.executable} -m gpumon relay --host node-two")
    t = ClusterTarget([local_node("node-one", bases["node-one"]),
                       Node("node-two", ["sh", "-c", down_script], "local")],
                      retry_s=0.2, retry_max_s=0.5)
    app = AttachApp(t, fps=10)
    try:
        await _node_down_at_80x24(app, t, procs, flag)
    finally:
        t.close()


async def _node_down_at_80x24(app, t, procs, flag):
    import os
    import signal
    from gpumon.tui.attach_app import OverviewPane
    from gpumon.tui.widgets.panels import OverviewTable
    async with app.run_test(size=(80, 24)) as pilot:
        loop = asyncio.get_running_loop()

        async def until(cond, what, timeout=30):
            end = loop.time() + timeout
            while not cond():
                assert loop.time() < end, what
                await pilot.pause(0.1)

        def rows():
            ov = app.query(OverviewPane)
            return ov and ov.first().table._content()[0]
        await until(lambda: rows() and len(rows()) == 3 and all(
            str(r[5]) != "n/a" for r in rows()), "overview of 3 ranks")
        table = app.query_one(OverviewTable)
        width = table.content_size.width
        assert 70 <= width <= 80, width
        lines = _text_of(table, width)
        assert "…" not in "\n".join(lines[:4]), lines
        assert lines[0].split()[:3] == ["process", "host", "dev"], lines[0]
        body = [ln.split() for ln in lines[1:4]]
        assert [(b[1] + " " + b[2], b[3], b[4]) for b in body] == [
            ("rank 0", "node-one", "cuda:0"), ("rank 1", "node-one", "cuda:1"),
            ("rank 2", "node-two", "cuda:0")], lines
        assert all(b[7] in ("MiB", "GiB") for b in body), lines  # whole figures: "3.10 GiB"
        assert max(len(ln) for ln in lines) <= width
        # node-two drops: its relay ends and it refuses connections for a while
        flag.touch()
        run = t._runs["node-two"]
        os.killpg(run.proc.pid, signal.SIGKILL)
        await until(lambda: "1/2 nodes down" in app._topbar.render().plain, "node down said")
        top = app._topbar.render().plain
        assert " 3 proc " in top and "not running" not in top, top  # not "4 proc (2 ...)"
        await until(lambda: "Connection refused" in str(app._notice.render()), "ssh's words")
        notice = str(app._notice.render()).splitlines()
        assert notice[0].startswith("host node-two: ssh: connect to host node-two port 22"), \
            notice
        assert not any(f"pid {procs['node-two'][0].pid}" in ln for ln in notice), notice
        assert [r[4].plain for r in rows()] == ["●", "●", "?"]  # the state's mark
        flag.unlink()
        await until(lambda: "down" not in app._topbar.render().plain, "node-two back", 20)
        await until(lambda: [r[4].plain for r in rows()] == ["●", "●", "●"], "rank 2 again")
        await pilot.press("q")


async def test_s_then_s_records_and_saves_a_snapshot_on_every_node(two_local_nodes):
    """`s` starts a recording on every rank of every node and `s` again stops it and saves each
    on its node. The agents there see the relay as the client, so the view took its own
    recording for someone else's ("already recording, started by pid:N") and could not stop
    it; the relay's id is now mapped back to the view's."""
    pytest.importorskip("textual")
    from gpumon.tui.attach_app import AttachApp, OverviewPane
    bases, procs = two_local_nodes
    t = ClusterTarget([local_node("n1", bases["n1"]), local_node("n2", bases["n2"])])
    app = AttachApp(t, fps=10)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            loop = asyncio.get_running_loop()

            async def until(cond, what, timeout=40):
                end = loop.time() + timeout
                while not cond():
                    assert loop.time() < end, (what, [n.message for n in app._notifications])
                    await pilot.pause(0.1)

            def said(text):
                return [n.message for n in app._notifications if text in n.message]
            await until(lambda: app.query(OverviewPane) and len(app.pane_rows()) == 3 and all(
                p.hello for p, _ in app.pane_rows()), "3 ranks")
            await pilot.press("s")
            await until(lambda: all(p.recording.active for p, _ in app.pane_rows()),
                        "recording on all 3")
            await pilot.pause(0.5)  # the agents' "recording started" events come back
            assert all(p.recording.by == app.client_id for p, _ in app.pane_rows()), \
                [p.recording.by for p, _ in app.pane_rows()]
            assert not said("recording started by"), said("recording started by")
            await pilot.press("s")
            await until(lambda: len(said("snapshot saved")) >= 3, "3 snapshots saved", 90)
            assert not said("already recording"), said("already recording")
            # each toast names the node the path is on (paths on two nodes may be equal)
            assert sorted(m.split(": snapshot saved: ")[0] for m in said("snapshot saved")) \
                == ["n1 rank 0", "n1 rank 1", "n2 rank 2"], said("snapshot saved")
            paths = sorted(p.recording.last_path for p, _ in app.pane_rows())
            for (p, _), node in zip(app.pane_rows(), ("n1", "n1", "n2")):
                assert p.recording.last_path.startswith(str(bases[node])), (node, paths)
            await pilot.press("q")
    finally:
        t.close()


def test_recording_owners_the_relay_is_us_any_other_client_is_named_with_its_node(tmp_path):
    import json
    import os
    me = f"pid:{os.getpid()}"  # a client on the node whose pid equals ours must not pass for us
    lines = [{"type": "relay", "v": 1, "host": "x", "pid": 4242},
             {"type": "state", "key": "7", "pid": 7, "state": "serving"},
             {"type": "event", "key": "7", "kind": "recording", "state": "started",
              "by": "pid:4242", "since": 1.0},
             {"type": "event", "key": "7", "kind": "recording", "state": "started",
              "by": me, "since": 2.0},
             {"type": "relay_ready", "keys": ["7"]}]
    script = tmp_path / "relay.py"
    script.write_text("import sys, time\n" + "".join(
        f"print({json.dumps(json.dumps(m))}, flush=True)\n" for m in lines) + "time.sleep(30)\n")
    t = ClusterTarget([Node("x", [sys.executable, str(script)], "local")])
    sub = t.subscribe()
    t.start()
    try:
        got = []
        wait_for(lambda: got.extend(m["by"] for _, m in sub.drain() if m.get("kind") ==
                                    "recording") or len(got) == 2, what="two events")
        assert got == [t.client_id, f"{me} on x"] and t.client_id == me
    finally:
        t.close()
