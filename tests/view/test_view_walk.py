"""What a walk through `gpumon view` at 80x24 found: keys missing from the help (g, f, r, e, 6)
and the summary tab wrapping without its label column."""
from gpumon.tui.view import app as view_app
from gpumon.tui.view.frame import hang_wrap


def test_every_binding_of_the_view_is_in_its_help():
    ids = {b.id for b in view_app.ViewApp.BINDINGS}
    assert ids <= set(view_app.KEY_HELP), sorted(ids - set(view_app.KEY_HELP))


def test_summary_wraps_under_its_value_column():
    text = ("peak allocated  115.79 MiB requested, as memory_viz counts  (event 675 of 1,601, "
            "0.276 s into the recording, after 1 of 3 optimizer steps)\n"
            "  verdict: one huge request: 10.00 TiB was asked, more than the whole device "
            "(139.80 GiB); look at the size computation\nshort line")
    out = hang_wrap(text, 60).split("\n")
    assert all(len(x) <= 60 for x in out)
    assert out[0].startswith("peak allocated  115.79 MiB")
    assert out[1].startswith(" " * 16) and out[1][16] != " "
    k = next(i for i, x in enumerate(out) if x.startswith("  verdict"))
    assert out[k + 1].startswith("    ") and out[k + 1][4] != " "
    assert out[-1] == "short line"


async def test_export_toast_names_the_file_on_its_own_line(tmp_path, monkeypatch):
    import pickle
    from gpumon.snapshot import Snapshot
    from gpumon.snapshot.synth import training_snapshot
    monkeypatch.chdir(tmp_path)
    data, _ = training_snapshot(steps=2, layers=2, seed=1)
    app = view_app.ViewApp(Snapshot(pickle.loads(pickle.dumps(data)), "/runs/train.pickle"))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        await pilot.pause(0.3)
        await pilot.press("e")
        await pilot.pause(0.2)
        msg = [n.message for n in app._notifications][-1]
        name = f"train-segments-event{app.chart.cursor}.csv"
        assert msg.split("\n")[-1] == name and (tmp_path / name).exists(), msg
