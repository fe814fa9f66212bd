"""attach --hosts/--slurm at 80x24 with four ranks on two nodes and several nodes down: every
rank's tab is on screen and in rank order (they arrive in any order), the Overview's legend
names all four, the notice box shows what fits and says how many more, and `n` lists every
reason whole."""

from fakes import CLIENT_ID, T0, FakeConnection, FakeTarget, hello, history

from gpumon.tui.attach_app import AttachApp
from gpumon.tui.keys import HelpScreen
from test_app import until


def _rank(rank: int, host: str) -> FakeConnection:
    return FakeConnection({**hello(pid=1000 + rank, rank=rank, world=4), "host": host},
                          [{**m, "host": host} for m in history(100, scale=1 + rank / 8)])


async def test_four_ranks_of_two_nodes_at_80x24_tabs_legend_and_every_reason():
    # arrival order: 3, 1, 0, 2 (nodes answer in any order)
    conns = [_rank(3, "node-two"), _rank(1, "node-one"), _rank(0, "node-one"),
             _rank(2, "node-two")]
    target = FakeTarget(*conns)
    app = AttachApp(target, fps=20, clock=lambda: T0 + 40, client_id=CLIENT_ID)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(app.panes) == 4 and app._overview is not None
                    and all(p.proc.samples == 100 for p in app.panes.values()))
        await pilot.pause(0.2)
        tabs = [t for t in app.query("ContentTab")]
        labels = [str(t.label) for t in tabs]
        assert labels == ["Overview", "node-one r0", "node-one r1", "node-two r2",
                          "node-two r3"], labels
        assert all(t.region.right <= 80 for t in tabs), [(str(t.label), t.region) for t in tabs]
        # tab goes through them in that order too
        seen = []
        for _ in range(4):
            await pilot.press("tab")
            await pilot.pause(0.05)
            seen.append(app._visible_pane().proc.rank)
        assert seen == [0, 1, 2, 3]
        legend = "".join(text for text, _ in app.overview_spec().legend)
        assert legend == "allocated: ━ r0 ━ r1 ━ r2 ━ r3 ", legend
        assert len(legend) <= 80 - 12  # inside the chart, beside its axis
        # five nodes cannot be reached: what fits, then how many more
        reasons = [f"host down{i}: ssh: connect to host down{i} port 22: Connection refused; "
                   f"reconnecting in 8 s" for i in range(1, 6)]
        for i, line in enumerate(reasons, 1):
            target.state(f"down{i}:", "unreachable", line, host=f"down{i}")
        await until(pilot, lambda: "more" in str(app._notice.render()))
        box = str(app._notice.render()).splitlines()
        assert box[-1] == "+4 more: press n to see every one", box
        assert box[:-1] == reasons[:1], box  # (a line this long takes two of the 3 rows)
        assert app._notice.region.height <= 3
        await pilot.press("n")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        shown = str(app.screen.query_one("#help-text").render())
        flat = " ".join(shown.split())
        assert all(" ".join(r.split()) in flat for r in reasons), shown
        await pilot.press("escape")
        await pilot.press("q")
