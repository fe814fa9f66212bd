"""The compatibility suite's victim: a training program that does, one after the other, what real
training programs do with their model (tests/compat/harness.py runs it plainly, under `gpumon
run`, with `gpumon.start()` and after `gpumon inject`).

    python victim.py OP [OP ...]      (ops: see OPS below; "all": every op)

For each op it prints ONE canonical line to stdout, ``op: result``, where the result holds what
the program itself can see (losses as float.hex, graph and break counts, hook keys): the lines of
a run with gpumon must equal those of a plain run, character for character. What gpumon saw of
the op's training steps (the agent's own state, only where gpumon is in the process) goes to the
JSON file $COMPAT_REPORT, never to stdout.

Environment (harness.py): COMPAT_START=1 calls gpumon.start(source="simulated") first;
COMPAT_WAIT=PATH waits until PATH exists before the first op (after touching PATH + ".ready"):
the injection tests inject meanwhile.
"""
from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.checkpoint import checkpoint

W = 16  # width of the models: tiny, so each op costs its framework's overhead only
STEPS = 3


class Net(torch.nn.Module):
    """A model of the program's own (dynamo compiles a forward defined outside torch.nn;
    jit.script compiles it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(W, 2 * W)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(2 * W, 2 * W), torch.nn.GELU())
            for _ in range(2))
        self.out = torch.nn.Linear(2 * W, W)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class CheckpointedNet(Net):
    """Its blocks run under activation checkpointing (reentrant or not), as memory-saving
    recipes do: the blocks run again inside backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=self.reentrant)
        return self.out(h)


def make_model(checkpoint: bool | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return Net() if checkpoint is None else CheckpointedNet(checkpoint)


def batch(i: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, W, generator=g)


def hexs(t: torch.Tensor) -> str:
    return float(t.detach().double().sum()).hex()


def evaluate(m, i: int = 9) -> str:
    with torch.no_grad():
        return hexs(m(batch(i)))


def train(model, steps: int = STEPS, call=None, opt=None) -> list[str]:
    """A plain training loop: forward, loss, backward, optimizer step; the losses, as hex."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if opt is None else opt
    call = model if call is None else call
    out = []
    for i in range(steps):
        x = batch(i)
        loss = ((call(x) - x) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out.append(loss.item().hex())
    return out


def same_params(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def hook_dicts(m) -> str:
    """What code that inspects a module's hooks sees (keys, in order)."""
    return "/".join(f"{n}={list(getattr(m, n).keys())}" for n in (
        "_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"))


# ------------------------------------------------------------------ the operations
def op_deepcopy():
    m = make_model()
    train(m)
    c = copy.deepcopy(m)  # a best-model copy / EMA teacher
    return f"same={same_params(m, c)} out={evaluate(c, 9)} {hook_dicts(c)}"


def op_pickle():
    m = make_model()
    train(m)
    c = pickle.loads(pickle.dumps(m))
    return f"same={same_params(m, c)} out={evaluate(c, 9)}"


def op_save_load_elsewhere():
    """torch.save(model) whole, loaded by a process WITHOUT gpumon (no GPUMON, no bootstrap)."""
    m = make_model()
    train(m)
    buf = io.BytesIO()
    torch.save(m, buf)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMON", "COMPAT"))}
    env["PYTHONPATH"] = ""  # gpumon run's bootstrap dir rides on PYTHONPATH
    # the model's class lives in this file: the loader imports it from here
    code = ("import sys, io, torch; torch.set_num_threads(1)\n"
            "sys.path.insert(0, %r); import victim\n"
            "m = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False)\n"
            "print(victim.evaluate(m), 'gpumon' in sys.modules)" % os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], input=buf.getvalue(), capture_output=True,
                       env=env, timeout=120)
    return f"rc={r.returncode} loaded={r.stdout.decode().strip()} err={r.stderr.decode()[-200:]!r}"


def op_averaged_model():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    m = make_model()
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for i in range(STEPS):
        losses += train(m, 1, opt=opt)
        ema.update_parameters(m)
    with torch.no_grad():
        out = evaluate(ema, 9)
    return f"losses={','.join(losses)} ema_out={out}"


def op_jit_script():
    m = make_model()
    train(m)
    s = torch.jit.script(m)
    buf = io.BytesIO()
    torch.jit.save(s, buf)
    buf.seek(0)
    s2 = torch.jit.load(buf)
    return f"out={evaluate(s, 9)} reloaded={evaluate(s2, 9)}"


def op_jit_trace():
    m = make_model()
    train(m)
    t = torch.jit.trace(m, (batch(9),))
    return f"out={evaluate(t, 8)} graph_nodes={len(list(t.graph.nodes()))}"


def op_export():
    m = make_model()
    train(m)
    ep = torch.export.export(m, (batch(9),))
    return f"out={hexs(ep.module()(batch(8)))} nodes={len(ep.graph.nodes)}"


def op_export_strict():
    """strict torch.export between training steps (a program exporting its model as it trains):
    the same exported program (its graph's code and signature) and the same training around it.
    torch 2.11-2.13 fail it while any global module hook exists: gpumon's steps aside."""
    import hashlib
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = train(m, opt=opt)
    try:
        ep = torch.export.export(m, (batch(9),), strict=True)
        with torch.no_grad():
            out = hexs(ep.module()(batch(8)))
        text = f"{ep.graph_module.code}\n{ep.graph_signature}"
        got = (f"out={out} nodes={len(ep.graph.nodes)} "
               f"program={hashlib.sha256(text.encode()).hexdigest()[:16]}")
    except Exception as e:
        got = f"error={type(e).__name__}"
    after = train(m, opt=opt)
    return f"{got} losses={','.join(before)}/{','.join(after)}"


class _Counting:
    """A dynamo backend that counts the graphs it is handed (and runs them eagerly)."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(len(gm.graph.nodes))
        return gm.forward


def _dynamo_counts(backend: _Counting) -> str:
    from torch._dynamo.utils import counters
    breaks = sum(counters["graph_break"].values())
    recompiles = counters["stats"].get("unique_graphs", 0) - len(backend.graphs)
    return f"graphs={backend.graphs} breaks={breaks} unique_minus_backend={recompiles}"


def _dynamo_fresh():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()


def op_compile():
    _dynamo_fresh()
    m = make_model()
    ex = torch._dynamo.explain(m)(batch(9))
    _dynamo_fresh()
    be = _Counting()
    cm = torch.compile(m, backend=be)
    losses = train(m, call=cm)
    return (f"explain_graphs={ex.graph_count} explain_breaks={ex.graph_break_count} "
            f"{_dynamo_counts(be)} losses={','.join(losses)}")


def op_compile_fullgraph():
    _dynamo_fresh()
    m = make_model()
    be = _Counting()
    cm = torch.compile(m, backend=be, fullgraph=True)
    losses = train(m, call=cm)
    with torch.no_grad():  # an eval pass: the same graph serves it, or a recompile shows
        cm(batch(9))
    return f"{_dynamo_counts(be)} losses={','.join(losses)}"


def op_compile_inplace():
    _dynamo_fresh()
    m = make_model()
    be = _Counting()
    m.compile(backend=be)
    losses = train(m)
    return f"{_dynamo_counts(be)} losses={','.join(losses)}"


def op_compile_train_step():
    _dynamo_fresh()
    m = make_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    be = _Counting()

    @torch.compile(backend=be)
    def train_step(x):
        loss = ((m(x) - x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = [train_step(batch(i)).item().hex() for i in range(STEPS)]
    return f"{_dynamo_counts(be)} losses={','.join(losses)}"


def op_checkpoint_reentrant():
    m = make_model(checkpoint=True)
    return f"losses={','.join(train(m))}"


def op_checkpoint_nonreentrant():
    m = make_model(checkpoint=False)
    return f"losses={','.join(train(m))}"


def op_user_hooks():
    """The program's own hooks: registered, fired, inspected, removed."""
    m = make_model()
    fired: list[str] = []
    h1 = m.register_forward_pre_hook(lambda mod, a: fired.append("pre"))
    h2 = m.register_forward_hook(lambda mod, a, o: fired.append("post"))
    h3 = m.inp.register_forward_hook(lambda mod, a, o: fired.append("sub"))
    h4 = m.register_full_backward_hook(lambda mod, gi, go: fired.append("bwd"))
    losses = train(m, 2)
    seen = hook_dicts(m) + " sub:" + hook_dicts(m.inp)
    ids = [h.id for h in (h1, h2, h3, h4)]
    for h in (h1, h2, h3, h4):
        h.remove()
    return (f"fired={fired} ids={ids} seen={seen} after={hook_dicts(m)} "
            f"losses={','.join(losses)}")


def _spawn_child(model, q):
    torch.set_num_threads(1)
    q.put(evaluate(model))


def op_spawn_worker():
    import torch.multiprocessing as mp
    m = make_model()
    train(m)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_spawn_child, args=(m, q))
    p.start()
    got = q.get(timeout=120)
    p.join(120)
    return f"rc={p.exitcode} child_out={got} parent_out={evaluate(m, 9)}"


def _dist_worker(rank: int, world: int, init: str, kind: str, q) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        m = make_model()
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(m)
        else:
            from torch.distributed.fsdp import fully_shard
            model = fully_shard(m)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for i in range(STEPS):
            x = batch(2 * i + rank)
            loss = ((model(x) - x) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item().hex())
        q.put((rank, losses, _phases_seen_here()))
    finally:
        dist.destroy_process_group()


def _distributed(kind: str) -> str:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # A rendezvous file of this run's own, not a free port: a port found free and handed to the
    # ranks could be taken meanwhile by a concurrent run's ranks, which then joined this group
    # (seen once: the FSDP2 losses of two runs mixed, one run's rank raised).
    with tempfile.TemporaryDirectory(prefix="gpumon-victim-") as d:
        init = f"file://{os.path.join(d, 'rendezvous')}"
        ps = [ctx.Process(target=_dist_worker, args=(r, 2, init, kind, q)) for r in range(2)]
        for p in ps:
            p.start()
        got = sorted(q.get(timeout=180) for _ in ps)
        for p in ps:
            p.join(120)
    REPORT.setdefault("ranks", {})[kind] = [g[2] for g in got]
    return f"rc={[p.exitcode for p in ps]} " + " ".join(
        f"rank{r}={','.join(ls)}" for r, ls, _ in got)


def op_ddp():
    return _distributed("ddp")


def op_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"unavailable {e}"
    return _distributed("fsdp2")


# compile_train_step first: gpumon sees none of its steps (its hooks are compiled away) and says
# so while it has seen no step at all
OPS = {"compile_train_step": op_compile_train_step} | {
    n[3:]: f for n, f in dict(globals()).items() if n.startswith("op_")}
# ops that start processes (DDP/FSDP ranks, spawn workers, a loader without gpumon): slow
SLOW_OPS = ("save_load_elsewhere", "spawn_worker", "ddp", "fsdp2")


# ------------------------------------------------------------------ what gpumon saw
REPORT: dict = {}
TIMES: dict = {}


def _tracker():
    P = sys.modules.get("gpumon.agent.phases")
    return getattr(P, "_tracker", None) if P is not None else None


def _steps_since(tr, done: int) -> list:
    """The steps the agent reported since it had closed ``done`` (the last one closed now)."""
    with tr._lock:
        tr._maybe_close_step()
    n = tr.steps_done - done
    steps = list(tr.recent_steps)[-n:] if n > 0 else []
    return [{k: s.get(k) for k in ("forwards", "backwards", "optimizers", "phases_note")}
            | {"phases": sorted(s.get("phases", {}))} for s in steps]


def _phases_seen_here():
    """The agent's view of this process's steps (None without gpumon)."""
    tr = _tracker()
    return None if tr is None else _steps_since(tr, 0)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    from harness import start_if_asked, wait_if_asked
    start_if_asked()
    wait_if_asked()
    names = list(OPS) if argv == ["all"] else argv
    for name in names:
        tr = _tracker()
        done = tr.steps_done if tr is not None else 0
        t0 = time.perf_counter()
        print(f"{name}: {OPS[name]()}", flush=True)
        TIMES[name] = round(time.perf_counter() - t0, 3)
        tr = _tracker()
        if tr is not None:
            REPORT[name] = {"steps": _steps_since(tr, done), "note": tr.status().get("note")}
    out = os.environ.get("COMPAT_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump({"gpumon": "gpumon" in sys.modules, "ops": REPORT, "times": TIMES,
                       "ranks": REPORT.pop("ranks", {})}, f)
    return 0


if __name__ == "__main__":
    # run as the module ``victim``: torch.save and spawn pickle Net as victim.Net, which the
    # loading process and the spawned workers import from here
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import victim
    sys.exit(victim.main(sys.argv[1:]))
