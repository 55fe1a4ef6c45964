"""transformers' Trainer: a callback that codes the gradient traffic and logs what it saved.

Usage::

    from transformers import Trainer
    from comm_codec.integrations.hf import CommCodecCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[CommCodecCallback(warmup_steps=5)])
    trainer.train()        # logs gain comm_codec/ratio, comm_codec/bytes_saved, ...

When training starts the Trainer has wrapped the model (DDP through Accelerate, FSDP2,
or a DeepSpeed engine with ``TrainingArguments(deepspeed=ds_config)``), and the callback
registers comm_codec on the wrapper. Callbacks are handed only the bare model, so the
callback finds the DDP or DeepSpeed engine that wraps it among the live objects
(``gc.get_objects()``, once per run). With DeepSpeed and no options, the ds_config's
``"comm_codec"`` section configures it.
Its numbers go into the logs of every logging step: into the ``logs`` dict that the
callbacks after it see and into ``state.log_history``. Reporting callbacks listed before
it (``report_to`` integrations come first) do not see them.
"""

from __future__ import annotations

import gc
import logging
import warnings

from transformers import TrainerCallback

from ..comm.stats import LOGGED
from . import register as register_state
from ._hf_load import from_pretrained, load_state_dict

__all__ = ["CommCodecCallback", "from_pretrained", "load_state_dict"]

log = logging.getLogger(__name__)


class CommCodecCallback(TrainerCallback):
    """Register comm_codec on the Trainer's wrapped model when training starts.

    Args:
        **state_kwargs: :class:`comm_codec.ddp.HuffmanState` (DDP) or
            :class:`comm_codec.fsdp.FSDPState` (FSDP2) options, e.g. ``warmup_steps=5``.

    Attributes:
        state: the state once training started (None before, and in single-process runs).
    """

    def __init__(self, **state_kwargs):
        self.state_kwargs = state_kwargs
        self.state = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.state is not None or args.world_size <= 1:
            return  # registered by an earlier train(), or nothing to compress
        self.state = register_state(_wrapped(model), **self.state_kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.state is None or logs is None:
            return
        d = self.state.stats()
        numbers = {f"comm_codec/{key}": d[key] for key in LOGGED}
        logs.update(numbers)
        if state.log_history:  # the Trainer appended a copy of logs before calling us
            state.log_history[-1].update(numbers)


def _wrapped(model):
    """The model to register on: the DDP or DeepSpeed engine wrapping ``model``, or ``model`` itself (FSDP2)."""
    import sys

    from torch.nn.parallel import DistributedDataParallel

    from ..comm import fsdp

    if fsdp.FSDPModule is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        return model
    ds_engine = sys.modules.get("deepspeed.runtime.engine")
    wrappers = (DistributedDataParallel,) + ((ds_engine.DeepSpeedEngine,) if ds_engine is not None else ())
    with warnings.catch_warnings():
        # isinstance() on every live object touches deprecated module proxies (torch's
        # ``reduce_op``), whose FutureWarning would otherwise reach the user's log.
        warnings.simplefilter("ignore", FutureWarning)
        owners = [o for o in gc.get_objects() if isinstance(o, wrappers)]  # once per run: tens of ms
    for owner in owners:
        if owner.module is model:
            return owner
    raise RuntimeError(
        "CommCodecCallback: the Trainer's model is wrapped neither in DistributedDataParallel "
        f"nor in FSDP2 nor DeepSpeed ({type(model).__name__}); launch with torchrun or accelerate launch"
    )
