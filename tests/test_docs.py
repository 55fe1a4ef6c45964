"""Every ```python snippet of README.md and docs/*.md runs, as a user would run it.

A snippet runs as a script in a fresh interpreter, in a scratch directory. The line above
its fence may say how: ``<!-- test: ranks=2 prelude=ddp -->`` runs it under torchrun with 2
gloo ranks on 127.0.0.1, after the named prelude (below) has made what the snippet's text
takes as given (a model, a loader, a DeepSpeed config file). ``<!-- test: skip REASON -->``
leaves a fragment out; a snippet with no comment runs alone in one process. docs/_incoming/
(text other branches drop for the maintainers) is not part of the site and is not run.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.cli

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python\s*$")
DIRECTIVE = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->\s*$")

# What each prelude makes: the names a snippet's prose takes as given.
_TRAIN = """
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
loss_fn = F.mse_loss


def _batches(rank, n=8):
    g = torch.Generator().manual_seed(1 + rank)
    return [(torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]
"""

PRELUDES = {
    "ddp": _TRAIN
    + """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
ddp_model = DDP(model)
optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
loader = _batches(dist.get_rank())
""",
    "fsdp": _TRAIN
    + """
import torch.distributed as dist

dist.init_process_group("gloo")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


model = Net()
loader = _batches(dist.get_rank())
""",
    "deepspeed": _TRAIN
    + """
import json

import deepspeed
import torch.distributed as dist

deepspeed.init_distributed(dist_backend="gloo")
with open("ds_config.json", "w") as f:
    json.dump({"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10000,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_force_ds_cpu_optimizer": False, "zero_optimization": {"stage": 2},
               "comm_codec": {"enabled": True, "warmup_steps": 2}}, f)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
loader = _batches(dist.get_rank())
""",
    "collectives": """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
""",
    "accelerate": _TRAIN
    + """
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randn(256, 8)),
                                     batch_size=16)
""",
    "hf": _TRAIN
    + """
import tempfile

from transformers import TrainingArguments


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


model = Regressor()
data = [{"x": torch.randn(64), "labels": torch.randn(8)} for _ in range(256)]
training_args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, max_steps=6,
                                  report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                  ddp_backend="gloo", logging_steps=1)
""",
    "lightning": _TRAIN
    + """
import lightning as L


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


module = Module()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 64), torch.randn(256, 8)),
                                     batch_size=16)
""",
    "state_dict": """
import tempfile
import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 8)).to(torch.bfloat16)
state_dict = model.state_dict()
path = tempfile.mkdtemp()
""",
    "files": """
import torch
from safetensors.torch import save_file

torch.manual_seed(0)
save_file({"w": torch.randn(512, 512, dtype=torch.bfloat16) * 0.02, "b": torch.zeros(512)}, "model.safetensors")
""",
    "series": """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(60, 80):
    opt.zero_grad()
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()
    if step % 10 == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"step{step:05d}.pt")
""",
    "profile": """
import torch
grads = [torch.randn(1 << 16, dtype=torch.bfloat16) * 1e-3 for _ in range(4)]
""",
}


def _markdown_files() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_incoming" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


def _snippets() -> list:
    """Every python fence with its directive, as pytest params named FILE:LINE."""
    params = []
    for path in _markdown_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not FENCE.match(line):
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            code = "\n".join(lines[i + 1 : end]) + "\n"
            above = lines[i - 1] if i else ""
            match = DIRECTIVE.match(above)
            options = dict(kv.split("=", 1) for kv in match.group(1).split() if "=" in kv) if match else {}
            skip = bool(match) and match.group(1).startswith("skip")
            ranks = int(options.get("ranks", 1))
            prelude = options.get("prelude")
            marks = [pytest.mark.dist] if ranks > 1 else []
            if not (path.name == "README.md" and ranks == 1 and prelude is None):
                marks.append(pytest.mark.slow)  # the quick tier runs the README's codec snippet
            if skip:
                marks.append(pytest.mark.skip(reason=match.group(1)))
            params.append(pytest.param(code, ranks, prelude, id=f"{path.relative_to(ROOT)}:{i + 1}", marks=marks))
    return params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_python_fence_is_found_with_a_known_prelude():
    snippets = _snippets()
    assert len(snippets) >= 10
    for p in snippets:
        _, _, prelude = p.values
        assert prelude is None or prelude in PRELUDES, f"{p.id}: unknown prelude {prelude!r}"


@pytest.fixture(scope="session")
def torch_extensions():
    """DeepSpeed's CPU comm op, built once before any rank needs it, in the directory the
    DeepSpeed tests share (test_deepspeed.torch_extensions_env: stale locks are cleared)."""
    from test_deepspeed import torch_extensions_env

    with torch_extensions_env() as env:
        yield env["TORCH_EXTENSIONS_DIR"]


@pytest.mark.parametrize("code,ranks,prelude", _snippets())
def test_snippet_runs(code, ranks, prelude, tmp_path, request):
    script = tmp_path / "snippet.py"
    source = textwrap.dedent(PRELUDES.get(prelude, "")) + "\n" + code
    script.write_text(source, encoding="utf-8")
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(ROOT),
        TOKENIZERS_PARALLELISM="false",
    )
    if "deepspeed" in source:  # built here once, not by each snippet's ranks racing for it
        env["TORCH_EXTENSIONS_DIR"] = request.getfixturevalue("torch_extensions")
    if ranks == 1:
        argv = [sys.executable, str(script)]
    else:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(script),
        ]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
