"""Recipes for the trainers people use: HF Accelerate, transformers' Trainer, PyTorch Lightning.

Each trainer wraps the model itself (in DDP, or FSDP2) where a user cannot pass a comm
hook of their own, so each recipe registers comm_codec on the wrapped model once the
trainer has made it:

* :func:`comm_codec.integrations.accelerate.register` -- after ``accelerator.prepare``;
* :class:`comm_codec.integrations.hf.CommCodecCallback` -- a ``TrainerCallback``;
* :class:`comm_codec.integrations.lightning.CommCodecCallback` -- a Lightning callback
  (Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA only).

:func:`register` is what they share: a DDP model gets :func:`comm_codec.ddp.huffman_hook`,
an FSDP2 model :func:`comm_codec.fsdp.register`, a DeepSpeed engine (Accelerate's
DeepSpeed plugin, HF Trainer's ``deepspeed=``) :func:`comm_codec.deepspeed.register`; every recipe returns that state
(``.stats()``, the same :class:`~comm_codec.comm.stats.TrafficStats` for all). The trainers are optional dependencies
(the ``hf`` and ``lightning`` extras); this package imports none of them.
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["attach", "register"]

log = logging.getLogger(__name__)


def register(model: nn.Module, **state_kwargs):
    """Code the gradient traffic of a model a trainer has wrapped for data parallelism; return the state.

    Args:
        model: a ``DistributedDataParallel`` (possibly inside ``torch.compile``'s
            wrapper), a model with FSDP2's ``fully_shard`` applied, or a DeepSpeed engine
            (what Accelerate's DeepSpeed plugin and HF Trainer's ``deepspeed=`` make).
        **state_kwargs: :class:`~comm_codec.comm.config.CommConfig` settings, the same
            for every framework (e.g. ``warmup_steps=5``); for a DeepSpeed engine, none
            reads its config's ``"comm_codec"`` section.

    Returns:
        The state (``state.stats()`` reports the traffic).

    Raises:
        TypeError: the model is neither DDP, FSDP2 nor a DeepSpeed engine (a single
            process, or a wrapper comm_codec does not know).
    """
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if _is_deepspeed_engine(model):
        from ..comm import deepspeed

        return deepspeed.register(model, **state_kwargs)
    if isinstance(model, DistributedDataParallel):
        from ..comm.ddp import HuffmanState, huffman_hook

        state = HuffmanState(process_group=model.process_group, **state_kwargs)
        model.register_comm_hook(state, huffman_hook)
        log.info("comm_codec: huffman_hook registered on the DistributedDataParallel model")
        return state
    from ..comm import fsdp

    if fsdp.FSDPModule is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        return fsdp.register(model, **state_kwargs)
    raise TypeError(
        f"comm_codec can code the traffic of a DistributedDataParallel, FSDP2 or DeepSpeed model; "
        f"got a {type(model).__name__} (is the run launched on more than one process?)"
    )


def _is_deepspeed_engine(model) -> bool:
    """Whether ``model`` is a DeepSpeed engine (without importing DeepSpeed where it is not in use)."""
    import sys

    ds_engine = sys.modules.get("deepspeed.runtime.engine")
    return ds_engine is not None and isinstance(model, ds_engine.DeepSpeedEngine)


attach = register  # the earlier name
