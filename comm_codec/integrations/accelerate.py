"""HF Accelerate: code the gradient traffic of a model ``accelerator.prepare`` wrapped.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's
built-in hook types, so the hook is registered on the prepared model instead::

    from accelerate import Accelerator
    from comm_codec.integrations.accelerate import register

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register(accelerator, model, warmup_steps=5)
    ...                                  # accelerator.backward(loss) as usual
    state.stats()

With Accelerate's FSDP2 (``fsdp_version: 2``) the same call installs
:func:`comm_codec.fsdp.register` instead, and with its DeepSpeed plugin
(``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``, where ``prepare``
returns the DeepSpeed engine) :func:`comm_codec.deepspeed.register`: without options,
the ds_config's ``"comm_codec"`` section configures it.
"""

from __future__ import annotations

import logging

from . import register as register_state

__all__ = ["register"]

log = logging.getLogger(__name__)


def register(accelerator, model, **state_kwargs):
    """Register comm_codec on a model returned by ``accelerator.prepare``.

    Call it on every process, after ``prepare`` and before the first backward.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the prepared model (DDP, FSDP2, or the DeepSpeed engine).
        **state_kwargs: :class:`~comm_codec.comm.config.CommConfig` settings, the same
            for every framework.

    Returns:
        The state, or None when the run has a single process (nothing to compress).

    Raises:
        TypeError: several processes, but the model is neither DDP, FSDP2 nor a
            DeepSpeed engine.
    """
    import torch.distributed as dist

    # The process group is the truth: Accelerate reports 1 process for DeepSpeed on CPU.
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else accelerator.num_processes
    if processes <= 1:
        log.info("comm_codec: a single process, no gradient traffic to compress")
        return None
    return register_state(model, **state_kwargs)
