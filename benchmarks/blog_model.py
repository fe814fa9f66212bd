"""The blog's model: a Qwen2.5-1.5B-shaped causal LM from tests/fixtures/configs, random
weights, fp32, sdpa attention, no KV cache. One builder for the GPU tests and benchmarks that
train it (benchmarks/phases_overhead.py, benchmarks/exact_peak_probe.py, tests/gpu/
test_phases_gpu.py, tests/gpu/test_view_names_gpu.py); their training programs (``python -c``)
import it too: it imports nothing of gpumon, and torch/transformers only when called.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs" / "qwen2.5-1.5b.json"


def build(torch: Any, device: str, config_path: Any = CONFIG, layers: int | None = None,
          dtype: Any = None) -> tuple[Any, Any]:
    """(model, config) on ``device``, in ``dtype`` (fp32), with ``layers`` decoder layers if
    given (a cut model for a CPU try). Seed torch before calling, as the callers do."""
    import transformers
    cfg = json.loads(Path(config_path).read_text())
    mt = cfg.pop("model_type")
    cfg["use_cache"] = False
    if layers:
        cfg["num_hidden_layers"] = layers
    config = transformers.AutoConfig.for_model(mt, **cfg)
    dtype = torch.float32 if dtype is None else dtype
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(
                config, torch_dtype=dtype, attn_implementation="sdpa")
    return model, config
