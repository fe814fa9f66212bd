"""`gpumon estimate` end to end: text, --json, --fit, --measure through --model, errors; compare();
and the layering rule (no torch, no textual on import)."""
import argparse
import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpumon.commands import estimate as cmd
from gpumon.estimate import Setup, estimate, fit, load_config
from gpumon.estimate.fit import fits
from gpumon.estimate.units import fmt_bytes

CFG = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
QWEN = str(CFG / "qwen2.5-1.5b.json")
GiB = 2**30


def run(capsys, *argv):
    p = argparse.ArgumentParser(prog="gpumon")
    sub = p.add_subparsers(dest="command")
    cmd.register(sub)
    args = p.parse_args(["estimate", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_text_output_has_terms_peak_phase_and_assumptions(capsys):
    rc, out, _ = run(capsys, "--config", QWEN, "--batch", "2", "--seq", "256", "--loss", "mean", "--dtype", "fp32")
    assert rc == 0
    out = " ".join(out.split())          # paragraphs are wrapped at 80 columns
    for needle in ("parameters", "gradients", "optimizer state", "optimizer temporaries",
                   "activations", "peak allocated: 28.8 GiB", "in the optimizer step",
                   "max_memory_allocated", "CUDA context", "assumptions:", "blog's heuristic"):
        assert needle in out, needle


def test_json_output(capsys):
    rc, out, _ = run(capsys, "--config", QWEN, "--batch", "16", "--seq", "256", "--loss", "mean", "--json",
                     "--dtype", "fp32")
    d = json.loads(out)
    assert rc == 0 and d["n_params"] == 1_543_714_304
    assert d["peak_phase"] == "forward/backward" and abs(d["peak_gib"] - 43.8) < 0.6
    assert {t["key"] for t in d["terms"]} >= {"params", "grads", "opt_state", "opt_temp", "activations"}
    assert "max_memory_allocated" in d["predicts"]
    assert len(d["nvml_range"]) == 2


def test_params_only_uses_the_heuristic(capsys):
    rc, out, _ = run(capsys, "--params", "1.5e9", "--batch", "16", "--seq", "256", "--json")
    d = json.loads(out)
    assert d["activation_method"] == "heuristic"
    assert any("heuristic" in a for a in d["assumptions"])


def test_fit_cli(capsys):
    rc, out, _ = run(capsys, "--config", QWEN, "--seq", "256", "--gpu", "80GiB", "--fit", "--json", "--dtype", "fp32")
    d = json.loads(out)
    b = d["fit"]["value"]
    assert rc == 0 and b > 16
    arch = load_config(QWEN)[0]
    s = Setup(arch=arch, seq=256)
    assert d["fit"]["slack"] == 0            # needed: the peak, its rounding and the context; the cache apart
    assert d["fit"]["cache_may_form_bytes"] > 0
    assert fits(estimate(replace(s, batch=b)).peak_bytes, 80 * GiB, d["fit"]["context_bytes"], 0)
    assert not fits(estimate(replace(s, batch=b + 1)).peak_bytes, 80 * GiB, d["fit"]["context_bytes"], 0)
    rc, out, _ = run(capsys, "--config", QWEN, "--seq", "256", "--gpu", "80GiB", "--fit", "--dtype", "fp32")
    first = " ".join(out.split("\n\n")[0].split())
    assert first.startswith(f"largest batch that fits on 80 GiB: {b}") and "cache that may form" in first
    # what nvidia-smi will show stops at the card (a new user read "fits" beside "73.5 GiB -
    # 100 GiB" on an 80 GiB card)
    flat = " ".join(out.split())
    shown = flat.split("nvidia-smi / NVML will show about ")[1]
    assert shown.split(" (the card")[0].endswith(" - 80 GiB"), shown[:80]
    assert "(the card: its cache may fill it)" in shown[:80]


def test_fit_is_monotone_in_capacity_and_seq():
    arch = load_config(QWEN)[0]
    s = Setup(arch=arch, batch=1, seq=512)
    prev = -1
    for cap in (30, 40, 60, 80, 141):
        v = fit(s, cap * GiB).value
        assert v >= prev
        prev = v
    seqs = [fit(replace(s, batch=b), 80 * GiB, what="seq").value for b in (1, 2, 4, 8)]
    assert seqs == sorted(seqs, reverse=True) and seqs[-1] > 0


def test_fit_nothing_fits():
    arch = load_config(QWEN)[0]
    r = fit(Setup(arch=arch, batch=1, seq=512), 8 * GiB)
    assert r.value == 0


def test_gpu_without_fit_says_whether_it_fits(capsys):
    rc, out, _ = run(capsys, "--config", QWEN, "--batch", "16", "--seq", "256", "--gpu", "40GiB", "--dtype", "fp32")
    assert out.startswith("does NOT fit on 40 GiB")


@pytest.mark.parametrize("argv,msg", [
    (["--config", QWEN, "--params", "1e6"], "--params and --config: give one model"),
    (["--config", QWEN, "--model", "m:f", "--measure"], "--config and --model: give one model"),
    (["--config", QWEN, "--slack", "0.1"], "--slack goes with --gpu"),
    ([], "give the model"),
    (["--model", "x:y"], "needs --measure"),
    (["--config", QWEN, "--fit"], "needs --gpu"),
    (["--params", "lots"], "not a count"),
    (["--config", QWEN, "--gpu", "eighty", "--fit"], "not a size"),
    (["--config", QWEN, "--gpu", "80", "--fit"], "has no unit"),
    (["--params", "1e9", "--lora-rank", "8"], "needs --config"),
])
def test_errors_are_one_line(capsys, argv, msg):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and msg in err and err.count("\n") == 1 and out == ""


@pytest.mark.parametrize("content,msg", [
    (None, "no such config"),
    (b"", "not valid JSON"),
    (b"\x89PNG\x00\xff", "is not a config.json: not text"),  # (was Python's codec error)
    (b"[" * 100_000, "nested too deeply"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"model_type": "llama"}', "lacks"),
])
def test_a_bad_config_file_is_a_runtime_failure_in_one_line(capsys, tmp_path, content, msg):
    """docs/commands.md: a file that is missing, unreadable or corrupt is bad input, status 1
    (as for `view` and `diff`); 2 is for the command line itself."""
    p = tmp_path / "config.json"
    if content is not None:
        p.write_bytes(content)
    rc, out, err = run(capsys, "--config", str(p))
    assert "codec" not in err and "Errno" not in err, err
    assert rc == 1 and msg in err and err.count("\n") == 1 and out == "", (rc, err)
    assert err.startswith("gpumon: ") and "Traceback" not in err


def test_a_binary_file_given_to_load_is_said_in_words(capsys, tmp_path):
    p = tmp_path / "est.pickle"
    p.write_bytes(b"\x80\x04\x95\xff\xfe")
    rc, out, err = run(capsys, "--load", str(p))
    assert (rc, out) == (1, "") and err == (f"gpumon: {p} is not an estimate saved by --json: "
                                            "not text\n"), err


def test_measure_through_model_factory(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "mymodels.py").write_text(
        "import torch, torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32))\n"
        "def example_input(batch, seq):\n"
        "    return torch.randn(batch, seq, 32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = run(capsys, "--model", "mymodels:build", "--measure", "--batch", "4", "--seq", "8", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["activation_method"] == "measured"
    # saved: the input (Linear 1), its output (ReLU saves its result), ReLU output (Linear 2)
    acts = next(t for t in d["terms"] if t["key"] == "activations")["bytes"]
    assert acts == 4 * 8 * (32 + 128) * 4
    assert d["n_params"] == 32 * 128 + 128 + 128 * 32 + 32


def test_measure_with_config_without_transformers(capsys):
    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers installed")
    rc, out, err = run(capsys, "--config", QWEN, "--measure")
    assert rc == 1 and "transformers" in err


# compare and --check: tests/estimate/test_live_check.py

def test_estimate_layer_imports_neither_torch_nor_textual():
    code = ("import sys, gpumon.estimate, gpumon.estimate.measure, gpumon.estimate.check, gpumon.estimate.compare, "
            "gpumon.commands.estimate;"
            "bad=[m for m in ('torch','textual') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("argv", [
    ["--config", QWEN, "--batch", "2", "--seq", "256", "--loss", "mean"],
    ["--config", QWEN, "--batch", "8", "--seq", "1024", "--dtype", "bf16", "--amp", "--checkpointing",
     "--optimizer", "adafactor"],
    ["--config", QWEN, "--seq", "256", "--gpu", "80GiB", "--fit"],
    ["--config", QWEN, "--seq", "256", "--gpu", "H100", "--dtype", "fp32"],
    ["--config", QWEN, "--batch", "4", "--seq", "2048", "--gpu", "8GiB", "--fit"],        # nothing fits
    ["--config", QWEN, "--lora-rank", "16", "--lora-targets", "all", "--zero", "3", "--shards", "8"],
    ["--config", str(CFG / "mixtral-8x7b.json"), "--dtype", "bf16", "--batch", "2", "--seq", "4096"],
    ["--params", "7B", "--optimizer", "adamw8bit", "--grad-accum", "4"],
])
def test_text_output_fits_80_columns_and_keeps_every_note(capsys, argv):
    """It was ~130 columns (the terms table's "how" column, the assumptions), so an 80-column
    terminal wrapped it into a mess. Now every line fits; nothing is lost: each term's note and each
    assumption is there, wrapped."""
    from gpumon.estimate.report import SHORT_LABELS
    rc, out, err = run(capsys, *argv)
    assert rc in (0, 1), err
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    d = json.loads(run(capsys, *argv, "--json")[1])
    flat = " ".join(out.split())
    for t in d["terms"]:
        label = SHORT_LABELS.get(t["label"], t["label"])
        assert any(x.startswith(f"  {label}  ") for x in lines), label                 # the table row
        assert f"{label}: {' '.join(t['note'].split())}" in flat, t["note"]            # and its note, whole
    for a in d["assumptions"]:
        assert " ".join(a.split()) in flat, a
    assert f"peak allocated: {fmt_bytes(d['peak_bytes'])} ({d['peak_bytes']:,} B)" in flat


@pytest.mark.parametrize("columns", [None, "80", "200"])
def test_piped_text_output_fits_80_columns(columns):
    """As a user sees it through `| cat` (a pipe, no terminal) and with COLUMNS set: 80 columns,
    or up to 100 on a wider terminal."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    if columns:
        env["COLUMNS"] = columns
    r = subprocess.run([sys.executable, "-m", "gpumon", "estimate", "--config", QWEN, "--batch", "4", "--seq",
                        "512", "--amp", "--dtype", "bf16", "--gpu", "80GiB"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    widest = max(map(len, r.stdout.splitlines()))
    assert widest <= (100 if columns == "200" else 80) and r.stdout.startswith("fits on 80 GiB")
