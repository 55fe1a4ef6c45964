"""A tiny byte-level transformer and text corpus for demos, benchmarks and profiling.

The codec needs realistic tensors -- gradients, weights, optimizer moments and
activations from an actual training run -- without a GPU, a download or a large
model. This module supplies the three ingredients, all deterministic:

* :func:`load_corpus` reads the Python standard library's own ``.py`` sources,
  so every machine with the same Python gets byte-identical text;
* :class:`TinyLM` is a ~0.5 M parameter GPT-style model that trains a step in
  well under a second on two CPU cores;
* :func:`batches` and :func:`train_steps` drive a training loop whose callback
  runs between ``backward()`` and ``optimizer.step()``, where gradients are
  readable.

Example::

    >>> import torch
    >>> from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM()
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> data = batches(load_corpus(), batch_size=8, seq_len=model.seq_len)
    >>> losses = train_steps(model, opt, data, steps=3)
    >>> len(losses)
    3
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["load_corpus", "TinyLM", "batches", "train_steps"]

_log = logging.getLogger(__name__)

# Directory names pruned from the stdlib walk: third-party code varies between
# machines, and test suites are large, repetitive and sometimes absent in slim
# Python builds -- either would break byte-identical corpora.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})

# Standard deviation of the GPT-2 weight initialisation (Radford et al., 2019).
_INIT_STD = 0.02


# ---------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------


def _stdlib_sources(root: Path) -> list[Path]:
    """Return the stdlib ``.py`` files under ``root``, sorted by relative POSIX path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend into excluded trees.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                found.append(Path(dirpath, name))
    # Sort on the relative POSIX path, not the absolute one, so the order does
    # not depend on where Python is installed or on os.walk's listing order.
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return found


def load_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Concatenate the Python standard library's ``.py`` sources into one byte string.

    Files are read in sorted relative-path order from
    ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``,
    ``test``/``tests``, ``idlelib`` and ``lib2to3`` directories, so the result
    is byte-identical on every machine running the same Python version.

    Args:
        max_bytes: Upper bound on the corpus length; the concatenation is cut
            at exactly this many bytes once enough source has been read.

    Returns:
        The corpus, at most ``max_bytes`` long.

    Raises:
        ValueError: If ``max_bytes`` is not a positive integer.
        RuntimeError: If no standard-library source files can be found (for
            example, a Python build that ships only ``.pyc`` files).
    """
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_sources(root) if root.is_dir() else []
    if not files:
        raise RuntimeError(
            f"no Python standard-library .py sources found under {str(root)!r}; "
            "load_corpus needs a Python installation that ships its sources "
            "(some slim or frozen builds include only .pyc files)"
        )

    parts = []
    total = 0
    for path in files:
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    _log.debug("loaded %d corpus bytes from %d files under %s", len(corpus), len(parts), root)
    return corpus


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [b, t, c] -> [b, heads, t, head_dim]
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU -> Linear, 4x wide."""

    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class _Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = _MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A small GPT-style byte-level language model.

    Token and learned position embeddings feed ``n_layers`` pre-norm blocks
    (causal self-attention, 4x GELU MLP), a final LayerNorm and an untied
    output head. Weights use the GPT-2 initialisation (normal, std 0.02; zero
    biases), so two models built after the same ``torch.manual_seed`` are
    identical.

    Submodules are named ``blocks.<i>.attn`` and ``blocks.<i>.mlp``, which is
    where callers attach forward hooks to capture activations.

    Args:
        vocab: Vocabulary size; 256 covers every byte value.
        d_model: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block; must divide ``d_model``.
        seq_len: Longest sequence the position embedding covers.
        dropout: Dropout probability for attention and MLP outputs.

    Raises:
        ValueError: If a size is not positive, ``n_heads`` does not divide
            ``d_model``, or ``dropout`` is outside ``[0, 1)``.
    """

    def __init__(
        self,
        vocab: int = 256,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab", vocab),
            ("d_model", d_model),
            ("n_layers", n_layers),
            ("n_heads", n_heads),
            ("seq_len", seq_len),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model} so every head has the same width")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")

        self.vocab = vocab
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Explicit init rather than PyTorch's per-layer defaults: keeps the
        # weight distribution independent of torch version defaults.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Compute next-byte logits.

        Args:
            idx: Integer tensor of byte ids, shape ``[batch, time]`` with
                ``time <= seq_len``.

        Returns:
            Logits of shape ``[batch, time, vocab]`` in the model's dtype.

        Raises:
            ValueError: If ``idx`` is not 2-D or is longer than ``seq_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape [batch, time], got {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(
                f"sequence length {t} exceeds the model's seq_len={self.seq_len}; "
                "build TinyLM with a larger seq_len or feed shorter sequences"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean next-byte cross-entropy of ``idx`` against ``targets``.

        Args:
            idx: Input byte ids, shape ``[batch, time]``.
            targets: Target byte ids, same shape as ``idx``.

        Returns:
            A float32 scalar loss.
        """
        logits = self(idx)
        # Reduce in float32 even for a bf16 model: a bf16 mean over ~1000
        # terms loses digits the logged loss curve should keep.
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------
# Data and training loop
# ---------------------------------------------------------------------------


def batches(
    corpus: bytes,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield an endless stream of ``(inputs, targets)`` byte windows from ``corpus``.

    Each epoch the corpus is cut into non-overlapping windows of
    ``seq_len + 1`` bytes, starting at a random shift, and the windows are
    shuffled. As in ``torch.utils.data.DistributedSampler``, every rank draws
    the same shift and permutation from a generator seeded with ``seed`` and
    keeps every ``world_size``-th window starting at ``rank``, so within an
    epoch ranks see disjoint bytes by construction and no communication is
    needed. An incomplete final batch of each epoch is dropped.

    Args:
        corpus: Training text, e.g. from :func:`load_corpus`.
        batch_size: Windows per batch on this rank.
        seq_len: Length of each input (and target) sequence.
        seed: Seed for the shared shuffling generator; the stream is a pure
            function of ``(corpus, batch_size, seq_len, seed, rank, world_size)``.
        rank: This process's index in ``[0, world_size)``.
        world_size: Number of ranks sharing the corpus.

    Returns:
        An iterator of ``(x, y)`` int64 tensors of shape ``[batch_size, seq_len]``,
        where ``y`` is ``x`` shifted left by one byte.

    Raises:
        ValueError: If a size is not positive, ``rank`` is out of range, or
            the corpus is too short for one batch per rank.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
    span = seq_len + 1
    # Windows that fit for every possible shift in [0, span).
    n_windows = (len(corpus) - (span - 1)) // span
    per_rank = n_windows // world_size if n_windows > 0 else 0
    if per_rank < batch_size:
        raise ValueError(
            f"corpus of {len(corpus)} bytes holds {max(n_windows, 0)} windows of {span} bytes, "
            f"fewer than batch_size={batch_size} x world_size={world_size}; "
            "use a larger corpus or smaller batches"
        )
    # Validation above runs eagerly; the generator below starts on first next().
    return _batch_stream(corpus, batch_size, span, n_windows, seed, rank, world_size)


def _batch_stream(
    corpus: bytes, batch_size: int, span: int, n_windows: int, seed: int, rank: int, world_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    within = torch.arange(span)
    # Truncate to a multiple of world_size so every rank gets the same count.
    usable = n_windows - n_windows % world_size
    while True:
        shift = int(torch.randint(span, (1,), generator=gen))
        order = torch.randperm(n_windows, generator=gen)[:usable]
        mine = order[rank::world_size]
        for start in range(0, len(mine) - batch_size + 1, batch_size):
            offsets = shift + mine[start : start + batch_size] * span
            chunk = data[offsets[:, None] + within].long()
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    on_step: Callable[[int, nn.Module, torch.optim.Optimizer, float], None] | None = None,
) -> list[float]:
    """Run ``steps`` optimisation steps, calling ``on_step`` while gradients are live.

    Each step does ``zero_grad``, ``model.loss(x, y)``, ``backward``, then
    ``on_step(step, model, optimizer, loss_value)``, then ``optimizer.step()``.
    The callback therefore sees this step's gradients next to the weights and
    optimizer state they will be applied to.

    Args:
        model: A module with a ``loss(x, y)`` method, such as :class:`TinyLM`.
        optimizer: Optimizer over ``model``'s parameters.
        data_iter: Iterator of ``(x, y)`` batches, e.g. from :func:`batches`.
        steps: Number of steps to run; zero runs none.
        on_step: Optional callback, given the 0-based step index.

    Returns:
        The loss of each step, as Python floats.

    Raises:
        ValueError: If ``steps`` is negative.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps!r}")
    model.train()
    losses = []
    for step in range(steps):
        x, y = next(data_iter)
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        value = loss.item()
        if not math.isfinite(value):
            _log.warning("step %d: non-finite loss %r", step, value)
        if on_step is not None:
            on_step(step, model, optimizer, value)
        optimizer.step()
        losses.append(value)
    return losses
