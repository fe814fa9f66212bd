"""`gpumon attach --estimate`: a missing file is one line, before anything is attached."""
import os
import subprocess
import sys


def test_attach_with_a_missing_estimate_file_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpumon", "attach", str(os.getpid()),
                        "--estimate", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no estimate file" in lines[0], r.stderr


def test_run_attach_rejects_a_non_object_estimate(tmp_path, monkeypatch, capsys):
    from gpumon.tui import attach_app
    monkeypatch.setattr(attach_app, "_tty_ok", lambda: True)
    bad = tmp_path / "est.json"
    bad.write_text("[1, 2]")
    assert attach_app.run_attach([], estimate=str(bad)) == 1
    assert "cannot read the estimate" in capsys.readouterr().err
