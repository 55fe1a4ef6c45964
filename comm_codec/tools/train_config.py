"""The demos' training settings: :class:`TrainConfig` and the options that fill it.

Shared by ``comm-codec demo`` (:mod:`comm_codec.tools.demo_cli`), the training loops
(:func:`comm_codec.tools.demo.train`, :func:`comm_codec.tools.fsdp_demo.train_fsdp`) and the
torchrun scripts ``launch_scripts/train_ddp.py`` and ``train_fsdp.py``. It imports neither
torch nor numba, so that building the command line's parser stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses

__all__ = ["DTYPES", "LEARNING_RATE", "TrainConfig", "add_training_arguments"]

DTYPES = ("bf16", "fp32")
# AdamW at 3e-3 brings TinyLM from ln(256) = 5.55 to about 2.8 nats in 40 steps, so the
# demo shows a model learning, not a flat line.
LEARNING_RATE = 3e-3


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What the demos train, and how their gradients travel.

    Args:
        steps: optimizer steps.
        warmup_steps: steps all-reduced plainly while the books are profiled; ignored
            (0) when ``codebooks`` is given.
        dtype: "bf16" or "fp32": the model's (and so the gradients') dtype.
        batch: sequences of 128 bytes per rank and step.
        cast: None or "bf16": cast fp32 gradients to bf16 before coding (lossy).
        seed: seed of the weights and of the data order.
        codebooks: path of a saved :class:`~comm_codec.CodebookSet` to code with from
            the first step, instead of books built online.
        save_codebooks: path where rank 0 saves the books the run used.
        threads: torch and numba threads per process.
        mode: the hook's mode: "always" (the demo: show the bytes saved), "auto" or
            "never" (see :class:`~comm_codec.ddp.HuffmanState`).
    """

    steps: int = 40
    warmup_steps: int = 5
    dtype: str = "bf16"
    batch: int = 8
    cast: str | None = None
    seed: int = 0
    codebooks: str | None = None
    save_codebooks: str | None = None
    threads: int = 1
    mode: str = "always"

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.codebooks is None and not 0 < self.warmup_steps < self.steps:
            raise ValueError(
                f"--warmup-steps must be in 1..{self.steps - 1} (below --steps {self.steps}) so that "
                f"books are built and then used; got {self.warmup_steps}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.cast not in (None, "bf16"):
            raise ValueError(f"--cast must be none or bf16, got {self.cast!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.mode not in ("always", "auto", "never"):
            raise ValueError(f"--mode must be one of always, auto, never, got {self.mode!r}")

    @property
    def torch_dtype(self):
        """The model's torch dtype (``dtype`` as a ``torch.dtype``)."""
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> TrainConfig:
        """Build a config from the options :func:`add_training_arguments` defines."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in fields}
        values["cast"] = None if values.get("cast") in (None, "none") else values["cast"]
        values.update(overrides)
        return cls(**values)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options the demos and ``launch_scripts/train_ddp.py`` / ``train_fsdp.py`` share."""
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    parser.add_argument(
        "--warmup-steps", type=int, default=5, help="plain all-reduce steps that profile the books (default: 5)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bf16", help="model and gradient dtype (default: bf16)"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step (default: 8)")
    parser.add_argument(
        "--cast",
        choices=("none", "bf16"),
        default="none",
        help="bf16: cast fp32 gradients to bf16 before coding (lossy; no effect on --dtype bf16) (default: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: 0)")
