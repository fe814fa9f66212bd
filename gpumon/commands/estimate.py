"""`gpumon estimate`: predict a training run's peak GPU memory before running it."""
from __future__ import annotations

import argparse

import sys

from gpumon.commands.args import pid_arg
from gpumon.estimate.arch import KNOWN_TYPES

EXAMPLES = """examples:
  gpumon estimate --params 1.5e9 --batch 16 --seq 256 --dtype fp32
  gpumon estimate --config config.json --batch 4 --seq 2048 --dtype bf16 --amp \\
      --optimizer adamw8bit --checkpointing
  gpumon estimate --model mypkg.models:build --batch 8 --seq 1024 --measure
      (build() returns an nn.Module)
  gpumon estimate --config config.json --batch 8 --seq 1024 --gpu 80GiB --fit
  gpumon estimate --config config.json --batch 8 --seq 1024 --json > est.json
  gpumon estimate --load est.json --check 12345    # against the live pid 12345
"""


def _description() -> str:
    """Wrapped here (the raw formatter keeps the examples' lines as written): 80 columns."""
    import textwrap
    paras = [
        "Predict torch.cuda.max_memory_allocated() of a training step: parameters, gradients, optimizer "
        "state and temporaries, activations, and where the peak falls.",
        "--config (analytical formula) knows these model_types: " + ", ".join(KNOWN_TYPES) +
        " (decoders; sliding-window layers included; mixtral, qwen2_moe and qwen3_moe are mixtures of "
        "experts: all experts' parameters, gradients and optimizer state, the routed top-k experts' "
        "activations; deepseek_v2 and deepseek_v3 add multi-head latent attention). Any other "
        "model_type, and other mixture-of-experts configs, are refused: use "
        "--measure, which builds the model with transformers on fake tensors (no memory) and counts what "
        "autograd saves.",
    ]
    return "\n\n".join(textwrap.fill(x, 78, break_on_hyphens=False) for x in paras)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="predict a training step's peak memory (no GPU needed)",
        description=_description(),
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("the model (one of)")
    src.add_argument("--params", help="parameter count (1.5e9, 1.5B, 350M): activations from the blog's heuristic")
    src.add_argument("--config", help="a Hugging Face config.json (or its folder), read as plain JSON")
    src.add_argument("--model", metavar="PKG.MOD:FACTORY",
                     help="a factory returning an nn.Module (with --measure); its input is example_input(batch, seq) "
                          "from the module or the factory's file, else token ids or a float tensor inferred from "
                          "its first layer (Embedding, Linear, TransformerEncoderLayer), as the estimate says")
    run = p.add_argument_group("the run")
    run.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    run.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    run.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                     help="weights and compute dtype; with --amp the compute dtype (default: the config's "
                          "torch_dtype/dtype, else fp32; the estimate says which)")
    run.add_argument("--amp", action="store_true", help="autocast to --dtype with fp32 master weights")
    run.add_argument("--optimizer", default="adamw", metavar="NAME",
                     choices=("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adamw8bit", "lion"),
                     help="adamw (default), adam, sgd, sgd-momentum, adafactor, adamw8bit or lion")
    run.add_argument("--impl", choices=("foreach", "fused", "for-loop"),
                     help="optimizer implementation (default: what torch picks on --device: foreach for "
                          "AdamW/Adam/SGD on CUDA, the for-loop on CPU and for Adafactor; the estimate says which)")
    run.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                     help="where the step runs (default cuda): the optimizer's default implementation, "
                          "and on cuda the CUDA kernels' own tensors (cuDNN attention, the softmax backward's)")
    run.add_argument("--state-dtype", choices=("fp32", "bf16", "fp16"), help="optimizer state dtype (default: the weights')")
    wd = run.add_mutually_exclusive_group()
    wd.add_argument("--weight-decay", dest="weight_decay", action="store_const", const=True, default=None,
                    help="weight_decay != 0 (default: the optimizer's torch default; AdamW 0.01, SGD/Adam 0)")
    wd.add_argument("--no-weight-decay", dest="weight_decay", action="store_const", const=False, help="weight_decay=0")
    run.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every layer")
    run.add_argument("--attn", choices=("sdpa", "flash", "efficient", "math", "eager"),
                     help="attention implementation (default: the config's attn_implementation, else sdpa; "
                          "with --measure transformers' own default for the model; sdpa: the kernel CUDA "
                          "would pick)")
    run.add_argument("--loss", default="ce", choices=("ce", "mean"),
                     help="ce: cross-entropy on the logits (HF labels=); mean: logits.mean() as in the blog")
    run.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (>1: gradients live in forward)")
    run.add_argument("--keep-grads", action="store_true", help="zero_grad(set_to_none=False): gradients live in forward")
    run.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank; the base is frozen")
    run.add_argument("--lora-targets", help="comma-separated module names, or all (default q_proj,v_proj)")
    run.add_argument("--freeze-embeddings", action="store_true", help="embedding (and tied head) frozen")
    run.add_argument("--trainable", help="only this many parameters train (the rest frozen)")
    run.add_argument("--largest-param", help="elements of the largest parameter (with --params; for-loop temporaries)")
    run.add_argument("--shards", type=int, default=1, help="ranks sharing the model states (with --zero)")
    run.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                     help="ZeRO stage: 1 optimizer state, 2 + gradients, 3 (FSDP full shard) + parameters")
    run.add_argument("--workspace", default="64MiB",
                     help="cuBLAS workspaces inside torch's allocator, in all, with a unit (default 64MiB: one of "
                          "32MiB for the forward's thread and one for autograd's backward thread, as on H100/H200; "
                          "other GPUs: 16.25MiB; 0 leaves them out)")
    act = p.add_argument_group("activations")
    act.add_argument("--activations", default="auto", choices=("auto", "analytical", "heuristic"),
                     help="auto: measured with --measure, else analytical with --config, else the blog's heuristic")
    act.add_argument("--measure", action="store_true",
                     help="build the model with fake tensors (no memory) and count what autograd saves (needs torch; "
                          "--config also needs transformers)")
    act.add_argument("--measure-device", default="fake", help=argparse.SUPPRESS)
    fitg = p.add_argument_group("fit")
    fitg.add_argument("--gpu", help="a card (H100, H100-80GB, A100-40GB, A100-80GB, H200, L4, L40S, RTX4090; "
                                    "80GB: the card sold as 80GB) with the memory torch can use on it, or a "
                                    "size with a unit (79GiB, 143771MiB)")
    fitg.add_argument("--fit", nargs="?", const="batch", choices=("batch", "seq"),
                      help="find the largest batch (default) or sequence length whose predicted nvidia-smi figure "
                           "(peak + allocator cache + CUDA context) fits --gpu; exit 1 when not even 1 fits")
    fitg.add_argument("--slack", type=float,
                      help="allocator cache to count as needed, as a fraction of the peak (default 0: the cache "
                           "is shown apart, as what may form; the allocator frees it before failing)")
    live = p.add_argument_group("check against a live run")
    live.add_argument("--check", type=pid_arg, metavar="PID",
                      help="attach to PID's gpumon agent, wait for 2 completed training steps and print "
                           "estimate vs measured, term by term, with the error in %%")
    live.add_argument("--load", metavar="EST.json", help="use an estimate saved with --json instead of computing one")
    live.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the steps (default 120)")
    p.add_argument("--json", action="store_true", help="print the estimate (with --check: and the comparison) as JSON")
    p.set_defaults(func=run_estimate)


def _fail(msg: str, status: int = 2) -> int:
    """One `gpumon: ` line; status 2 (usage: the command line cannot work as given) unless
    told 1 (a runtime failure: a file that is missing, unreadable or not what it should be, a
    model that cannot be imported or built, a process that is not there): docs/commands.md."""
    print(f"gpumon: {msg}", file=sys.stderr)
    return status


def _bad_input(msg: str) -> int:
    return _fail(msg, 1)


# Flags --measure cannot honour: each is refused, never dropped (the analytical mode honours them).
MEASURE_REFUSES = {
    "fit": "--fit with --measure is not supported (each try would rebuild the model); use --config without --measure",
    "checkpointing": "--measure does not model gradient checkpointing; leave out --measure (analytical formula) "
                     "for --checkpointing",
    "amp": "--measure cannot count autocast on fake tensors; leave out --measure (analytical formula) for --amp",
    "lora_rank": "--measure does not add LoRA adapters; leave out --measure (analytical formula with --config) "
                 "for --lora-rank",
    "activations": "--activations is decided by --measure (measured); leave one of them out",
}


def _usage_checks(args) -> str | None:
    """Flags that make no sense together: one line, before anything slow."""
    given = [f for f, v in (("--params", args.params), ("--config", args.config), ("--model", args.model)) if v]
    if len(given) > 1:
        return f"{' and '.join(given)}: give one model (the others were ignored without a word)"
    if args.slack is not None and not args.gpu:
        return "--slack goes with --gpu SIZE (and --fit): the allocator cache kept free on that GPU"
    if args.model and not args.measure:
        return "--model needs --measure (the model is built and measured with fake tensors)"
    if args.largest_param and not args.params:
        return "--largest-param goes with --params (with --config or --measure it is known)"
    if args.lora_targets and not args.lora_rank:
        return "--lora-targets without --lora-rank: give the adapters' rank too"
    if args.lora_rank and not args.config:
        return "--lora-rank needs --config (the adapters' size depends on the layer shapes)"
    if args.fit and not args.gpu:
        return "--fit needs --gpu SIZE (e.g. --gpu 80GiB)"
    from gpumon.estimate.schema import SchemaError, validate_cli
    try:
        validate_cli(args)
    except SchemaError as e:
        return str(e)
    if args.slack is not None and not (0 <= args.slack < 10):
        return f"--slack {args.slack}: a fraction of the peak, e.g. 0.25"
    if args.measure:
        if not (args.model or args.config):
            return "--measure needs --model or --config"
        if args.model and (":" not in args.model or not all(args.model.partition(":")[::2])):
            return f"--model wants pkg.module:factory, got {args.model!r}"
        if args.model and args.attn == "eager":
            return ("--attn eager picks transformers' attention implementation (with --config); with --model "
                    "your module's code decides (sdpa calls are counted as CUDA runs them)")
        for flag, msg in MEASURE_REFUSES.items():
            v = getattr(args, flag)
            if v and not (flag == "activations" and v == "auto"):
                return msg
    return None


def _measure_only_checks(args, cfg: dict) -> str | None:
    """A config only --measure reads (a model type the formula does not model): what the formula
    would have checked, from the raw config."""
    limit = next((cfg.get(k) for k in ("max_position_embeddings", "n_positions")
                  if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)), None)
    if limit and args.seq > limit:
        return (f"sequence length {args.seq} is past the config's max_position_embeddings ({limit}): the model "
                "cannot run it as configured")
    if args.zero == 3:
        return ("--zero 3 needs the layer shapes (the gathered parameters), which the formula reads only for "
                "the model types it knows: leave out --zero 3, or use --zero 1 or 2")
    return None


CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32", "bf16": "bf16",
                 "fp16": "fp16", "half": "fp16", "float": "fp32"}
CONFIG_ATTN = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash"}


def _config_dtype(args, raw: dict | None) -> tuple[str, str]:
    """(dtype, where it came from): --dtype, else the config's torch_dtype/dtype, else fp32 (issue 34:
    a config's bfloat16 was ignored without a word)."""
    if args.dtype:
        return args.dtype, "--dtype"
    if raw is not None:
        part = raw.get("text_config") if isinstance(raw.get("text_config"), dict) and "hidden_size" not in raw else raw
        for key in ("dtype", "torch_dtype"):
            v = (part or {}).get(key) or raw.get(key)
            if isinstance(v, str):
                if v in CONFIG_DTYPES:
                    return CONFIG_DTYPES[v], f"the config's {key}"
                return "fp32", f"fp32: the config's {key} {v!r} is not one the estimate reads"
    return "fp32", "the default (no --dtype, no dtype in the config)"


def _formula_attn(args, arch) -> tuple[str, str]:
    """The attention implementation the formula counts: --attn, else the config's, else sdpa."""
    if args.attn:
        return args.attn, "--attn"
    impl = (arch.extra.get("attn_implementation") if arch is not None else None)
    if impl in CONFIG_ATTN:
        return CONFIG_ATTN[impl], f"the config's attn_implementation {impl!r}"
    return "sdpa", "transformers' default (sdpa)"


def _gpu(text: str) -> tuple[str, int, str]:
    """(label, usable bytes, source) for --gpu: a card's name or sold size, else a size with a unit."""
    from gpumon.estimate.gpus import lookup
    from gpumon.estimate.units import parse_bytes, fmt_bytes
    card = lookup(text)
    if card:
        return card
    cap = parse_bytes(text, "--gpu")
    if cap <= 0:
        raise ValueError(f"--gpu {text}: a GPU with no memory")
    return fmt_bytes(cap), cap, "given"


def run_estimate(args) -> int:
    from gpumon.estimate import (ConfigError, EstimateError, MeasureError, Setup, estimate, fit,
                                 load_config, parse_bytes, parse_count, render_json, render_text)
    from gpumon.estimate.report import text_width
    from gpumon.estimate.schema import SchemaError, check_count
    if args.load:
        return _run_loaded(args)
    if not any(x for x in (args.params, args.config, args.model)):
        return _fail("give the model: --params COUNT, --config config.json or --model pkg.mod:factory")
    msg = _usage_checks(args)
    if msg:
        return _fail(msg)
    gpu = None
    try:
        workspace = parse_bytes(args.workspace, "--workspace")
        gpu_label, capacity, gpu_source = _gpu(args.gpu) if args.gpu else (None, None, None)
        n_params = check_count("--params", parse_count(args.params)) if args.params else None
        trainable = check_count("--trainable", parse_count(args.trainable), lo=0) if args.trainable else None
        largest = check_count("--largest-param", parse_count(args.largest_param)) if args.largest_param else None
        arch, raw = None, None
        if args.config:
            from gpumon.estimate.arch import NotModelled, multimodal_parts, read_config
            try:
                arch, raw = load_config(args.config)
            except SchemaError as exc:    # a number no model has: usage (exit 2), before any arithmetic
                return _fail(str(exc))
            except NotModelled as exc:   # the formula refuses it; --measure builds it with transformers
                raw = read_config(args.config)[0]
                if not args.measure or multimodal_parts(raw):
                    return _bad_input(str(exc))
                msg = _measure_only_checks(args, raw)
                if msg:
                    return _fail(msg)
            except ConfigError as exc:  # the file: missing, unreadable, corrupt
                return _bad_input(str(exc))
        dtype, dtype_from = _config_dtype(args, raw)
        attn, attn_from = _formula_attn(args, arch)
        measured = None
        setup = Setup(
            batch=args.batch, seq=args.seq, dtype=dtype, amp=args.amp, optimizer=args.optimizer,
            impl=args.impl, device=args.device, state_dtype=args.state_dtype, weight_decay=args.weight_decay,
            arch=arch, n_params=n_params, largest_param=largest, trainable_params=trainable,
            freeze_embeddings=args.freeze_embeddings, lora_rank=args.lora_rank,
            lora_targets=tuple(t.strip() for t in (args.lora_targets or "q_proj,v_proj").split(",") if t.strip()),
            checkpointing=args.checkpointing, attn=attn, loss=args.loss,
            grads_in_forward=args.grad_accum > 1 or args.keep_grads,
            activations=args.activations, workspace_bytes=workspace, shards=args.shards, zero_stage=args.zero)
        # every input checked (units, shapes, flags) before the slow measurement
        from dataclasses import replace
        estimate(setup if (arch or n_params) else replace(setup, n_params=1, activations="heuristic"))
        if args.measure:
            from gpumon.estimate.measure import measure_activations, preflight
            from gpumon.commands.args import progress
            try:
                preflight(model=args.model, config=args.config if not args.model else None)
                # seconds to tens of seconds (torch and transformers imports, one fake step)
                with progress("measuring the activations: building the model and running one "
                              "training step on fake tensors"):
                    measured = measure_activations(
                        args.batch, args.seq, dtype, model=args.model,
                        config=args.config if not args.model else None, attn=args.attn,
                        device=args.measure_device, freeze_embeddings=args.freeze_embeddings)
            except MeasureError as exc:  # torch/transformers missing, the model's import or build failed
                return _bad_input(str(exc))
            setup = replace(setup, measured=measured, activations="measured")
        fr = None
        if args.fit:
            fr = fit(setup, capacity, what=args.fit, slack=args.slack)
            e = fr.estimate
        else:
            e = estimate(setup)
        e.assumptions.insert(0, f"dtype {dtype} from {dtype_from}")
        if not args.measure and arch is not None:
            e.assumptions.insert(1, f"attention: {attn} from {attn_from}")
        if gpu_label is not None:
            from gpumon.estimate.core import CUDA_CONTEXT_BYTES
            from gpumon.estimate.fit import cache_may_form, needed
            e.assumptions.append(f"--gpu {args.gpu}: {gpu_label}, {capacity / 2**30:.2f} GiB usable ({gpu_source})")
            if fr is None:
                gpu = {"label": gpu_label, "capacity": capacity, "source": gpu_source,
                       "needed": needed(e.peak_bytes, CUDA_CONTEXT_BYTES[1], args.slack or 0.0),
                       "cache": cache_may_form(e.peak_bytes, e.allocator_cache[1])}
            else:
                gpu = {"label": gpu_label, "capacity": capacity, "source": gpu_source}
    except (ConfigError, EstimateError, ValueError) as exc:  # the flags (and the config's limits)
        return _fail(str(exc))
    except Exception as exc:     # never a traceback (issue 34): one line, a runtime failure
        return _bad_input(f"the estimate failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    if args.check is not None:
        return _check(args, e.to_dict(), None if args.json else render_text(e, fr, text_width(), gpu))
    print(render_json(e, fr, gpu) if args.json else render_text(e, fr, text_width(), gpu))
    if fr is not None and fr.value == 0:
        from gpumon.estimate.units import fmt_bytes
        print(f"gpumon: even {fr.what} 1 does not fit {gpu_label or fmt_bytes(fr.capacity)}: it needs "
              f"{fmt_bytes(fr.needed)} (the peak {fmt_bytes(fr.estimate.peak_bytes)} with the allocator's rounding "
              f"and the CUDA context)", file=sys.stderr)
        return 1
    return 0


def _run_loaded(args) -> int:
    import json
    if any(x for x in (args.params, args.config, args.model)):
        return _fail("--load takes the estimate from the file: leave out --params/--config/--model")
    try:
        with open(args.load) as f:
            d = json.load(f)
    except OSError as e:
        return _bad_input(f"cannot read {args.load}: {e.strerror or e}")
    except UnicodeDecodeError:
        return _bad_input(f"{args.load} is not an estimate saved by --json: not text")
    except (json.JSONDecodeError, RecursionError) as e:
        return _bad_input(f"{args.load} is not JSON: {e}")
    from gpumon.estimate.compare import as_estimate_dict
    try:
        as_estimate_dict(d)
    except ValueError:
        return _bad_input(f"{args.load} is not a gpumon estimate (write one with gpumon estimate ... --json)")
    if args.check is None:
        print(json.dumps(d, indent=2))
        return 0
    from gpumon.estimate.units import fmt_bytes
    head = (f"gpumon estimate (from {args.load}): peak {fmt_bytes(d['peak_bytes'])} in the {d['peak_phase']}"
            if not args.json else None)
    return _check(args, d, head)


def _check(args, est: dict, header: str | None) -> int:
    import json
    from gpumon.estimate.check import CheckError, check_live
    from gpumon.estimate.compare import render_comparison
    if header:
        print(header)
        print()
    from gpumon.commands.args import progress

    def say(line: str) -> None:  # a line each time what it waits for changes; the spinner too
        print(line, file=sys.stderr, flush=True)
        update(line)
    try:
        with progress(f"pid {args.check}: attaching") as update:
            comp, info = check_live(est, args.check, timeout=args.timeout,
                                    progress=None if args.json else say)
    except CheckError as exc:  # no such process, no agent, it ended or did not train in time
        return _bad_input(str(exc))
    if args.json:
        print(json.dumps({"estimate": est, "comparison": comp.to_dict(), "device": info["device"],
                          "steps": info["steps"]}, indent=2, default=str))
    else:
        print(f"live check: pid {args.check}, device {info['device']}, after {info['steps']} steps")
        from gpumon.estimate.report import text_width
        print(render_comparison(comp, text_width()))
    return 0
