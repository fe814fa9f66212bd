"""--measure on ordinary nn.Modules, quietly and fast, honouring or refusing every flag (issue 19).

Before: nn.TransformerEncoder (examples/train.py's model) failed with "Mixing fake modes NYI";
a module without example_input was refused; torch's FakeTensor deprecation warnings reached the
screen; --lora-rank and --freeze-embeddings were dropped without a word; a bad --model was
reported after seconds of imports, a missing transformers after more."""
import argparse
import json
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from gpumon.commands import estimate as cmd  # noqa: E402
from gpumon.estimate import measure as measure_mod  # noqa: E402
from gpumon.estimate.measure import MeasureError, measure_activations  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import EncoderLM, saved_bytes_direct  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QWEN = str(ROOT / "tests" / "fixtures" / "configs" / "qwen2.5-1.5b.json")


def run(capsys, *argv):
    p = argparse.ArgumentParser(prog="gpumon")
    cmd.register(p.add_subparsers(dest="command"))
    args = p.parse_args(["estimate", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_transformer_encoder_measures_without_example_input_and_matches_cpu():
    B, L = 2, 32
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = measure_activations(B, L, factory=EncoderLM)
    assert seen == []                                           # nothing reaches the user's screen
    assert r.get("hidden_warnings")                             # deepcopy of fake tensors warns: kept, counted
    assert any("input: token ids [2, 32]" in n and "Embedding(100, 32)" in n for n in r["notes"])
    torch.manual_seed(0)
    m = EncoderLM()
    direct = saved_bytes_direct(m, torch.randint(0, 100, (B, L)))
    assert r["n_params"] == sum(p.numel() for p in m.parameters())
    # fp32: CUDA's sdpa runs the memory-efficient kernel, whose output is a new contiguous [B, L, H, D]
    # (attention.cu _efficient_attention_forward), so MHA's permute(2, 0, 1, 3).contiguous() copies it:
    # one [B, L, d] per layer more than CPU's flash kernel, whose output follows q's [L, B, H, D].
    assert r["saved_bytes"] - direct == 2 * B * L * 32 * 4, (r["saved_bytes"], direct)


def test_transformer_encoder_bf16_flash_output_follows_q_layout():
    """bf16: CUDA runs flash, whose output is at::empty_like(q) (flash_api.cpp mha_fwd): MHA's q is a
    view of the packed in_proj output laid out [L, B, H, D], so the output is too and MHA's
    permute(2, 0, 1, 3).contiguous() is no copy. The emulation allocated [B, L, H, D] and counted
    one [B, L, d] copy per layer more: +7.5% against an H100. CPU's flash kernel lays it out the same
    way, so the CPU count is the reference; logsumexp is [B, H, L], unpadded (L = 40 here)."""
    B, L = 2, 40
    r = measure_activations(B, L, "bf16", factory=EncoderLM)
    assert r["attention"] == "flash"
    torch.manual_seed(0)
    direct = saved_bytes_direct(EncoderLM().to(torch.bfloat16), torch.randint(0, 100, (B, L)))
    assert r["saved_bytes"] == direct, (r["saved_bytes"], direct, r["saved_bytes"] - direct)


def test_linear_first_model_gets_a_float_input():
    r = measure_activations(4, 8, factory=lambda: nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32)))
    assert r["saved_bytes"] == 4 * 8 * (32 + 128) * 4
    assert any("[4, 8, 32]" in n and "Linear(32, 128)" in n for n in r["notes"])


def test_a_model_whose_input_cannot_be_told_asks_for_example_input():
    with pytest.raises(MeasureError, match="example_input"):
        measure_activations(1, 8, factory=lambda: nn.Sequential(nn.Conv1d(3, 8, 3)))
    with pytest.raises(MeasureError, match="not an nn.Module"):
        measure_activations(1, 8, factory=lambda: 42)


def test_freeze_embeddings_is_honoured():
    r = measure_activations(2, 16, factory=EncoderLM)
    f = measure_activations(2, 16, factory=EncoderLM, freeze_embeddings=True)
    assert r["n_trainable"] - f["n_trainable"] == 100 * 32
    assert any("embeddings frozen" in n for n in f["notes"])
    with pytest.raises(MeasureError, match="no nn.Embedding"):
        measure_activations(2, 8, factory=lambda: nn.Linear(8, 8), freeze_embeddings=True)


def test_attn_math_is_honoured():
    B, L, H = 2, 32, 4
    r = measure_activations(B, L, factory=EncoderLM)
    m = measure_activations(B, L, factory=EncoderLM, attn="math")
    assert m["attention"] == "math" and "efficient" in r["attention"]
    assert m["saved_bytes"] - r["saved_bytes"] >= 2 * B * H * L * L * 4 * 0.9     # the L x L probabilities


@pytest.mark.parametrize("argv,msg", [
    (["--lora-rank", "8"], "does not add LoRA adapters"),
    (["--activations", "heuristic"], "--activations is decided by --measure"),
    (["--checkpointing"], "gradient checkpointing"),
    (["--amp"], "autocast"),
    (["--gpu", "80GiB", "--fit"], "--fit with --measure"),
])
def test_measure_refuses_what_it_cannot_honour(capsys, monkeypatch, argv, msg):
    monkeypatch.setattr(measure_mod, "_torch", lambda: pytest.fail("torch imported for a usage error"))
    rc, out, err = run(capsys, "--config", QWEN, "--measure", *argv)
    assert rc == 2 and msg in err and err.count("\n") == 1 and out == ""


def test_bad_model_is_reported_before_torch_is_imported(capsys, monkeypatch):
    monkeypatch.setattr(measure_mod, "_torch", lambda: pytest.fail("torch imported before the check"))
    rc, _, err = run(capsys, "--model", "no_such_pkg_xyz.models:build", "--measure")
    assert rc == 1 and "no module named 'no_such_pkg_xyz'" in err and err.count("\n") == 1
    rc, _, err = run(capsys, "--model", "nocolon", "--measure")
    assert rc == 2 and "pkg.module:factory" in err


def test_a_missing_submodule_or_factory_is_reported_without_importing_it(capsys, monkeypatch, tmp_path):
    """Both took 5-6 s (torch imported, then the user's module) before the one line."""
    pkg = tmp_path / "mypkg_q19"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text("raise SystemExit('the module must not be imported by the check')\n"
                                   "import torch.nn as nn\n"
                                   "def build():\n    return nn.Linear(4, 4)\n"
                                   "if True:\n    class Net: pass\n"
                                   "try:\n    helper = 1\nexcept ImportError:\n    helper = None\n")
    (pkg / "star.py").write_text("from os.path import *\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(measure_mod, "_torch", lambda: pytest.fail("torch imported before the check"))
    rc, _, err = run(capsys, "--model", "mypkg_q19.models:nosuch", "--measure")
    assert rc == 1 and err.count("\n") == 1
    assert "mypkg_q19.models has no 'nosuch' (defined there: Net, build, helper, nn)" in err
    rc, _, err = run(capsys, "--model", "mypkg_q19.nomodule:build", "--measure")
    assert rc == 1 and "no module named 'mypkg_q19.nomodule'" in err and err.count("\n") == 1
    assert measure_mod._top_level_names(str(pkg / "star.py")) is None         # cannot tell: left to the import
    assert {"build", "Net", "helper"} <= measure_mod._top_level_names(str(pkg / "models.py"))


def test_missing_transformers_is_reported_before_torch_is_imported(capsys, monkeypatch):
    real = measure_mod._find_spec
    monkeypatch.setattr(measure_mod, "_find_spec", lambda n: None if n == "transformers" else real(n))
    monkeypatch.setattr(measure_mod, "_torch", lambda: pytest.fail("torch imported before the check"))
    rc, _, err = run(capsys, "--config", QWEN, "--measure")
    assert rc == 1 and "needs transformers" in err and err.count("\n") == 1


def test_cli_measure_on_a_factory_with_frozen_embeddings(capsys, tmp_path, monkeypatch):
    (tmp_path / "encmodels.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    m = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))\n"
        "    return m\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = run(capsys, "--model", "encmodels:build", "--measure", "--batch", "2", "--seq", "8",
                       "--freeze-embeddings", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["n_params"] == 50 * 16 + 16 * 50 + 50 and d["n_trainable"] == 16 * 50 + 50
    assert err == ""
    # no output embedding: the loss is the output's mean, said; not HF's cross-entropy
    assert any("--loss does not apply" in a for a in d["assumptions"])
    assert not any("cross-entropy over the full logits" in a for a in d["assumptions"])
    rc, _, err = run(capsys, "--model", "encmodels:build", "--measure", "--attn", "eager")
    assert rc == 2 and "--attn eager" in err
