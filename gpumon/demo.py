"""The workload behind `gpumon demo`: a small transformer trained with AdamW, under the agent.

With CUDA it trains on the GPU for real and the agent reads the real allocator. Without CUDA it
trains on the CPU while the simulated source (a scripted GPU training step) feeds the agent, so
the same socket and UI have something true-to-life to show; the hello's ``source`` and ``demo``
fields say which. Without torch at all, only the simulated source runs.

Run directly: ``python -m gpumon.demo [--steps N] [--cpu]`` (runs until killed by default).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _model(torch, vocab: int, d: int, layers: int, heads: int):
    nn = torch.nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, x):
            return self.head(self.norm(self.blocks(self.embed(x))))

    return TinyLM()


BUILD_S = 3.0  # the demo "builds its model" this long before its first CUDA call


def train(steps: int | None = None, force_cpu: bool = False, rate_hz: float | None = None,
          build_s: float = BUILD_S) -> int:
    """The agent starts first and waits, as under `gpumon run`, while the model is built
    (build_s seconds at least, like a from_pretrained on the CPU); the first CUDA call (or,
    without CUDA, the end of the build for the simulated source) makes it serve."""
    import gpumon
    import threading
    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch is not None and not force_cpu and torch.cuda.is_available()
    built = threading.Event()  # the simulated source's stand-in for the first CUDA call
    t0 = time.monotonic()
    if torch is None:
        agent = gpumon.start(rate_hz=rate_hz, source=_simulated(built))
        if agent is not None:
            agent.hello_extra["demo"] = ("torch is not installed: nothing trains, every figure "
                                         "is scripted (pip install torch for a real model)")
        time.sleep(build_s)
        built.set()
        n = 0
        while steps is None or n < steps:
            time.sleep(0.1)
            n += 1
        return 0
    if cuda:
        agent = gpumon.start(rate_hz=rate_hz, source="torch")
        desc = f"training on {torch.cuda.get_device_name(0)} (real CUDA memory)"
        dev = torch.device("cuda", 0)
        vocab, d, layers, heads, batch, seq = 32000, 1024, 8, 16, 16, 512
    else:
        agent = gpumon.start(rate_hz=rate_hz, source=_simulated(built))
        desc = "training on the CPU; GPU memory simulated (no CUDA here)"
        dev = torch.device("cpu")
        torch.set_num_threads(1)  # a demo should not take the machine
        vocab, d, layers, heads, batch, seq = 2000, 128, 2, 4, 8, 64
    if agent is not None:
        agent.hello_extra["demo"] = desc
    torch.manual_seed(0)
    model = _model(torch, vocab, d, layers, heads)  # on the CPU, as from_pretrained does
    time.sleep(max(0.0, build_s - (time.monotonic() - t0)))
    model = model.to(dev)  # with CUDA: the first CUDA call
    built.set()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    n = 0
    while steps is None or n < steps:
        x = torch.randint(0, vocab, (batch, seq), device=dev)
        y = torch.roll(x, -1, dims=1)
        logits = model(x)
        loss = loss_fn(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        n += 1
        if not cuda:
            time.sleep(0.05)  # leave the CPU to the UI; the simulated GPU keeps its own pace
    if cuda:
        torch.cuda.synchronize()
    return 0


def _simulated(built):
    """The scripted GPU, with the phase tracker's events scripted from the same script (steps
    with exact peaks, the breakdown by role, the model output's size), so every part of the
    screen has figures without CUDA. The program's own tracker is turned off: it would count
    the CPU model's steps, which are not the simulated GPU's."""
    from gpumon.agent.sources import MiB, SimulatedSource
    os.environ["GPUMON_PHASES"] = "0"  # read by the agent as it starts, just after this
    # activations well over half the peak and large logits: the advice has something to say
    return SimulatedSource(ready=built.is_set, params=500 * MiB, activations=2600 * MiB,
                           events=True, output_bytes=600 * MiB)


def _exit_with_parent(parent: int) -> None:
    """`gpumon demo` starts this workload in a session of its own (so Ctrl-C reaches the UI
    only); a SIGHUP or SIGKILL of the UI would leave it training forever. A daemon thread ends
    it once its parent is gone."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="gpumon-demo-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumon.demo")
    p.add_argument("--steps", type=int, default=None, help="stop after N steps (default: never)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if CUDA is there")
    p.add_argument("--rate", type=float, default=None, help="agent sample rate (Hz)")
    p.add_argument("--build", type=float, default=BUILD_S, metavar="S",
                   help=f"seconds the model takes to build before training (default {BUILD_S:g})")
    p.add_argument("--parent", type=int, default=None, metavar="PID",
                   help="exit when PID is no longer this process's parent (gpumon demo passes "
                        "its own: a closed terminal must not leave the workload running)")
    a = p.parse_args(argv)
    if a.parent:
        _exit_with_parent(a.parent)
    try:
        return train(a.steps, a.cpu, a.rate, a.build)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
