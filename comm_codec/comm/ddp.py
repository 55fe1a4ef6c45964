"""DDP communication hook: gradients cross the wire Huffman-coded with fixed codebooks.

Usage, like PyTorch's own hooks::

    from comm_codec.ddp import HuffmanState, huffman_hook
    state = HuffmanState(process_group=None, warmup_steps=5)
    ddp_model.register_comm_hook(state, huffman_hook)
    ...
    state.stats()   # {"bytes_in": ..., "bytes_out": ..., "ratio": ..., "decision": ..., ...}

During the first ``warmup_steps`` backward passes the hook all-reduces plainly (bit for
bit DDP's built-in all-reduce: scale by ``1 / world_size``, then sum) while a
:class:`~comm_codec.books.profiler.WarmupProfiler` observes the gradient buckets and their
averages. Then every rank builds the books from the statistics summed over all ranks —
identical by construction, and checked by digest — and the hook can code: the two-phase
compressed all-reduce of :mod:`comm_codec.collectives`, whose result is the rank-order
sum of the raw gradients divided by the world size, bit-identical on every rank. With
``warmup_steps=0`` the hook codes from the first step with the given books (or the
shipped defaults).

Whether it codes is ``mode``'s business: ``"always"`` codes every step after warmup,
``"never"`` is DDP's default hook, and ``"auto"`` (the default) lets a
:class:`~comm_codec.comm.autoswitch.AutoSwitch` time plain and coded steps on this run and
code only where that is faster, agreed across ranks and re-checked every
``recheck_every`` steps. A plain step gives the bits of DDP's built-in all-reduce (no
hook registered) at its cost: DDP scales gradients while copying them into a bucket only
when no hook is registered, so the hook must scale them itself, and with two gloo ranks
and bf16 buckets it folds that scaling into the sum instead of a pass of its own
(:mod:`comm_codec.comm._premul`). A coded bucket, and a plain one summed that way, runs
on one worker thread per state, in bucket order, so it overlaps with the rest of the
backward pass as DDP's own all-reduce does (the numba kernels and gloo release the
GIL); other plain buckets go to the backend's all-reduce from the calling thread.

Books, warmup, the decision, the worker, statistics and every cross-rank check are the
:class:`~comm_codec.comm.engine.CodingEngine`'s, which :class:`HuffmanState` is; this
module is the seam: the hook that DDP calls per bucket.
"""

# No "from __future__ import annotations": DDP's register_comm_hook compares the hook's
# annotations with its own types, so they must be real objects.
import torch
import torch.distributed as dist

from . import collectives
from ._premul import fused_pair, pair_all_reduce, scale_like_ddp
from .engine import CodingEngine

__all__ = ["HuffmanState", "huffman_hook"]


class HuffmanState(CodingEngine):
    """State of :func:`huffman_hook`: the coding engine configured for DDP's all-reduce.

    Args:
        process_group: the group to all-reduce over (None: the default group).
        codebooks: a :class:`CodebookSet`, a path to a saved one, or None: the shipped
            defaults, or books built online when ``warmup_steps`` > 0.
        warmup_steps: backward passes to profile (plain all-reduce) before building books
            and compressing; 0 compresses from the start. Requires ``codebooks=None``.
        config: a :class:`~comm_codec.comm.config.CommConfig` holding every setting
            (keywords given beside it replace its fields).
        writer: optional TensorBoard ``SummaryWriter`` (scalars under comm_codec/).
        **options: the other :class:`~comm_codec.comm.config.CommConfig` settings, the
            same for every adapter: ``mode`` ("auto", "always", "never"), ``cast`` (None
            or "bf16": fp32 buckets rounded to bf16, **lossy**), ``min_bytes``,
            ``threads``, ``log_every``, ``drift_every``, ``refresh_threshold``,
            ``refresh_steps``, ``recheck_every``, ``probe_steps``, ``hysteresis``.

    Raises:
        ConfigError: a bad setting; the message names the key, the value and what is allowed.
        CodebookError: ``codebooks`` names a missing or malformed file.
        TypeError: codebooks of the wrong type, or an unknown option.

    The hook raises :class:`~comm_codec.AgreementError` (on every rank alike) when the
    ranks' settings or books differ, or they disagree at auto's decision.
    """

    __slots__ = ()

    def __init__(
        self, process_group=None, codebooks=None, warmup_steps: int = 0, *, config=None, writer=None, **options
    ):
        if codebooks is not None:
            options["codebooks"] = codebooks
        if warmup_steps or config is None:
            options["warmup_steps"] = warmup_steps
        super().__init__(process_group, config, writer=writer, name="HuffmanState", **options)
        if dist.is_available() and dist.is_initialized():
            self.group()  # creating a group is collective: here, where every rank builds its state


def _plain_all_reduce(state: HuffmanState, tensor: torch.Tensor) -> torch.futures.Future:
    """DDP's built-in all-reduce, bit for bit: scale by 1 / W as its reducer does, then sum.

    With two gloo ranks and a bf16 bucket the scaling is folded into the sum, on the
    engine's worker and its twin group; otherwise the backend's all-reduce runs from the
    calling thread. The future holds the bucket (or a list holding it).
    """
    group = state.process_group
    # While the profiler observes (warmup), buckets stay on the calling thread's path: the
    # profiler is fed from one thread at a time.
    if not state.profiling and fused_pair(tensor, group):
        fut = _on_worker(state, lambda: pair_all_reduce(tensor, state.group(), state.workspace), tensor)
    else:
        scale_like_ddp(tensor, dist.get_world_size(group))
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    state.count_plain("all_reduce", tensor, group)
    return fut


def _coded_all_reduce(state: HuffmanState, tensor: torch.Tensor, is_last: bool) -> torch.Tensor:
    """On the worker: the bucket's compressed all-reduce (or a plain one where coding cannot pay)."""
    group = state.group()

    def plain():
        if fused_pair(tensor, group):
            pair_all_reduce(tensor, group, state.workspace)
        else:
            scale_like_ddp(tensor, dist.get_world_size(group))
            dist.all_reduce(tensor, group=group)

    def coded(stats):
        collectives.all_reduce(
            tensor,
            state.codec,
            group,
            average=True,
            cast=state.cast_dtype(tensor),
            stats=stats,
            workspace=state.workspace,
        )

    state.dispatch(
        "all_reduce",
        tensor,
        group,
        numel_per_rank=tensor.numel(),
        kind="gradient",
        coded=coded,
        plain=plain,
        reduced_kind="reduced_gradient",
    )
    if is_last:
        state.end_step()
    return tensor


def _on_worker(state: HuffmanState, fn, tensor: torch.Tensor) -> torch.futures.Future:
    """Run ``fn`` on the engine's worker, after the buckets before it; a torch future of its result.

    Collectives issued from two threads could interleave differently on each rank, so
    every bucket that the worker handles goes through it, in bucket order. The outcome,
    tensor or exception, is passed on as a value and raised in a .then callback: DDP then
    reports the exception itself, not a failed cast to Tensor.
    """
    outcome = torch.futures.Future()

    def done(cf):
        exc = cf.exception()
        outcome.set_result(exc if exc is not None else cf.result())

    def unwrap(f):
        value = f.value()
        if isinstance(value, BaseException):
            raise value
        return value

    state.submit(fn, like=tensor).add_done_callback(done)
    return outcome.then(unwrap)


def huffman_hook(state: "HuffmanState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket with Huffman-coded frames; the DDP comm-hook contract.

    Args:
        state: a :class:`HuffmanState`.
        bucket: the gradient bucket DDP hands the hook.

    Returns:
        A future holding the averaged bucket (written in place in ``bucket.buffer()``).

    Raises:
        ValueError: at the first step, on every rank, when ranks are configured
            differently. (Through the future, on every rank)
            :class:`comm_codec.CollectiveError` when a frame fails to decode on any
            rank; RuntimeError when ranks hold different books.
    """
    tensor = bucket.buffer()
    is_last = bucket.is_last()
    if bucket.index() == 0:  # DDP hands buckets over in index order: 0 starts a step
        state.begin_step(tensor)
    if not state.coding:
        state.observe(tensor, "gradient")

        def after(f, last=is_last):
            result = f.value()
            result = result[0] if isinstance(result, list) else result
            state.observe(result, "reduced_gradient")
            if last:
                state.end_step()
            return result

        return _plain_all_reduce(state, tensor).then(after)

    return _on_worker(state, lambda: _coded_all_reduce(state, tensor, is_last), tensor)
