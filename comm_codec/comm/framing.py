"""Coding one part of a collective for the wire, and checking what a peer sent, the same way everywhere.

The collectives (:mod:`comm_codec.comm.collectives`) and the point-to-point calls
(:mod:`comm_codec.comm.p2p`) share these steps: a part is encoded (cast first where the
caller codes a narrower dtype) with its time counted; a peer's frame is decoded only
into the element count the receiver expects, never trusted with an allocation; sums are
accumulated in float32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.codec import Codec
from ..core.frame import FrameError, header_size
from ..core.streams import spec_for
from .stats import CommStats
from .workspace import Workspace

__all__ = [
    "add_into",
    "check_flat",
    "decode_add",
    "decode_part",
    "encode_part",
    "frame_bound",
    "global_rank",
    "round_into",
]


def check_flat(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Return a contiguous tensor's flat view; refuse what results cannot be written into in place."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (results are written in place)")
    return tensor.view(-1)


def encode_part(codec: Codec, tensor: torch.Tensor, kind: str, cast, stats: CommStats) -> torch.Tensor:
    """Encode one part for the wire (cast to ``cast`` first, if given), its time counted in ``stats``."""
    if cast is not None and tensor.dtype != cast:
        tensor = tensor.to(cast)
    with stats.timer("encode_seconds"):
        return codec.encode(tensor, kind)


def decode_part(codec: Codec, frame: torch.Tensor, numel: int, dtype, stats: CommStats, out=None) -> torch.Tensor:
    """Decode a peer's frame, checking it holds numel elements; into out if given.

    A frame of out's dtype is decoded straight into it; one of another dtype (a cast
    shard) is decoded and converted. The frame may never decode to more than the
    ``numel`` elements expected (a peer's frame is not trusted with the allocation).
    """
    with stats.timer("decode_seconds"):
        params = Codec.frame_parameters(frame)
        if params.numel != numel:
            raise FrameError(f"frame holds {params.numel} elements, expected {numel}")
        if out is not None and params.dtype == out.dtype:
            return codec.decode(frame, out=out)
        result = codec.decode(frame, max_output_bytes=numel * params.spec.itemsize)
    if out is not None:
        out.copy_(result)
        return out
    return result if dtype is None or result.dtype == dtype else result.to(dtype)


def add_into(acc: torch.Tensor, part: torch.Tensor, first: bool, workspace: Workspace) -> None:
    """Add part into acc (write it, when first), widened exactly to acc's dtype.

    A narrower part is widened into a reused buffer before it is added: torch's in-place
    add of a bf16 tensor into a float32 one is several times slower than a float32 add,
    and the result is the same, since widening is exact.
    """
    if first:
        acc.copy_(part)
    elif part.dtype == acc.dtype:
        acc.add_(part)
    else:
        wide = workspace.take("wide", part.numel(), acc.dtype, acc.device)
        wide.copy_(part)
        acc.add_(wide)


def decode_add(
    codec: Codec, frame: torch.Tensor, numel: int, dtype, acc: torch.Tensor, first: bool, stats: CommStats
) -> None:
    """Decode a peer's frame of ``numel`` elements of ``dtype`` and add it into the float32 acc in one pass.

    :meth:`Codec.decode_accumulate` gives bit for bit ``acc.add_(decode(frame).float())``
    without the decoded shard ever existing (one pass over memory instead of three).
    """
    with stats.timer("decode_seconds"):
        params = Codec.frame_parameters(frame)
        if params.numel != numel:
            raise FrameError(f"frame holds {params.numel} elements, expected {numel}")
        if params.dtype != dtype:
            raise FrameError(f"frame holds {params.dtype}, expected {dtype}")
        codec.decode_accumulate(frame, acc, add=not first)


def round_into(out: torch.Tensor, acc: torch.Tensor, average: bool, world: int) -> torch.Tensor:
    """Write acc (divided by world when averaging) into out, rounded once to out's dtype.

    One pass: the division runs in acc's dtype and its result is rounded as it is
    stored, bit for bit what ``acc.div_(world)`` then ``out.copy_(acc)`` give.
    """
    if average:
        torch.div(acc, world, out=out)
    else:
        out.copy_(acc)
    return out


def frame_bound(numel: int, dtype) -> int:
    """The most bytes a frame of ``numel`` elements of ``dtype`` can take, for any chunk size.

    :meth:`Codec.encode` never writes more than the raw bytes plus the header and up to
    7 bytes of padding per chunk and stream; chunks hold at least 8 elements. The mask
    bitmap (1 bit per element) is counted on top, for safety.
    """
    spec = spec_for(dtype)
    chunks = -(-numel // 8)
    return numel * spec.itemsize + header_size(spec.nstreams, chunks) + 8 * (spec.nstreams + 1) * chunks + numel // 8


def global_rank(group, rank: int) -> int:
    """torch.distributed's send/recv take global ranks; ours take ranks in the group."""
    return rank if group is None else dist.get_global_rank(group, rank)
