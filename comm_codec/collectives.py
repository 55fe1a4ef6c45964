"""Compressed collectives: all_reduce, reduce_scatter, all_gather, send, recv.

Frames have data-dependent sizes, so each collective exchanges sizes first. All reduce is
two-phase (design.md, "All-reduce of variable-length frames"):

1. *reduce-scatter*: the buffer is split into W shards; every rank encodes the shards
   it does not own and sends shard r to rank r with one uneven ``all_to_all_single``;
   rank r decodes them and sums all W shards **in rank order** in float32 (float32
   buffers: float32), then divides by W for an average, rounding to the buffer dtype once.
2. *all-gather*: each owner encodes its reduced shard and sends it to every rank (an
   uneven all_to_all_single: no padding to the largest frame); every rank decodes them
   in place.

Every rank ends with the owner's bits for every shard, so results are bit-identical on
all ranks, and equal to the rank-order sum of the raw inputs. Errors (a frame that fails
its checksum, books that differ, a size that does not match) are agreed on by all ranks
with one small all-reduce per collective and raised on every rank as
:class:`CollectiveError`, instead of leaving the healthy ranks waiting on the broken one.
Zero-element collectives (which gloo rejects) are never issued: empty shards still send
a frame header.

Tensors may live on the CPU (gloo) or on a CUDA device (NCCL): frames, sizes and error
flags are made on the data's device, since NCCL moves only CUDA tensors, and CUDA frames
are coded on their GPU by the codec.
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
# Pipelining: at most this many pieces, each at least this many elements per rank.
_PIECES = 4
_MIN_PIECE = 1 << 18


class CollectiveError(RuntimeError):
    """A compressed collective failed on some rank; raised on every rank of the group."""


def _shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


def _agree_on_errors(error: str | None, group, device=None) -> None:
    """Raise CollectiveError on every rank if any rank has an error (one 1-int all-reduce).

    ``device`` is the data's: the flag travels with the same backend (NCCL: CUDA only).
    """
    flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=device)
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


def _frame_parameters(frame: torch.Tensor):
    """The frame's parameters; of a CUDA frame only the header crosses to the host."""
    if frame.device.type == "cuda":
        from .kernels.cuda import read_header

        return get_frame_parameters(read_header(frame))
    return get_frame_parameters(frame)


def _decode(codec: Codec, frame: torch.Tensor, numel: int, dtype, stats: CommStats, out=None) -> torch.Tensor:
    """Decode a peer's frame, checking it holds numel elements; into out if given.

    A frame of out's dtype is decoded straight into it; one of another dtype (a cast
    shard) is decoded and converted.
    """
    with stats.timer("decode_seconds"):
        params = _frame_parameters(frame)
        if params.numel != numel:
            raise FrameError(f"frame holds {params.numel} elements, expected {numel}")
        if out is not None and params.dtype == out.dtype:
            return codec.decode(frame, out=out)
        result = codec.decode(frame)
    if out is not None:
        out.copy_(result)
        return out
    return result if dtype is None or result.dtype == dtype else result.to(dtype)


class _Exchange:
    """Phase 1 in flight: shards sent to their owners with an async all_to_all_single."""

    __slots__ = ("work", "recv", "recv_sizes", "send", "bounds")

    def __init__(self, frames: list[torch.Tensor], bounds, group):
        world = len(frames)
        device = frames[0].device
        send_sizes = torch.tensor([f.numel() for f in frames], dtype=torch.int64, device=device)
        self.recv_sizes = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_to_all_single(self.recv_sizes, send_sizes, group=group)
        self.send = torch.cat(frames)  # kept alive until the exchange completes
        self.recv = torch.empty(int(self.recv_sizes.sum()), dtype=torch.uint8, device=device)
        self.work = dist.all_to_all_single(self.recv, self.send, output_split_sizes=self.recv_sizes.tolist(),
                                           input_split_sizes=send_sizes.tolist(), group=group, async_op=True)
        self.bounds = bounds

    def frames(self) -> list[torch.Tensor]:
        self.work.wait()
        return list(torch.split(self.recv, self.recv_sizes.tolist()))


def _start_exchange(tensor, bounds, codec, group, kind, cast, stats, rank) -> _Exchange:
    """Encode the shards this rank does not own and start sending them to their owners."""
    frames = []
    for r, (lo, hi) in enumerate(bounds):
        if r == rank:
            frames.append(torch.empty(0, dtype=torch.uint8, device=tensor.device))  # own shard never travels
        else:
            frames.append(_encode(codec, tensor[lo:hi], kind, cast, stats))
    lo, hi = bounds[rank]
    stats.add(bytes_in=(tensor.numel() - (hi - lo)) * tensor.element_size(),
              bytes_out=sum(f.numel() for f in frames) + 16 * len(bounds))
    return _Exchange(frames, bounds, group)


def _finish_reduce(exchange: _Exchange, tensor, codec, cast, average, stats, rank, world):
    """Phase 1 done: decode the shards received and sum them in rank order.

    Returns:
        ``(reduced shard in the coded dtype, None)`` or ``(None, error message)``.
    """
    received = exchange.frames()
    lo, hi = exchange.bounds[rank]
    acc_dtype = _ACC_DTYPE.get(tensor.dtype, tensor.dtype)
    acc = None
    try:
        for r in range(world):
            if r == rank:
                part = tensor[lo:hi]
                if cast is not None:
                    part = part.to(cast)  # every rank's contribution went through the cast
            else:
                part = _decode(codec, received[r], hi - lo, None, stats)
            if acc is None:
                acc = part.to(acc_dtype, copy=True)
            else:
                acc.add_(part)  # in acc_dtype (float32): bf16/fp16 parts are widened exactly
        if average:
            acc.div_(world)
    except (FrameError, ValueError, TypeError) as exc:
        return None, f"shard {rank} from rank {r}: {exc}"
    return acc.to(cast if cast is not None else tensor.dtype), None


class _Gather:
    """Phase 2 in flight: every owner's reduced frame sent to every rank, async.

    Frames differ in size from rank to rank (an embedding's mostly-zero shard codes to a
    fraction of a dense one), so they travel in an uneven all_to_all_single, each rank
    sending its own frame to each peer, rather than in an all_gather padded to the
    largest frame, which cost the whole gain of the small ones.
    """

    __slots__ = ("work", "recv", "recv_splits", "send", "sent")

    def __init__(self, frame: torch.Tensor, group, error: str | None):
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        size = torch.tensor([-1 if error else frame.numel()], dtype=torch.int64, device=frame.device)
        gathered = [torch.empty(1, dtype=torch.int64, device=frame.device) for _ in range(world)]
        dist.all_gather(gathered, size, group=group)
        sizes = [int(x) for x in gathered]
        if min(sizes) < 0:  # some rank failed phase 1: every rank raises here
            messages = [None] * world
            dist.all_gather_object(messages, error, group=group)
            failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
            raise CollectiveError(f"compressed collective failed: {failed}")
        send_splits = [0 if r == rank else frame.numel() for r in range(world)]
        self.recv_splits = [0 if r == rank else sizes[r] for r in range(world)]
        self.send = frame.repeat(world - 1)  # one copy per peer, kept alive until sent
        self.sent = (world - 1) * frame.numel()
        self.recv = torch.empty(sum(self.recv_splits), dtype=torch.uint8, device=frame.device)
        self.work = dist.all_to_all_single(self.recv, self.send, output_split_sizes=self.recv_splits,
                                           input_split_sizes=send_splits, group=group, async_op=True)

    def frames(self) -> list[torch.Tensor]:
        """Every rank's frame; this rank's own slot is empty (it keeps its own result)."""
        self.work.wait()
        return list(torch.split(self.recv, self.recv_splits))

def _gather_frames(frame: torch.Tensor, group, error: str | None) -> tuple[list[torch.Tensor], int]:
    """Send one variable-size frame from every rank to every rank; return frames and bytes sent."""
    gather = _Gather(frame, group, error)
    return gather.frames(), gather.sent


def _pieces(numel: int, world: int) -> list[tuple[int, int]]:
    """Split a buffer into up to _PIECES pieces of at least _MIN_PIECE elements per rank.

    Pieces pipeline the two phases: piece p+1 is coded while piece p is on the wire.
    """
    count = max(1, min(_PIECES, numel // (_MIN_PIECE * world)))
    return [(k * numel // count, (k + 1) * numel // count) for k in range(count)]


def all_reduce(tensor: torch.Tensor, codec: Codec | None = None, group=None, *, average: bool = False,
               kind: str = "gradient", reduced_kind: str = "reduced_gradient", cast=None,
               stats: CommStats | None = None) -> torch.Tensor:
    """Sum (or average) a tensor across ranks, in place, sending Huffman-coded frames.

    Large tensors go in up to four pieces whose phases overlap: while one piece's
    frames are on the wire, the next is encoded and the previous decoded, so the link
    does not idle while ranks compute.

    Args:
        tensor: a contiguous CPU or CUDA tensor of a float dtype the codec supports;
            overwritten with the result.
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
        pieces = [flat[a:b] for a, b in _pieces(flat.numel(), world)]
        bounds = [_shard_bounds(p.numel(), world) for p in pieces]
        start = lambda k: _start_exchange(pieces[k], bounds[k], codec, group, kind, cast, stats, rank)  # noqa: E731
        exchanges = {0: start(0)}
        gathers = {}
        reduced = {}
        error = None
        for k in range(len(pieces) + 1):
            if k + 1 < len(pieces):
                exchanges[k + 1] = start(k + 1)  # coded while piece k is on the wire
            if k < len(pieces):
                reduced[k], failed = _finish_reduce(exchanges.pop(k), pieces[k], codec, cast, average, stats,
                                                    rank, world)
                frame = (torch.empty(0, dtype=torch.uint8, device=flat.device) if failed
                         else _encode(codec, reduced[k], reduced_kind, None, stats))
                gathers[k] = _Gather(frame, group, failed)
                lo, hi = bounds[k][rank]
                stats.add(bytes_in=(world - 1) * (hi - lo) * flat.element_size(),
                          bytes_out=gathers[k].sent + 8 * world)
            if k >= 1:  # decoded while piece k is gathered
                error = error or _finish_gather(gathers.pop(k - 1), pieces[k - 1], bounds[k - 1],
                                                reduced.pop(k - 1), codec, stats, rank)
        stats.add(calls=1)
        _agree_on_errors(error, group, flat.device)
    return tensor


def _finish_gather(gather: _Gather, piece, bounds, reduced, codec, stats, rank) -> str | None:
    """Phase 2 done: decode every owner's reduced shard into place; return an error or None."""
    frames = gather.frames()
    try:
        for r, (a, b) in enumerate(bounds):
            if r == rank:
                piece[a:b].copy_(reduced)
            else:
                _decode(codec, frames[r], b - a, piece.dtype, stats, out=piece[a:b])
    except (FrameError, ValueError, TypeError) as exc:
        return f"reduced shard from rank {r}: {exc}"
    return None


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
        exchange = _start_exchange(flat, bounds, codec, group, kind, cast, stats, rank)
        reduced, error = _finish_reduce(exchange, flat, codec, cast, average, stats, rank, world)
        _agree_on_errors(error, group, out.device)
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
        frames, sent = _gather_frames(frame, group, None)
        stats.add(bytes_in=(world - 1) * flat.numel() * flat.element_size(),
                  bytes_out=sent + 8 * world, calls=1)
        error = None
        try:
            for r in range(world):
                if r == rank:
                    tensor_list[r].view(-1).copy_(flat)
                else:
                    _decode(codec, frames[r], flat.numel(), flat.dtype, stats, out=tensor_list[r].view(-1))
        except (FrameError, ValueError, TypeError) as exc:
            error = f"frame from rank {r}: {exc}"
        _agree_on_errors(error, group, flat.device)
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
    dist.send(torch.tensor([frame.numel()], dtype=torch.int64, device=frame.device), peer, group=group)
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
    size = torch.empty(1, dtype=torch.int64, device=out.device)
    dist.recv(size, peer, group=group)
    if not 0 < int(size) < 1 << 40:
        raise FrameError(f"peer {src} announced an impossible frame size {int(size)}")
    frame = torch.empty(int(size), dtype=torch.uint8, device=out.device)
    dist.recv(frame, peer, group=group)
    dtype = _frame_parameters(frame).dtype
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
