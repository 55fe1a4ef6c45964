"""The plain all-reduce of a gradient bucket, bit for bit DDP's built-in one, at its cost.

DDP without a hook scales each gradient by ``1 / world_size`` while copying it into the
bucket (``at::mul_out(bucket_view, grad, 1. / div_factor)`` in torch's reducer), then
sums the buckets with the backend's all-reduce. With a hook registered it copies the
gradients unscaled and leaves the scaling to the hook, which costs a pass of its own over
every gradient (on a bf16 model about as long as the copy itself).

:func:`scale_like_ddp` is that pass, written as DDP writes it (a multiply by the same
scalar, so the bits are the built-in's for every world size). :func:`pair_all_reduce`
avoids it where it can: with two gloo ranks and a bf16 CPU bucket, each rank receives its
peer's half of the bucket, scales and sums both halves in one pass
(:func:`comm_codec.kernels.premul.premul_sum_bf16`, the arithmetic of torch's multiply
and gloo's sum) and sends its summed half back: the bytes of gloo's ring all-reduce, and
the result of DDP's built-in one, without the extra pass. :func:`fused_pair` says when it
applies.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..core.errors import CollectiveError
from ..kernels.premul import premul_sum_bf16
from .framing import global_rank
from .workspace import Workspace

__all__ = ["ddp_scale", "fused_pair", "pair_all_reduce", "scale_like_ddp"]

# Below this many bytes a bucket goes through gloo's all-reduce: two point-to-point rounds
# and a worker hand-off cost more than the pass they save.
PAIR_MIN_BYTES = 1 << 16


def ddp_scale(world: int) -> float:
    """The factor DDP's built-in all-reduce multiplies gradients by: ``1. / world`` (a double, as in its reducer)."""
    return 1.0 / world


def scale_like_ddp(tensor: torch.Tensor, world: int) -> None:
    """Scale a bucket in place as DDP's reducer does without a hook: a multiply by ``1. / world``.

    A multiply by the reciprocal, not a divide: for world sizes that are not powers of
    two the two round differently, and DDP multiplies.
    """
    tensor.mul_(ddp_scale(world))


def fused_pair(tensor: torch.Tensor, group) -> bool:
    """Whether :func:`pair_all_reduce` can take this bucket: 2 gloo ranks, bf16, on the CPU, >= 64 KiB."""
    return (
        tensor.dtype == torch.bfloat16
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() >= PAIR_MIN_BYTES
        and dist.get_world_size(group) == 2
        and dist.get_backend(group) == "gloo"
    )


def pair_all_reduce(tensor: torch.Tensor, group, workspace: Workspace) -> torch.Tensor:
    """All-reduce a bf16 bucket over two ranks as DDP's built-in all-reduce does, scaling fused into the sum.

    Rank 0 sums the first half, rank 1 the second; every element is summed once, by one
    rank, and both ranks end with the same bits. The halves travel in segments of
    :data:`SEGMENT_ELEMS`, all posted at once: a segment is summed as soon as it has
    arrived and sent back while the next ones are still on the wire, as gloo's ring
    all-reduce pipelines its own. Blocking; run it where collectives on ``group`` are
    issued in the same order on both ranks (the engine's worker).

    Args:
        tensor: the bucket, contiguous bf16 on the CPU, at least 2 elements (see :func:`fused_pair`).
        group: a group of two gloo ranks.
        workspace: where the peer's half is received.

    Returns:
        ``tensor``, now ``bf16(bf16(g0 / 2) + bf16(g1 / 2))`` element by element.
    """
    flat = tensor.view(-1)
    rank = dist.get_rank(group)
    peer = global_rank(group, 1 - rank)
    half = flat.numel() // 2
    own, other = (flat[:half], flat[half:]) if rank == 0 else (flat[half:], flat[:half])
    received = workspace.take("premul_peer", own.numel(), torch.bfloat16, "cpu")
    own_bits = own.view(torch.int16).numpy().view(np.uint16)
    received_bits = received.view(torch.int16).numpy().view(np.uint16)
    scale = np.float32(ddp_scale(2))
    # Segment i of this rank's half is segment i of the peer's "other" part: the same
    # bounds on both ranks, tags telling the segments and the two directions apart.
    mine, theirs = _segments(own.numel()), _segments(other.numel())
    sends = [dist.isend(other[a:b], peer, group=group, tag=2 * i) for i, (a, b) in enumerate(theirs)]
    recvs = [dist.irecv(received[a:b], peer, group=group, tag=2 * i) for i, (a, b) in enumerate(mine)]
    back = []
    for i, (a, b) in enumerate(mine):
        recvs[i].wait()
        if premul_sum_bf16(own_bits[a:b], received_bits[a:b], scale):  # pragma: no cover - equal lengths
            raise CollectiveError("premul_sum_bf16: the received segment is shorter than this rank's")
        back.append(dist.isend(own[a:b], peer, group=group, tag=2 * i + 1))
    back += [dist.irecv(other[a:b], peer, group=group, tag=2 * i + 1) for i, (a, b) in enumerate(theirs)]
    for work in sends + back:
        work.wait()
    return tensor


# Elements per segment of :func:`pair_all_reduce` (2 MiB of bf16).
SEGMENT_ELEMS = 1 << 20


def _segments(numel: int) -> list[tuple[int, int]]:
    return [(a, min(a + SEGMENT_ELEMS, numel)) for a in range(0, numel, SEGMENT_ELEMS)]
