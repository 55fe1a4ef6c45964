"""PyTorch Lightning: code DDP's gradient traffic, on CPU (gloo) and GPU alike.

Lightning's own recipe is ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=huffman_hook)``,
but Lightning 2.x registers comm hooks **only when the root device is CUDA**
(``DDPStrategy._register_ddp_hooks``): on CPU processes with gloo the hook is silently
not used. This callback registers the hook itself, on any device, once the strategy has
wrapped the model::

    import lightning as L
    from comm_codec.integrations.lightning import CommCodecCallback

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[CommCodecCallback(warmup_steps=5)])
    trainer.fit(module, loader)     # logs comm_codec/ratio and comm_codec/bytes_saved per step

(On CUDA either works; do not use both: DDP takes one comm hook.)
"""

from __future__ import annotations

import logging

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone pytorch_lightning package
    from pytorch_lightning import Callback

from ..comm.stats import LOGGED
from . import register as register_state

__all__ = ["CommCodecCallback"]

log = logging.getLogger(__name__)


class CommCodecCallback(Callback):
    """Register :func:`comm_codec.ddp.huffman_hook` on the strategy's DDP model at fit start.

    Args:
        log_stats: log the traffic fields every integration logs (``comm_codec/ratio``,
            ``comm_codec/bytes_saved``, ...: :data:`comm_codec.comm.stats.LOGGED`) every step.
        **state_kwargs: :class:`comm_codec.ddp.HuffmanState` options (FSDP2 models:
            :class:`comm_codec.fsdp.FSDPState` options), e.g. ``warmup_steps=5``.

    Attributes:
        state: the state once fitting started (None in single-process runs).
    """

    def __init__(self, log_stats: bool = True, **state_kwargs):
        self.log_stats = log_stats
        self.state_kwargs = state_kwargs
        self.state = None

    def on_fit_start(self, trainer, pl_module):
        if self.state is not None or trainer.world_size <= 1:
            return
        try:
            self.state = register_state(trainer.strategy.model, **self.state_kwargs)
        except RuntimeError as exc:
            if "once" in str(exc):  # DDP keeps one comm hook
                raise RuntimeError(
                    "CommCodecCallback: the DDP model has a comm hook already (DDPStrategy("
                    "ddp_comm_hook=...) on CUDA?); use one of the two"
                ) from exc
            raise

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.state is not None and self.log_stats:
            d = self.state.stats()
            pl_module.log_dict({f"comm_codec/{key}": float(d[key]) for key in LOGGED}, on_step=True, on_epoch=False)
