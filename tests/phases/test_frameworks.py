"""The training libraries users run, under `gpumon run` as they would start them: every step
reported with its phases and optimizer, and the run's losses the same as without gpumon. Each
test skips where its library is not installed (the test extra does not install them)."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from gpumon import client

from .test_agent_integration import wait_for

STEPS = 6

HF_TRAINER = textwrap.dedent(f"""
    import sys, torch, transformers
    from transformers import Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 1000
        def __getitem__(self, i):
            ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
            return {{"input_ids": ids, "labels": ids}}

    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4,
                             max_steps={STEPS}, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, dataloader_num_workers=0, seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    print("ready", flush=True)
    sys.stdin.readline()
    trainer.train()
    print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h], flush=True)
""")

LIGHTNING = textwrap.dedent(f"""
    import sys, torch, lightning as L
    torch.manual_seed(0)

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))
            self.losses = []
        def training_step(self, batch, i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss))
            return loss
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g),
                                          torch.randn(256, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = Net()
    trainer = L.Trainer(max_steps={STEPS}, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    trainer.fit(model, loader)
    print("losses", model.losses, flush=True)
""")


def _env():
    env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_PHASES_BUDGET="0",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("GPUMON", None)
    return env


def _losses(out: bytes) -> str:
    m = re.search(rb"^losses (.*)$", out, re.M)
    assert m, out.decode(errors="replace")[-2000:]
    return m.group(1).decode()


def _plain_run(prog: str, tmp_path) -> str:
    env = dict(os.environ)
    env.pop("GPUMON", None)
    r = subprocess.run([sys.executable, "-c", prog, str(tmp_path / "plain")], input=b"go\n",
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    return _losses(r.stdout)


def _under_gpumon_run(prog: str, tmp_path) -> tuple[list[dict], str]:
    """`gpumon run -- python -c PROG`, attached before training starts; the step events and the
    losses it printed."""
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "run", "--", sys.executable, "-c", prog,
                          str(tmp_path / "run")], env=_env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = p.stdout.readline()
        assert line == b"ready\n", (line + p.communicate(timeout=60)[1]).decode()[-3000:]
        addr = wait_for(lambda: client.discover(p.pid), timeout=60, what="agent")[0]
        steps = []
        with client.AgentConnection.connect(addr, timeout=10) as conn:
            p.stdin.write(b"go\n")
            p.stdin.flush()
            while (msg := conn.recv(timeout=120)) is not None:
                if msg.get("type") == "event" and msg.get("kind") == "step":
                    steps.append(msg)
                if msg.get("type") == "event" and msg.get("kind") == "exit":
                    break
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode(errors="replace")[-3000:]
        return steps, _losses(out)
    finally:
        p.kill()
        p.wait()


def _check(steps: list[dict], optimizer: str) -> None:
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), [s["step"] for s in steps]
    for s in steps:
        assert {"forward", "backward", "optimizer"} <= set(s["phases"]), s["phases"]
        assert s["optimizers"] == [optimizer], s["optimizers"]
        assert s["time_s"] > 0


def test_hugging_face_trainer_under_gpumon_run(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # Trainer needs it
    steps, losses = _under_gpumon_run(HF_TRAINER, tmp_path)
    _check(steps, "AdamW")
    assert losses == _plain_run(HF_TRAINER, tmp_path)


def test_lightning_trainer_under_gpumon_run(tmp_path):
    pytest.importorskip("lightning")
    steps, losses = _under_gpumon_run(LIGHTNING, tmp_path)
    _check(steps, "AdamW")
    assert losses == _plain_run(LIGHTNING, tmp_path)
