"""The memory estimator: predict a training step's peak memory before running it.

Imports neither torch nor textual (`measure` imports torch inside its functions only).

    from gpumon.estimate import Setup, estimate, load_config
    arch, _ = load_config("config.json")
    e = estimate(Setup(arch=arch, batch=16, seq=256, optimizer="adamw"))
    e.peak_bytes, e.peak_phase, e.terms
"""
from .arch import Arch, ConfigError, arch_from_config, load_config
from .compare import Comparison, CompareRow, Measured, compare_device, compare_live, render_comparison
from .core import Estimate, EstimateError, Setup, Term, estimate
from .fit import FitResult, fit
from .measure import MeasureError
from .report import render_json, render_text
from .units import fmt_bytes, parse_bytes, parse_count

__all__ = ["Arch", "ConfigError", "arch_from_config", "load_config", "Comparison", "CompareRow", "Measured",
           "compare_device", "compare_live", "render_comparison", "Estimate",
           "EstimateError", "Setup", "Term", "estimate", "FitResult", "fit", "MeasureError", "render_json",
           "render_text", "fmt_bytes", "parse_bytes", "parse_count"]
