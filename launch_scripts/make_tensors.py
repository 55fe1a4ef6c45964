"""Train TinyLM briefly and dump real training tensors for codec tests and benchmarks.

Every ``--dump-every`` steps this writes ``OUT/step_{k:04d}.safetensors`` holding,
as they stand between ``backward()`` and ``optimizer.step()`` of step ``k``:

* ``grad/<param>``        -- this step's gradients;
* ``weight/<param>``      -- the weights those gradients will update;
* ``exp_avg/<param>``, ``exp_avg_sq/<param>`` -- AdamW moments (absent at step 0,
  before the optimizer has run);
* ``act/blocks.<i>.attn``, ``act/blocks.<i>.mlp`` -- sub-module outputs of this
  step's forward pass, shape ``[batch, seq_len, d_model]``.

``OUT/meta.json`` records the arguments, versions, parameter count, per-step losses
and file list. Output is byte-for-byte reproducible for a fixed Python, torch,
CPU type and ``--threads``.

Usage::

    python launch_scripts/make_tensors.py --out /tmp/tensors_fp32
    python launch_scripts/make_tensors.py --out /tmp/tensors_bf16 --dtype bf16 --steps 20
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

try:
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps
except ImportError:
    # Run from a checkout without installing: ``python launch_scripts/...``
    # puts launch_scripts/, not the repo root, on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps

_log = logging.getLogger("make_tensors")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Sub-modules whose outputs are dumped as activations.
_ACT_MODULE = re.compile(r"blocks\.\d+\.(attn|mlp)")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="model dtype (default: fp32)")
    parser.add_argument("--dump-every", type=int, default=5, help="dump at steps 0, N, 2N, ... (default: 5)")
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000, help="corpus size in bytes (default: 4000000)")
    # Pinned rather than left to torch's default (one per core) because CPU
    # reductions split work per thread, so the thread count changes the bits.
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch intra-op threads; part of the reproducibility key (default: 2)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "dump_every", "corpus_bytes", "threads"):
        minimum = 0 if name == "steps" else 1
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(args, name)}")
    return args


def _capture_activations(model: torch.nn.Module, store: dict[str, torch.Tensor]) -> None:
    """Register forward hooks that keep each attention/MLP output in ``store``."""

    def make_hook(name: str):
        def hook(module, inputs, output):
            # A detached reference costs nothing (autograd keeps the tensor
            # alive for backward anyway); it is cloned only on dump steps.
            store[name] = output.detach()

        return hook

    for name, module in model.named_modules():
        if _ACT_MODULE.fullmatch(name):
            module.register_forward_hook(make_hook(name))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = _parse_args(argv)
    dtype = _DTYPES[args.dtype]
    started = time.perf_counter()

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    corpus = load_corpus(args.corpus_bytes)
    model = TinyLM().to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(corpus, args.batch, model.seq_len, seed=args.seed)
    _log.info(
        "TinyLM: %d params, dtype %s, corpus %d bytes, %d steps x batch %d, %d threads",
        n_params,
        args.dtype,
        len(corpus),
        args.steps,
        args.batch,
        args.threads,
    )

    activations: dict[str, torch.Tensor] = {}
    _capture_activations(model, activations)
    param_names = {p: name for name, p in model.named_parameters()}
    args.out.mkdir(parents=True, exist_ok=True)
    files: list[str] = []

    def on_step(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: float) -> None:
        _log.info("step %4d  loss %.4f", step, loss)
        if step % args.dump_every:
            return
        tensors: dict[str, torch.Tensor] = {}
        for p, name in param_names.items():
            tensors[f"grad/{name}"] = p.grad.detach().clone()
            tensors[f"weight/{name}"] = p.detach().clone()
            state = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    tensors[f"{key}/{name}"] = state[key].detach().clone()
        for name, act in activations.items():
            tensors[f"act/{name}"] = act.to(dtype).contiguous().clone()
        filename = f"step_{step:04d}.safetensors"
        save_file(tensors, str(args.out / filename), metadata={"step": str(step)})
        files.append(filename)
        _log.info("wrote %s (%d tensors)", filename, len(tensors))

    losses = train_steps(model, optimizer, data, args.steps, on_step=on_step)

    # No timestamps or timings here: meta.json must be reproducible too.
    meta = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "param_count": n_params,
        "corpus_bytes": len(corpus),
        "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
        "losses": losses,
        "files": files,
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _log.info(
        "done: %d files in %s, final loss %.4f, %.1f s",
        len(files),
        args.out,
        losses[-1] if losses else float("nan"),
        time.perf_counter() - started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
