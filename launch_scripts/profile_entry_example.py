"""An ``--entry`` for ``comm-codec profile``: TinyLM trained on stdlib text.

Run from the repository root (the entry module is found on the current directory)::

    comm-codec profile --entry launch_scripts.profile_entry_example:train --steps 6 --holdout 6
    torchrun --standalone --nproc-per-node 2 launch_scripts/profile_codebooks.py \
        --entry launch_scripts.profile_entry_example:train --steps 6 --holdout 6

The contract: ``train(prof, steps)`` runs ``steps`` steps, hands each step's tensors to
``prof`` and calls ``prof.step()`` after each.
"""

import torch
import torch.distributed as dist

from comm_codec.tools.tinylm import TinyLM, batches, load_corpus


def train(prof, steps: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Train TinyLM for ``steps`` steps, observing gradients, weights, Adam state, activations."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = TinyLM().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof.attach_activations([m for n, m in model.named_modules() if n.endswith((".attn", ".mlp"))])
    data = batches(load_corpus(1_000_000), 8, 128, seed=0, rank=rank, world_size=world)
    for _ in range(steps):
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        prof.observe_gradients(model)
        prof.observe_parameters(model)
        prof.observe_optimizer(opt)
        opt.step()
        prof.step()
