"""Point-to-point coded transfers: send / recv of one frame, and a reduce to one rank.

Each frame travels after its size; the receiver refuses a size or dtype other than the
one it expects before it allocates anything.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.codec import Codec
from ..core.errors import CollectiveError, FrameError
from .framing import add_into, check_flat, decode_add, decode_part, encode_part, frame_bound, global_rank
from .stats import CommStats
from .workspace import Workspace

__all__ = ["send", "recv", "reduce"]


def send(
    tensor: torch.Tensor,
    dst: int,
    codec: Codec | None = None,
    group=None,
    *,
    kind: str = "activation",
    stats: CommStats | None = None,
) -> None:
    """Send a tensor to rank ``dst`` as a coded frame (its size first); pair with :func:`recv`.

    Args:
        tensor: the tensor to send.
        dst: destination rank (in ``group``).
        codec: as for :func:`all_reduce`.
        group: as for :func:`all_reduce`.
        kind: as for :func:`all_reduce`.
        stats: as for :func:`all_reduce`.
    """
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    frame = encode_part(codec, tensor.reshape(-1), kind, None, stats)
    peer = global_rank(group, dst)
    dist.send(torch.tensor([frame.numel()], dtype=torch.int64, device=frame.device), peer, group=group)
    dist.send(frame, peer, group=group)
    stats.add(coded_bytes_in=tensor.numel() * tensor.element_size(), coded_bytes_out=frame.numel() + 8, calls=1)


def recv(
    tensor: torch.Tensor, src: int, codec: Codec | None = None, group=None, *, stats: CommStats | None = None
) -> torch.Tensor:
    """Receive a frame sent by :func:`send` from rank ``src`` and decode it into ``tensor``.

    Args:
        tensor: contiguous output of the sent tensor's dtype and numel.
        src: source rank.
        codec: as for :func:`all_reduce`.
        group: as for :func:`all_reduce`.
        stats: as for :func:`all_reduce`.

    Returns:
        ``tensor``.

    Raises:
        FrameError: the frame is corrupt, or its size or dtype does not match ``tensor``
            (only the receiver can know; the sender has already returned).
    """
    out = check_flat(tensor)
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    frame = _recv_frame(out.numel(), out.dtype, src, group, out.device)
    decode_part(codec, frame, out.numel(), out.dtype, stats, out=out)
    return tensor


def _recv_frame(numel: int, dtype, src: int, group, device) -> torch.Tensor:
    """Receive one :func:`send` frame from ``src``; refuse a size or dtype other than expected."""
    peer = global_rank(group, src)
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, peer, group=group)
    limit = frame_bound(numel, dtype)
    if not 0 < int(size) <= limit:  # never allocate what a peer claims
        raise FrameError(
            f"peer {src} announced a frame of {int(size)} bytes; a frame of {numel} {dtype} elements takes 1..{limit}"
        )
    frame = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.recv(frame, peer, group=group)
    sent = Codec.frame_parameters(frame).dtype
    if sent != dtype:
        raise FrameError(f"peer {src} sent a {sent} tensor, expected {dtype}")
    return frame


def reduce(
    tensor: torch.Tensor,
    dst: int,
    codec: Codec | None = None,
    group=None,
    *,
    cast=None,
    kind: str = "gradient",
    stats: CommStats | None = None,
    workspace: Workspace | None = None,
) -> None:
    """Sum ``tensor`` over the group into rank ``dst``'s copy, every other rank sending one coded frame.

    The owner adds every rank's tensor in rank order in float32 (peers' frames decoded
    and added in one pass, :meth:`Codec.decode_accumulate`) and rounds once to the
    coded dtype, as :func:`all_reduce` does; the other ranks' tensors are unchanged, as
    with ``dist.reduce``. A frame that fails on the owner raises on every rank.

    Args:
        tensor: contiguous bf16, fp16 or fp32 tensor, summed in place on ``dst``.
        dst: the destination rank (in ``group``).
        codec: as for :func:`all_reduce`.
        group: as for :func:`all_reduce`.
        kind: as for :func:`all_reduce`.
        stats: as for :func:`all_reduce`.
        workspace: as for :func:`all_reduce`.
        cast: a narrower dtype to code fp32 in (lossy), or None.

    Raises:
        CollectiveError: on every rank, when the owner could not decode a frame.
    """
    flat = check_flat(tensor)
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    workspace = workspace if workspace is not None else Workspace()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    src = flat if cast is None or flat.dtype == cast else flat.to(cast)
    error = None
    with stats.timer("comm_seconds"):
        if rank != dst:
            send(src, dst, codec, group, kind=kind, stats=stats)
            # a plain reduce would send the uncast buffer: count what it would have sent
            stats.add(coded_bytes_in=flat.numel() * (flat.element_size() - src.element_size()))
        else:
            acc = workspace.take("acc", flat.numel(), torch.float32, flat.device)
            for r in range(world):  # rank order, so the sum does not depend on arrival
                first = r == 0
                if r == rank:
                    add_into(acc, src, first, workspace)
                    continue
                try:
                    frame = _recv_frame(src.numel(), src.dtype, r, group, flat.device)
                    decode_add(codec, frame, src.numel(), src.dtype, acc, first, stats)
                except (ValueError, TypeError) as exc:  # FrameError is a ValueError
                    error = error or f"frame from rank {r}: {exc}"
                    if first:
                        acc.zero_()
            flat.copy_(acc.to(src.dtype) if src is not flat else acc)
            stats.add(calls=1)  # the senders' send() counted theirs
        flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=flat.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        raise CollectiveError(f"coded reduce to rank {dst} failed" + (f": {error}" if error else " on its owner"))
