"""Compressed collectives: all_reduce, reduce_scatter, all_gather, send, recv.

Frames have data-dependent sizes, so each collective exchanges sizes first. All reduce is
two-phase:

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
and raised on every rank as :class:`CollectiveError`, instead of leaving the healthy
ranks waiting on the broken one. Zero-element collectives (which gloo rejects) are never
issued: empty shards still send a frame header.

:func:`all_reduce` pipelines large buffers in pieces and sends each piece's two phases
in *stages*: one stage is one small size exchange (which also carries every rank's error
flag) and one uneven ``all_to_all_single`` that carries, to each peer, the phase-1 shard
of one piece and the phase-2 frame of the piece two before it. While a stage is on the
wire the rank reduces the previous piece, decodes the gathered one before it, and
encodes the next: the link and the CPU work at the same time, with two collectives per
stage and one error check at the end.

:func:`reduce_scatter` and :func:`all_gather` are each one phase of that protocol and
run on the same stages: piece k's frames are encoded while piece k-1 is on the wire and
decoded (and, for a reduce-scatter, summed) while piece k+1 is, with the same
workspace, the same error flags and the same rank-order sum (FSDP2 hands them a
module's whole shard at once: :mod:`comm_codec.fsdp`).

``kind=`` picks the books a tensor is weighed against, with one default per family: the
collectives that sum (all_reduce, reduce, reduce_scatter) default to "gradient", those
that move data unchanged (all_gather, send) to "activation"; recv reads it from the frame.

A frame that comes from a peer is never trusted with an allocation: it is decoded into
a buffer of the size the receiver expects, and refused if its header says otherwise.

Tensors may live on the CPU (gloo) or on a CUDA device (NCCL): frames, sizes and error
flags are made on the data's device, since NCCL moves only CUDA tensors, and CUDA frames
are coded on their GPU by the codec.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from ..core.codec import Codec
from ..core.errors import CollectiveError
from ..core.frame import FrameError
from ..core.streams import ACCUMULABLE_DTYPES
from .agreement import gather_texts
from .framing import add_into, check_flat, decode_add, decode_part, encode_part, frame_bound, round_into
from .p2p import recv, reduce, send
from .stats import CommStats
from .workspace import Workspace

# The user's names; the engine's helpers here (pieces, plain_wire_bytes, on_cuda_worker,
# the piece sizes) are importable but not part of the public surface.
__all__ = [
    "CollectiveError",
    "CommStats",
    "Workspace",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "send",
    "recv",
    "reduce",
    "row_parallel_all_reduce",
]

log = logging.getLogger(__name__)

_ACC_DTYPE = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32}
# Pipelining: a buffer goes in at most MAX_PIECES pieces, each of at least
# MIN_PIECE_ELEMS elements per rank (smaller pieces cost more in per-stage latency than
# the overlap gains). Read at every call: a caller (or a test) may tune them.
MAX_PIECES = 4
MIN_PIECE_ELEMS = 1 << 18
# Bytes a peer's announced frame may exceed the largest frame of what the receiver expects.
_CLAIM_SLACK = 1 << 20
# The most bytes of one rank's error message that travel to its peers.
_MAX_ERROR_BYTES = 4096
# Bytes of one rank's size message to one peer in an all_reduce stage: three int64
# (phase-1 frame, phase-2 frame, error flag).
_STAGE_HEADER = 24


def _shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


def _width(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


@contextlib.contextmanager
def _failures_as_collective_errors():
    """Raise what the transport raises mid-protocol (a peer that stalled past the group's
    timeout, died, or broke the protocol) as CollectiveError, the collectives' one error."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        raise CollectiveError(f"compressed collective failed: {exc}") from exc


def _raise_gathered(error: str | None, group, device=None) -> None:
    """Gather every rank's error message and raise them as one CollectiveError (collective)."""
    text = (error or "").encode("utf-8", "replace")[:_MAX_ERROR_BYTES].decode("utf-8", "ignore")
    messages = gather_texts(text, group, device, limit=_MAX_ERROR_BYTES)
    failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
    raise CollectiveError(f"compressed collective failed: {failed}")


def _agree_on_errors(error: str | None, group, device=None) -> None:
    """Raise CollectiveError on every rank if any rank has an error (one 1-int all-reduce).

    ``device`` is the data's: the flag travels with the same backend (NCCL: CUDA only).
    """
    flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        _raise_gathered(error, group, device)


def _encode_each(parts: list[torch.Tensor], codec, kind, cast, stats, rank) -> list[torch.Tensor]:
    """Encode ``parts[r]`` for every peer r (this rank's own slot: an empty frame, never sent)."""
    frames = []
    for r, part in enumerate(parts):
        if r == rank:
            frames.append(torch.empty(0, dtype=torch.uint8, device=part.device))
        else:
            frames.append(encode_part(codec, part, kind, cast, stats))
    sent = sum(p.numel() for r, p in enumerate(parts) if r != rank)
    stats.add(coded_bytes_in=sent * parts[rank].element_size(), coded_bytes_out=sum(f.numel() for f in frames))
    return frames


def _reduce_shard(received, own: torch.Tensor, codec, cast, stats, rank, world, workspace):
    """Decode the shards received for this rank's slot and sum them, with ``own``, in rank order.

    Args:
        received: the peers' frames by source rank (this rank's slot unused).
        own: this rank's contribution to its slot (in the buffer dtype).

    Returns:
        ``(float32 accumulator (or the buffer dtype's), None)`` or ``(None, error message)``;
        the caller divides (for an average) and rounds, with :func:`_round_into`.
    """
    n = own.numel()
    coded = cast if cast is not None else own.dtype
    acc = workspace.take("acc", n, _ACC_DTYPE.get(own.dtype, own.dtype), own.device)
    fused = own.device.type == "cpu" and acc.dtype == torch.float32 and coded in ACCUMULABLE_DTYPES
    try:
        for r in range(world):
            first = r == 0
            if r == rank:
                # every rank's contribution went through the cast
                add_into(acc, own if cast is None else own.to(cast), first, workspace)
            elif fused:
                decode_add(codec, received[r], n, coded, acc, first, stats)
            else:
                target = workspace.take("decoded", n, coded, own.device)
                add_into(acc, decode_part(codec, received[r], n, None, stats, out=target), first, workspace)
    except (FrameError, ValueError, TypeError) as exc:
        return None, f"shard {rank} from rank {r}: {exc}"
    return acc, None


class _Stage:
    """One stage in flight: to every peer, a phase-1 shard and/or a phase-2 frame.

    The size exchange that opens a stage carries, from every rank to every rank, the two
    frame sizes and the sender's error flag: a rank that failed earlier says so here,
    and every rank raises at the same stage, before any data moves. The sizes are a
    peer's claims: ``limits[r]`` bounds what rank r may send (the largest frames of the
    elements this rank expects from it), and a claim outside them is refused before
    anything is allocated for it. (A small slack, :data:`_CLAIM_SLACK`, lets a wrong but
    small frame through to the decoder's exact check, which every rank agrees on at the
    next stage; a refused claim fails this rank at once and its peers within the group's
    timeout.)
    """

    __slots__ = ("work", "recv", "splits", "send", "sizes", "p2_bytes")

    def __init__(
        self,
        p1: list[torch.Tensor] | None,
        p2: torch.Tensor | None,
        error: str | None,
        group,
        rank: int,
        world: int,
        device,
        limits: list[tuple[int, int]],
        workspace: Workspace | None = None,
        slot: int = 0,
    ):
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        self.p2_bytes = p2.numel() if p2 is not None else 0
        header = torch.zeros(world, 3, dtype=torch.int64)
        chunks = []
        for d in range(world):
            if d == rank:
                continue
            first = p1[d] if p1 is not None else empty
            second = p2 if p2 is not None else empty
            header[d, 0], header[d, 1] = first.numel(), second.numel()
            chunks += [first, second]
        header[:, 2] = 1 if error else 0
        sizes = torch.empty(world, 3, dtype=torch.int64, device=device)
        dist.all_to_all_single(sizes, header.to(device), group=group)
        sizes = sizes.cpu()
        if int(sizes[:, 2].max()):
            _raise_gathered(error, group, device)
        for r in range(world):
            a, b = int(sizes[r, 0]), int(sizes[r, 1])
            if r != rank and not (0 <= a <= limits[r][0] + _CLAIM_SLACK and 0 <= b <= limits[r][1] + _CLAIM_SLACK):
                raise CollectiveError(
                    f"compressed collective failed: rank {rank}: rank {r} announced frames of "
                    f"{a} and {b} bytes; what it may send here takes at most {limits[r][0]} and "
                    f"{limits[r][1]} (+{_CLAIM_SLACK})"
                )
        self.sizes = sizes
        send_splits = [0 if d == rank else int(header[d, 0] + header[d, 1]) for d in range(world)]
        self.splits = [0 if r == rank else int(sizes[r, 0] + sizes[r, 1]) for r in range(world)]
        # Reused buffers (fresh ones cost page faults): a stage's receive buffer is read
        # while the next two stages fly, hence three slots; its send buffer until it completes.
        workspace = workspace if workspace is not None else Workspace()
        self.send = torch.cat(chunks, out=workspace.take(f"send{slot % 2}", sum(send_splits), torch.uint8, device))
        self.recv = workspace.take(f"recv{slot % 3}", sum(self.splits), torch.uint8, device)
        self.work = dist.all_to_all_single(
            self.recv,
            self.send,
            output_split_sizes=self.splits,
            input_split_sizes=send_splits,
            group=group,
            async_op=True,
        )

    def received(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Wait; return the phase-1 and phase-2 frames by source rank (own slots empty)."""
        self.work.wait()
        p1, p2 = [], []
        for r, part in enumerate(torch.split(self.recv, self.splits)):
            a = int(self.sizes[r, 0])
            p1.append(part[:a])
            p2.append(part[a:])
        return p1, p2


def pieces(numel: int, world: int) -> list[tuple[int, int]]:
    """Split a buffer into up to MAX_PIECES pieces of at least MIN_PIECE_ELEMS elements per rank.

    ``world`` is the number of shards a piece is cut into (an all-reduce's ranks; 1 for
    a reduce-scatter's or all-gather's slot, which travels whole). Pieces pipeline the
    phases: piece p+1 is coded while piece p is on the wire.
    """
    count = max(1, min(MAX_PIECES, numel // (MIN_PIECE_ELEMS * world)))
    return [(k * numel // count, (k + 1) * numel // count) for k in range(count)]


def plain_wire_bytes(collective: str, numel: int, itemsize: int, world: int, rank: int, dst: int | None = None) -> int:
    """Return the bytes a plain collective puts on the wire from ``rank``: what its coded twin counts as coded_bytes_in.

    Args:
        collective: "all_reduce" (``numel``: the buffer), "reduce_scatter" (the input
            of W rows), "all_gather" (this rank's shard) or "reduce" (the buffer, to ``dst``).
        numel: the tensor's elements and element size.
        itemsize: the tensor's elements and element size.
        world: the group's size and this rank in it.
        rank: the group's size and this rank in it.
        dst: the destination of a "reduce".

    Returns:
        The bytes (0 for a group of one).
    """
    if world <= 1:
        return 0
    if collective == "all_reduce":  # per piece: the others' shards out, this rank's reduced shard to each
        total = 0
        for a, b in pieces(numel, world):
            lo, hi = _shard_bounds(b - a, world)[rank]
            total += (b - a) - (hi - lo) + (world - 1) * (hi - lo)
        return total * itemsize
    if collective == "reduce_scatter":
        return (world - 1) * (numel // world) * itemsize
    if collective == "all_gather":
        return (world - 1) * numel * itemsize
    if collective == "reduce":
        return 0 if rank == dst else numel * itemsize
    raise ValueError(f"unknown collective {collective!r}")


def all_reduce(
    tensor: torch.Tensor,
    codec: Codec | None = None,
    group=None,
    *,
    average: bool = False,
    kind: str = "gradient",
    reduced_kind: str = "reduced_gradient",
    cast=None,
    stats: CommStats | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Sum (or average) a tensor across ranks, in place, sending Huffman-coded frames.

    Large tensors go in up to four pieces whose phases overlap: while one stage's
    frames are on the wire, the next piece is encoded, the previous one reduced and
    the one before decoded, so the link does not idle while ranks compute.

    Args:
        tensor: a contiguous CPU or CUDA tensor of a float dtype the codec supports;
            overwritten with the result.
        codec: the :class:`Codec` (same books on every rank); None uses default books.
        group: the process group (default: the world).
        average: divide the sum by the group size (as DDP's default hook does).
        kind: codebook kind for the input shards. Every collective that sums
            (all_reduce, reduce, reduce_scatter) defaults to "gradient"; every one that
            moves data unchanged (all_gather, send) to "activation". A frame carries its
            books, so a wrong kind costs bytes, never correctness.
        reduced_kind: codebook kind for the reduced shards.
        cast: a dtype (e.g. torch.bfloat16) the shards are cast to before coding —
            lossy, for users who accept bf16 communication; None is lossless.
        stats: a :class:`CommStats` to add traffic counts to.
        workspace: a :class:`Workspace` whose scratch buffers to reuse (callers that
            reduce again and again should keep one); None allocates per call.

    Returns:
        ``tensor``, holding the rank-order sum (or average): bit-identical on every rank.

    Raises:
        CollectiveError: on every rank, if any rank failed to decode a frame.
        TypeError, ValueError: bad arguments (same on every rank, raised before any
            communication).
    """
    flat = check_flat(tensor)
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    workspace = workspace if workspace is not None else Workspace()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        if cast is not None:
            flat.copy_(flat.to(cast))
        return tensor
    with stats.timer("comm_seconds"):
        with _failures_as_collective_errors():
            _StagedAllReduce(flat, codec, group, average, kind, reduced_kind, cast, stats, workspace, rank, world).run()
        stats.add(calls=1)
    return tensor


class _StagedAllReduce:
    """The pipeline of :func:`all_reduce`: stage s carries piece s's phase 1 and piece
    s-2's phase 2; during its flight piece s+1 is encoded, s-1 reduced, s-3 decoded."""

    def __init__(self, flat, codec, group, average, kind, reduced_kind, cast, stats, workspace, rank, world):
        self.flat, self.codec, self.group = flat, codec, group
        self.average, self.kind, self.reduced_kind, self.cast = average, kind, reduced_kind, cast
        self.stats, self.workspace, self.rank, self.world = stats, workspace, rank, world
        self.pieces = [flat[a:b] for a, b in pieces(flat.numel(), world)]
        self.bounds = [_shard_bounds(p.numel(), world) for p in self.pieces]
        self.error: str | None = None

    def run(self) -> None:
        count = len(self.pieces)
        outgoing = {0: self._encode_phase1(0)}  # piece -> phase-1 frames to send
        reduced = {}  # piece -> phase-2 frame to send
        inbox1, inbox2 = {}, {}  # piece -> frames received, by source rank
        for s in range(count + 2):
            p1 = s if s < count else None
            p2 = s - 2 if 0 <= s - 2 < count else None
            stage = None
            if p1 is not None or p2 is not None:
                stage = _Stage(
                    outgoing.pop(p1) if p1 is not None else None,
                    reduced.pop(p2) if p2 is not None else None,
                    self.error,
                    self.group,
                    self.rank,
                    self.world,
                    self.flat.device,
                    self._limits(p1, p2),
                    self.workspace,
                    s,
                )
                self._count_sent(p2, stage)
            # while the stage is on the wire:
            if s + 1 < count:
                outgoing[s + 1] = self._encode_phase1(s + 1)
            if 0 <= s - 1 < count:
                reduced[s - 1] = self._reduce(s - 1, inbox1.pop(s - 1))
            if 0 <= s - 3 < count:
                self._finish(s - 3, inbox2.pop(s - 3))
            if stage is not None:
                got1, got2 = stage.received()
                if p1 is not None:
                    inbox1[p1] = got1
                if p2 is not None:
                    inbox2[p2] = got2
        for k in sorted(inbox2):
            self._finish(k, inbox2.pop(k))
        _agree_on_errors(self.error, self.group, self.flat.device)

    def _limits(self, p1, p2) -> list[tuple[int, int]]:
        """The largest frames each peer may send at a stage: this rank's shard of piece p1,
        and the peer's own reduced shard of piece p2, in the coded dtype."""
        dtype = self.cast or self.flat.dtype
        mine = frame_bound(_width(self.bounds[p1][self.rank]), dtype) if p1 is not None else 0
        return [
            (mine, frame_bound(_width(self.bounds[p2][r]), dtype) if p2 is not None else 0) for r in range(self.world)
        ]

    def _encode_phase1(self, k: int) -> list[torch.Tensor]:
        piece = self.pieces[k]
        return _encode_each(
            [piece[lo:hi] for lo, hi in self.bounds[k]], self.codec, self.kind, self.cast, self.stats, self.rank
        )

    def _count_sent(self, p2, stage: _Stage) -> None:
        """Phase-1 bytes were counted when encoded; here the stage's sizes and phase 2."""
        sent = _STAGE_HEADER * (self.world - 1)
        bytes_in = 0
        if p2 is not None:
            lo, hi = self.bounds[p2][self.rank]
            bytes_in = (self.world - 1) * (hi - lo) * self.flat.element_size()
            sent += (self.world - 1) * stage.p2_bytes
        self.stats.add(coded_bytes_in=bytes_in, coded_bytes_out=sent)

    def _reduce(self, k: int, received) -> torch.Tensor:
        """Sum piece k's shard of this rank; write it in place and encode it for phase 2."""
        empty = torch.empty(0, dtype=torch.uint8, device=self.flat.device)
        if self.error:
            return empty
        lo, hi = self.bounds[k][self.rank]
        own = self.pieces[k][lo:hi]
        acc, failed = _reduce_shard(
            received, own, self.codec, self.cast, self.stats, self.rank, self.world, self.workspace
        )
        if failed:
            self.error = failed
            return empty
        if self.cast is None:  # rounded once to the buffer dtype; this rank's input is consumed
            round_into(own, acc, self.average, self.world)
            return encode_part(self.codec, own, self.reduced_kind, None, self.stats)
        rounded = self.workspace.take("rounded", hi - lo, self.cast, self.flat.device)
        round_into(rounded, acc, self.average, self.world)  # rounded once to the cast dtype: what all receive
        own.copy_(rounded)
        return encode_part(self.codec, rounded, self.reduced_kind, None, self.stats)

    def _finish(self, k: int, received) -> None:
        """Decode every owner's reduced shard of piece k into place."""
        if self.error:
            return
        piece = self.pieces[k]
        try:
            for r, (a, b) in enumerate(self.bounds[k]):
                if r != self.rank:
                    decode_part(self.codec, received[r], b - a, piece.dtype, self.stats, out=piece[a:b])
        except (FrameError, ValueError, TypeError) as exc:
            self.error = f"reduced shard from rank {r}: {exc}"


class _PipelinedPhase:
    """One phase of the two-phase protocol over pieces: stage k carries piece k's frames.

    :meth:`run` launches piece k's stage (its frames encoded just before, while piece
    k-1 was on the wire), then finishes piece k-1 (decodes, and sums or copies) while
    piece k is. A rank whose decode failed says so in the next stage's size exchange,
    so every rank raises at the same stage; the last piece's errors are agreed on at
    the end. Subclasses say what a piece sends (:meth:`_frames`) and what is done with
    what arrives (:meth:`_finish`).
    """

    def __init__(self, numel: int, codec, group, stats, workspace, rank, world, device):
        self.codec, self.group, self.stats, self.workspace = codec, group, stats, workspace
        self.rank, self.world, self.device = rank, world, device
        self.bounds = pieces(numel, 1)  # a slot travels whole to (or from) every peer
        self.error: str | None = None

    def run(self) -> None:
        if self.world == 1:  # nothing to send (and gloo rejects zero-element collectives)
            for k in range(len(self.bounds)):
                self._finish(k, [None], [None])
            return
        flying = None
        try:
            for k in range(len(self.bounds) + 1):
                stage = None
                if k < len(self.bounds):
                    p1, p2 = self._frames(k)
                    stage = _Stage(
                        p1,
                        p2,
                        self.error,
                        self.group,
                        self.rank,
                        self.world,
                        self.device,
                        self._limits(k),
                        self.workspace,
                        k,
                    )
                if flying is not None:
                    received = flying.received()
                    if not self.error:
                        self._finish(k - 1, *received)
                flying = stage
        except BaseException:
            # A peer's error flag raised at a stage: let the stage before it land first,
            # since its buffers are the workspace's, which the next call reuses.
            if flying is not None:
                with contextlib.suppress(Exception):
                    flying.work.wait()
            raise
        _agree_on_errors(self.error, self.group, self.device)

    def _frames(self, k: int):
        raise NotImplementedError

    def _limits(self, k: int) -> list[tuple[int, int]]:
        raise NotImplementedError

    def _finish(self, k: int, phase1: list[torch.Tensor], phase2: list[torch.Tensor]) -> None:
        raise NotImplementedError


class _StagedReduceScatter(_PipelinedPhase):
    """Phase 1 alone: piece k of every ``rows[r]`` goes to rank r, which sums them in rank order."""

    def __init__(self, out, rows, codec, group, average, kind, cast, stats, workspace, rank, world):
        super().__init__(out.numel(), codec, group, stats, workspace, rank, world, out.device)
        self.out, self.rows, self.average, self.kind, self.cast = out, rows, average, kind, cast

    def _limits(self, k: int) -> list[tuple[int, int]]:
        a, b = self.bounds[k]
        return [(frame_bound(b - a, self.cast or self.out.dtype), 0)] * self.world

    def _frames(self, k: int):
        a, b = self.bounds[k]
        self.stats.add(coded_bytes_out=_STAGE_HEADER * (self.world - 1))
        if self.error:  # the stage raises on every rank: nothing worth encoding
            return [torch.empty(0, dtype=torch.uint8, device=self.device)] * self.world, None
        return _encode_each(
            [row[a:b] for row in self.rows], self.codec, self.kind, self.cast, self.stats, self.rank
        ), None

    def _finish(self, k: int, phase1, phase2) -> None:
        a, b = self.bounds[k]
        acc, self.error = _reduce_shard(
            phase1, self.rows[self.rank][a:b], self.codec, self.cast, self.stats, self.rank, self.world, self.workspace
        )
        if self.error:
            return
        target = self.out[a:b]
        if self.cast is None:
            round_into(target, acc, self.average, self.world)
        else:  # rounded once to the cast dtype, then widened back
            rounded = self.workspace.take("rounded", b - a, self.cast, self.device)
            target.copy_(round_into(rounded, acc, self.average, self.world))


class _StagedAllGather(_PipelinedPhase):
    """Phase 2 alone: piece k of this rank's ``flat`` goes to every peer, decoded into its slot."""

    def __init__(self, outputs, flat, codec, group, kind, stats, workspace, rank, world):
        super().__init__(flat.numel(), codec, group, stats, workspace, rank, world, flat.device)
        self.outputs, self.flat, self.kind = outputs, flat, kind

    def _limits(self, k: int) -> list[tuple[int, int]]:
        a, b = self.bounds[k]
        return [(0, frame_bound(b - a, self.flat.dtype))] * self.world

    def _frames(self, k: int):
        a, b = self.bounds[k]
        if self.error:
            frame = torch.empty(0, dtype=torch.uint8, device=self.device)
        else:
            frame = encode_part(self.codec, self.flat[a:b], self.kind, None, self.stats)
        self.stats.add(
            coded_bytes_in=(self.world - 1) * (b - a) * self.flat.element_size(),
            coded_bytes_out=(self.world - 1) * (frame.numel() + _STAGE_HEADER),
        )
        return None, frame

    def _finish(self, k: int, phase1, phase2) -> None:
        a, b = self.bounds[k]
        try:
            for r in range(self.world):
                if r != self.rank:
                    decode_part(self.codec, phase2[r], b - a, self.flat.dtype, self.stats, out=self.outputs[r][a:b])
        except (FrameError, ValueError, TypeError) as exc:
            self.error = f"frame from rank {r}: {exc}"


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    codec: Codec | None = None,
    group=None,
    *,
    average: bool = False,
    kind: str = "gradient",
    cast=None,
    stats: CommStats | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Reduce ``input_list[r]`` over all ranks into rank r's ``output``, coded.

    Large tensors go in up to four pieces, pipelined as in :func:`all_reduce`: piece
    k+1 is encoded while piece k is on the wire, and piece k-1 is summed meanwhile.
    The inputs are read in place (rows of one buffer, e.g. FSDP's, are not copied).

    Args:
        output: contiguous tensor, same numel and dtype as each input; overwritten.
        input_list: one tensor per rank (all the same numel and dtype).
        codec: as for :func:`all_reduce`.
        group: as for :func:`all_reduce`.
        kind: as for :func:`all_reduce`; defaults to "gradient", as for every collective that sums.
        cast: as for :func:`all_reduce`.
        stats: as for :func:`all_reduce`.
        workspace: as for :func:`all_reduce`.
        average: divide by the group size.

    Returns:
        ``output``: the rank-order sum (or average) of every rank's ``input_list[rank]``,
        in float32, rounded to the dtype once (to the cast dtype first, with ``cast``).

    Raises:
        CollectiveError: on every rank, if any rank failed to decode.
        ValueError: wrong number of inputs or mismatched sizes.
    """
    out = check_flat(output, "output")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if len(input_list) != world:
        raise ValueError(f"input_list needs one tensor per rank ({world}), got {len(input_list)}")
    if any(t.numel() != out.numel() or t.dtype != out.dtype for t in input_list):
        raise ValueError("every input must match output's numel and dtype")
    codec = codec or Codec()
    stats = stats if stats is not None else CommStats()
    workspace = workspace if workspace is not None else Workspace()
    rows = [t.reshape(-1) for t in input_list]
    with stats.timer("comm_seconds"):
        with _failures_as_collective_errors():
            _StagedReduceScatter(out, rows, codec, group, average, kind, cast, stats, workspace, rank, world).run()
        stats.add(calls=1)
    return output


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    codec: Codec | None = None,
    group=None,
    *,
    kind: str = "activation",
    stats: CommStats | None = None,
    workspace: Workspace | None = None,
) -> list[torch.Tensor]:
    """Gather every rank's ``tensor`` into ``tensor_list``, coded; mirrors dist.all_gather.

    Large tensors go in up to four pieces, pipelined: piece k+1 is encoded while piece
    k is on the wire, and piece k-1 decoded meanwhile. ``tensor`` may be this rank's
    own slot of the output (FSDP gathers in place); it is then left as it is.

    Args:
        tensor_list: one output tensor per rank (same numel and dtype as ``tensor``).
        tensor: this rank's contribution.
        codec: as for :func:`all_reduce`.
        group: as for :func:`all_reduce`.
        kind: as for :func:`all_reduce`.
        stats: as for :func:`all_reduce`.
        workspace: as for :func:`all_reduce`.

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
    workspace = workspace if workspace is not None else Workspace()
    outputs = [t.view(-1) for t in tensor_list]
    with stats.timer("comm_seconds"):
        stats.add(calls=1)
        with _failures_as_collective_errors():
            _StagedAllGather(outputs, flat, codec, group, kind, stats, workspace, rank, world).run()
        if outputs[rank].data_ptr() != flat.data_ptr():
            outputs[rank].copy_(flat)
    return tensor_list


def on_cuda_worker(device: torch.device, ready, fn):
    """Run ``fn`` on a worker thread for CUDA tensors: after ``ready``, finished on return.

    The DDP hook and FSDP2 run their coded collectives on a worker thread, which has its
    own current device and stream. It waits on the device for the caller's event (the
    tensor may still be being written on the caller's stream: no host sync), and
    synchronizes its stream before returning: the caller's future (DDP) or Work (FSDP)
    is not stream-aware, so the tensor must be complete when it resolves.

    Args:
        device: the tensors' CUDA device.
        ready: a ``torch.cuda.Event`` recorded on the caller's stream.
        fn: the collective, a callable without arguments.

    Returns:
        What ``fn`` returns.
    """
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        stream.wait_event(ready)
        result = fn()
        stream.synchronize()
    return result


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


def row_parallel_all_reduce(
    x: torch.Tensor, codec: Codec | None = None, group=None, stats: CommStats | None = None
) -> torch.Tensor:
    """All-reduce a row-parallel linear's partial output, coded, differentiably.

    In Megatron-style tensor parallelism the row-parallel layer's forward ends with an
    all-reduce (sum) and its backward needs none; this is that all-reduce with coded
    activations. See ``launch_scripts/tensor_parallel_example.py``.

    Args:
        x: this rank's partial output.
        codec: as for :func:`all_reduce`.
        group: as for :func:`all_reduce`.
        stats: as for :func:`all_reduce`.

    Returns:
        The sum over ranks, with autograd passing the gradient through unchanged.
    """
    return _RowParallelAllReduce.apply(x, codec or Codec(), group, stats)
