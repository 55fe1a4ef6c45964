"""Compressed collectives: all_reduce, reduce_scatter, all_gather, send, recv.

Frames have data-dependent sizes, so each collective exchanges sizes first. All reduce is
two-phase (design.md, "All-reduce of variable-length frames"):

1. *reduce-scatter*: the buffer is split into W shards; every rank encodes the shards
   it does not own and sends shard r to rank r with one uneven ``all_to_all_single``;
   rank r decodes them and sums all W shards **in rank order** in float32 (float32
   buffers: float32), then divides by W for an average, rounding to the buffer dtype once.
2. *all-gather*: each owner encodes its reduced shard; frames are padded to the largest
   and all-gathered; every rank decodes them in place.

Every rank ends with the owner's bits for every shard, so results are bit-identical on
all ranks, and equal to the rank-order sum of the raw inputs. Errors (a frame that fails
its checksum, books that differ, a size that does not match) are agreed on by all ranks
with one small all-reduce per collective and raised on every rank as
:class:`CollectiveError`, instead of leaving the healthy ranks waiting on the broken one.
Zero-element collectives (which gloo rejects) are never issued: empty shards still send
a frame header.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .codec import Codec
from .frame import FrameError, get_frame_parameters
from .stats import CommStats

__all__ = [
    "CollectiveError",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "send",
    "recv",
    "row_parallel_all_reduce",
]

log = logging.getLogger(__name__)

_ACC_DTYPE = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32}


class CollectiveError(RuntimeError):
    """A compressed collective failed on some rank; raised on every rank of the group."""


def _shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


def _agree_on_errors(error: str | None, group) -> None:
    """Raise CollectiveError on every rank if any rank has an error (one 1-int all-reduce)."""
    flag = torch.tensor([1 if error else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return
    messages = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, error, group=group)
    failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
    raise CollectiveError(f"compressed collective failed: {failed}")


def _check_tensor(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (results are written in place)")
    return tensor.view(-1)


def _encode(codec: Codec, tensor: torch.Tensor, kind: str, cast, stats: CommStats) -> torch.Tensor:
    if cast is not None and tensor.dtype != cast:
        tensor = tensor.to(cast)
    with stats.timer("encode_seconds"):
        return codec.encode(tensor, kind)


def _decode(codec: Codec, frame: torch.Tensor, numel: int, dtype, stats: CommStats, out=None) -> torch.Tensor:
    """Decode a peer's frame, checking it holds numel elements; into out if given.

    A frame of out's dtype is decoded straight into it; one of another dtype (a cast
    shard) is decoded and converted.
    """
    with stats.timer("decode_seconds"):
        params = get_frame_parameters(frame)
        if params.numel != numel:
            raise FrameError(f"frame holds {params.numel} elements, expected {numel}")
        if out is not None and params.dtype == out.dtype:
            return codec.decode(frame, out=out)
        result = codec.decode(frame)
    if out is not None:
        out.copy_(result)
        return out
    return result if result.dtype == dtype else result.to(dtype)


def _exchange_frames(frames: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send frames[r] to rank r (uneven all_to_all_single); return the frames received."""
    world = len(frames)
    send_sizes = torch.tensor([f.numel() for f in frames], dtype=torch.int64)
    recv_sizes = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.cat(frames)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes.tolist(),
                           input_split_sizes=send_sizes.tolist(), group=group)
    return list(torch.split(recv, recv_sizes.tolist()))


def _gather_frames(frame: torch.Tensor, group, error: str | None) -> tuple[list[torch.Tensor], int]:
    """All-gather one variable-size frame per rank (padded); return frames and padded size.

    A rank with an error sends size -1, and every rank raises before the data exchange.
    """
    world = dist.get_world_size(group)
    size = torch.tensor([-1 if error else frame.numel()], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    if min(sizes) < 0:
        messages = [None] * world
        dist.all_gather_object(messages, error, group=group)
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
        raise CollectiveError(f"compressed collective failed: {failed}")
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: frame.numel()] = frame
    gathered = torch.empty(world * longest, dtype=torch.uint8)
    dist.all_gather(list(gathered.view(world, longest)), padded, group=group)
    return [gathered[r * longest: r * longest + sizes[r]] for r in range(world)], longest


def _reduce_owned(tensor, bounds, codec, group, kind, cast, average, stats, rank, world):
    """Phase 1: exchange shards; return (this rank's reduced shard, error message)."""
    frames = []
    for r, (lo, hi) in enumerate(bounds):
        if r == rank:
            frames.append(torch.empty(0, dtype=torch.uint8))  # own shard never travels
        else:
            frames.append(_encode(codec, tensor[lo:hi], kind, cast, stats))
    received = _exchange_frames(frames, group)
    lo, hi = bounds[rank]
    sent = sum(f.numel() for f in frames)
    stats.add(bytes_in=(tensor.numel() - (hi - lo)) * tensor.element_size(), bytes_out=sent + 16 * world)
    acc_dtype = _ACC_DTYPE.get(tensor.dtype, tensor.dtype)
    acc = None
    error = None
    try:
        for r in range(world):
            part = tensor[lo:hi] if r == rank else _decode(codec, received[r], hi - lo, acc_dtype, stats)
            if cast is not None and r == rank:
                part = part.to(cast)  # every rank's contribution went through the cast
            part = part.to(acc_dtype)
            acc = part.clone() if acc is None else acc.add_(part)
        if average:
            acc.div_(world)
    except (FrameError, ValueError, TypeError) as exc:
        error = f"shard {rank} from rank {r}: {exc}"
    reduced = None if error else acc.to(cast if cast is not None else tensor.dtype)
    return reduced, error


def all_reduce(tensor: torch.Tensor, codec: Codec | None = None, group=None, *, average: bool = False,
               kind: str = "gradient", reduced_kind: str = "reduced_gradient", cast=None,
               stats: CommStats | None = None) -> torch.Tensor:
    """Sum (or average) a tensor across ranks, in place, sending Huffman-coded frames.

    Args:
        tensor: a contiguous CPU tensor of a float dtype the codec supports; overwritten
            with the result.
        codec: the :class:`Codec` (same books on every rank); None uses default books.
        group: the process group (default: the world).
        average: divide the sum by the group size (as DDP's default hook does).
        kind: codebook kind for the input shards.
        reduced_kind: codebook kind for the reduced shards.
        cast: a dtype (e.g. torch.bfloat16) the shards are cast to before coding —
            lossy, for users who accept bf16 communication; None is lossless.
        stats: a :class:`CommStats` to add traffic counts to.

    Returns:
        ``tensor``, holding the rank-order sum (or average): bit-identical on every rank.

    Raises:
        CollectiveError: on every rank, if any rank failed to decode a frame.
        TypeError, ValueError: bad arguments (same on every rank, raised before any
            communication).
    """
    flat = _check_tensor(tensor)
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        if cast is not None:
            flat.copy_(flat.to(cast))
        return tensor
    with stats.timer("comm_seconds"):
        bounds = _shard_bounds(flat.numel(), world)
        reduced, error = _reduce_owned(flat, bounds, codec, group, kind, cast, average, stats, rank, world)
        frame = torch.empty(0, dtype=torch.uint8) if error else _encode(codec, reduced, reduced_kind, None, stats)
        frames, longest = _gather_frames(frame, group, error)
        lo, hi = bounds[rank]
        stats.add(bytes_in=(world - 1) * (hi - lo) * flat.element_size(),
                  bytes_out=(world - 1) * longest + 8 * world, calls=1)
        error = None
        try:
            for r, (a, b) in enumerate(bounds):
                if r == rank:
                    flat[a:b].copy_(reduced)
                else:
                    _decode(codec, frames[r], b - a, flat.dtype, stats, out=flat[a:b])
        except (FrameError, ValueError, TypeError) as exc:
            error = f"reduced shard from rank {r}: {exc}"
        _agree_on_errors(error, group)
    return tensor


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], codec: Codec | None = None,
                   group=None, *, average: bool = False, kind: str = "activation", cast=None,
                   stats: CommStats | None = None) -> torch.Tensor:
    """Reduce ``input_list[r]`` over all ranks into rank r's ``output``, coded.

    Args:
        output: contiguous tensor, same numel and dtype as each input; overwritten.
        input_list: one tensor per rank (all the same numel and dtype).
        codec, group, kind, cast, stats: as for :func:`all_reduce`.
        average: divide by the group size.

    Returns:
        ``output``: the rank-order sum (or average) of every rank's ``input_list[rank]``.

    Raises:
        CollectiveError: on every rank, if any rank failed to decode.
        ValueError: wrong number of inputs or mismatched sizes.
    """
    out = _check_tensor(output, "output")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if len(input_list) != world:
        raise ValueError(f"input_list needs one tensor per rank ({world}), got {len(input_list)}")
    if any(t.numel() != out.numel() or t.dtype != out.dtype for t in input_list):
        raise ValueError("every input must match output's numel and dtype")
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    n = out.numel()
    flat = torch.cat([t.reshape(-1) for t in input_list])
    bounds = [(r * n, (r + 1) * n) for r in range(world)]
    with stats.timer("comm_seconds"):
        reduced, error = _reduce_owned(flat, bounds, codec, group, kind, cast, average, stats, rank, world)
        _agree_on_errors(error, group)
        out.copy_(reduced)
        stats.add(calls=1)
    return output


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, codec: Codec | None = None,
               group=None, *, kind: str = "activation", stats: CommStats | None = None) -> list[torch.Tensor]:
    """Gather every rank's ``tensor`` into ``tensor_list``, coded; mirrors dist.all_gather.

    Args:
        tensor_list: one output tensor per rank (same numel and dtype as ``tensor``).
        tensor: this rank's contribution.
        codec, group, kind, stats: as for :func:`all_reduce`.

    Returns:
        ``tensor_list``, filled bit-exactly.

    Raises:
        CollectiveError: on every rank, if any rank failed to decode.
        ValueError: wrong number or size of outputs.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if len(tensor_list) != world:
        raise ValueError(f"tensor_list needs one tensor per rank ({world}), got {len(tensor_list)}")
    flat = tensor.reshape(-1)
    for t in tensor_list:
        if t.numel() != flat.numel() or t.dtype != flat.dtype or not t.is_contiguous():
            raise ValueError("every output must be contiguous and match the input's numel and dtype")
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    with stats.timer("comm_seconds"):
        frame = _encode(codec, flat, kind, None, stats)
        frames, longest = _gather_frames(frame, group, None)
        stats.add(bytes_in=(world - 1) * flat.numel() * flat.element_size(),
                  bytes_out=(world - 1) * longest + 8 * world, calls=1)
        error = None
        try:
            for r in range(world):
                if r == rank:
                    tensor_list[r].view(-1).copy_(flat)
                else:
                    _decode(codec, frames[r], flat.numel(), flat.dtype, stats, out=tensor_list[r].view(-1))
        except (FrameError, ValueError, TypeError) as exc:
            error = f"frame from rank {r}: {exc}"
        _agree_on_errors(error, group)
    return tensor_list


def send(tensor: torch.Tensor, dst: int, codec: Codec | None = None, group=None, *, kind: str = "activation",
         stats: CommStats | None = None) -> None:
    """Send a tensor to rank ``dst`` as a coded frame (its size first); pair with :func:`recv`.

    Args:
        tensor: the tensor to send.
        dst: destination rank (in ``group``).
        codec, group, kind, stats: as for :func:`all_reduce`.
    """
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    frame = _encode(codec, tensor.reshape(-1), kind, None, stats)
    peer = _global_rank(group, dst)
    dist.send(torch.tensor([frame.numel()], dtype=torch.int64), peer, group=group)
    dist.send(frame, peer, group=group)
    stats.add(bytes_in=tensor.numel() * tensor.element_size(), bytes_out=frame.numel() + 8, calls=1)


def recv(tensor: torch.Tensor, src: int, codec: Codec | None = None, group=None, *,
         stats: CommStats | None = None) -> torch.Tensor:
    """Receive a frame sent by :func:`send` from rank ``src`` and decode it into ``tensor``.

    Args:
        tensor: contiguous output of the sent tensor's dtype and numel.
        src: source rank.
        codec, group, stats: as for :func:`all_reduce`.

    Returns:
        ``tensor``.

    Raises:
        FrameError: the frame is corrupt, or its size or dtype does not match ``tensor``
            (only the receiver can know; the sender has already returned).
    """
    out = _check_tensor(tensor)
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    peer = _global_rank(group, src)
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, peer, group=group)
    if not 0 < int(size) < 1 << 40:
        raise FrameError(f"peer {src} announced an impossible frame size {int(size)}")
    frame = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(frame, peer, group=group)
    dtype = get_frame_parameters(frame).dtype
    if dtype != out.dtype:
        raise FrameError(f"peer {src} sent a {dtype} tensor, expected {out.dtype}")
    _decode(codec, frame, out.numel(), out.dtype, stats, out=out)
    return tensor


def _global_rank(group, rank: int) -> int:
    """torch.distributed's send/recv take global ranks; ours take ranks in the group."""
    return rank if group is None else dist.get_global_rank(group, rank)


class _RowParallelAllReduce(torch.autograd.Function):
    """Sum of the partial outputs of a row-parallel linear; identity in backward."""

    @staticmethod
    def forward(ctx, x, codec, group, stats):
        y = x.detach().clone().contiguous()
        all_reduce(y, codec, group, kind="activation", reduced_kind="activation", stats=stats)
        return y

    @staticmethod
    def backward(ctx, grad):
        # d(sum_r x_r)/dx_r = I: every rank already holds the full output gradient.
        return grad, None, None, None


def row_parallel_all_reduce(x: torch.Tensor, codec: Codec | None = None, group=None,
                            stats: CommStats | None = None) -> torch.Tensor:
    """All-reduce a row-parallel linear's partial output, coded, differentiably.

    In Megatron-style tensor parallelism the row-parallel layer's forward ends with an
    all-reduce (sum) and its backward needs none; this is that all-reduce with coded
    activations. See ``launch_scripts/tensor_parallel_example.py``.

    Args:
        x: this rank's partial output.
        codec, group, stats: as for :func:`all_reduce`.

    Returns:
        The sum over ranks, with autograd passing the gradient through unchanged.
    """
    return _RowParallelAllReduce.apply(x, codec or Codec(), group, stats)
