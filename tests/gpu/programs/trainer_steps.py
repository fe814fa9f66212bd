"""A Hugging Face Trainer run (a tiny Llama from config, random weights, fp32 AdamW) whose own
code reads torch's peak counters at every phase boundary the Trainer offers and resets them
(issue 35): after the loss (forward), after training_step (backward), before the optimizer step
(gradient clipping), after it, at the step's end (scheduler, zero_grad) and after an evaluation.
Each line ``POINT <name> <global step> <max_memory_allocated> <memory_allocated>`` is torch's
own peak of the span since the point before. Run plainly and under ``gpumon run`` it must print
the same, and gpumon's steps must equal what the points say (tests/gpu/test_counters_gpu.py).
It never imports gpumon (``start_if_asked``: only in the gpumon.start() mode).

    python tests/gpu/programs/trainer_steps.py --device cuda [--steps 30]
    python tests/gpu/programs/trainer_steps.py --device fake   # CPU, the fake CUDA allocator
        of tests/phases/fake_cuda.py driven by the run's saved activations, gradients and
        optimizer (see counters_view.py)
"""
from __future__ import annotations

import argparse
import gc
import shutil
import tempfile

from program_env import fake_cuda, start_if_asked, wait_if_asked  # (no gpumon)

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

ap = argparse.ArgumentParser()
ap.add_argument("--device", choices=("cuda", "fake"), default="cuda")
ap.add_argument("--steps", type=int, default=30)
args = ap.parse_args()
FAKE = args.device == "fake"
SEQ, BATCH, VOCAB = (32, 4, 2048) if FAKE else (128, 16, 2048)  # a CPU trains small
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=SEQ, use_cache=False)
model = transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, base: int) -> None:
        self.n, self.base = n, base

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(self.base + i))
        return {"input_ids": ids, "labels": ids}


cuda = torch.cuda
step = [0]


def point(name: str) -> None:
    print(f"POINT {name} {step[0]} {cuda.max_memory_allocated()} {cuda.memory_allocated()}",
          flush=True)
    cuda.reset_peak_memory_stats()


# ---- the fake mode: the run's own tensors drive a fake CUDA allocator -----------------------
mem = fake_ctx = None
SCALE = 64
grads: dict = {}
opt_state: list = []
opt_tmp: list = []


class Held:
    """A saved activation's fake device bytes, freed when autograd lets go of it."""
    __slots__ = ("t", "ptr")

    def __init__(self, t) -> None:
        self.t, self.ptr = t, mem.malloc(max(1, t.nbytes) * SCALE)

    def __del__(self) -> None:
        mem.free(self.ptr)


def install_fake(optimizer) -> None:
    global mem, fake_ctx
    mem, fake_ctx = fake_cuda(torch)
    nbytes = sum(p.nbytes for p in model.parameters()) * SCALE
    mem.malloc(nbytes)  # the parameters

    def grad_made(p):
        if id(p) not in grads:
            grads[id(p)] = mem.malloc(p.nbytes * SCALE)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(grad_made)

    def pre(o, a, k):
        if not opt_state:
            opt_state.append(mem.malloc(2 * nbytes))
        opt_tmp.append(mem.malloc(nbytes))

    def post(o, a, k):
        mem.free(opt_tmp.pop())
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.register_step_pre_hook(pre)
    inner.register_step_post_hook(post)


class Points(TrainerCallback):
    def on_train_begin(self, targs, state, control, optimizer=None, **kw):
        if FAKE:
            install_fake(optimizer)
        gc.disable()  # frees happen where the code says, the same with and without gpumon
        gc.freeze()
        start_if_asked()   # gpumon.start() in that mode (CUDA is up)
        wait_if_asked()    # a test's client connects meanwhile
        cuda.reset_peak_memory_stats()

    def on_step_begin(self, targs, state, control, **kw):
        gc.collect()
        step[0] = state.global_step + 1

    def on_pre_optimizer_step(self, targs, state, control, **kw):
        point("clip")

    def on_optimizer_step(self, targs, state, control, **kw):
        point("optimizer")

    def on_step_end(self, targs, state, control, **kw):
        if FAKE:
            for p in grads.values():  # zero_grad(set_to_none=True) ran before this
                mem.free(p)
            grads.clear()
        point("other")

    def on_evaluate(self, targs, state, control, **kw):
        point("eval")


class PointsTrainer(Trainer):
    def compute_loss(self, model, inputs, *a, **kw):
        out = super().compute_loss(model, inputs, *a, **kw)
        if model.training:
            point("forward")
        return out

    def training_step(self, *a, **kw):
        out = super().training_step(*a, **kw)
        point("backward")
        return out


out_dir = tempfile.mkdtemp(prefix="trainer-steps-")
targs = TrainingArguments(
    output_dir=out_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=8,
    max_steps=args.steps, learning_rate=1e-4, logging_strategy="no", save_strategy="no",
    eval_strategy="steps", eval_steps=10, prediction_loss_only=True, report_to=[],
    use_cpu=FAKE, dataloader_num_workers=0, dataloader_pin_memory=False, seed=0,
    disable_tqdm=True)
trainer = PointsTrainer(model=model, args=targs, train_dataset=Tokens(10_000, 0),
                        eval_dataset=Tokens(16, 1_000_000), callbacks=[Points()])
trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its lines carry times
if FAKE:
    with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
        trainer.train()
else:
    trainer.train()
gc.enable()
# one more forward closes the last step for gpumon (its step ends at the next hook)
model.eval()
with torch.no_grad():
    model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=model.device))
shutil.rmtree(out_dir, ignore_errors=True)
print("DONE", flush=True)
wait_if_asked(".end")  # the test reads gpumon's steps before the program ends
if FAKE:
    fake_ctx.__exit__(None, None, None)  # torch's readers as they were, before shutdown
gc.unfreeze()  # what gc.freeze() kept is freed at exit again: torch 2.15's triton 3.9 (nanobind)
#                 otherwise reports its objects leaked on stderr, a different text each run
