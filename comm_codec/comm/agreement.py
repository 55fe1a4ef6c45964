"""Cross-rank agreement: every small collective by which ranks compare notes, in one place.

Coded collectives only work if every rank issues the same collectives in the same order
with the same books. Whenever ranks must agree -- on their settings, their books, an
error, a decision, the statistics books are built from -- they do it through the
functions here, so that there is one rule for where the small tensors live, one for
what a peer may send, and one for how long a rank waits.

* **Where**: :func:`collective_device` -- NCCL moves CUDA tensors only, so agreement
  tensors go to the current CUDA device there and stay on the CPU for every other
  backend (gloo, mpi, and gloo+nccl mixes, which route CPU tensors to gloo).
* **What**: fixed-layout tensors only. Text (settings, book listings, error messages) is
  UTF-8 in a padded uint8 tensor, its length exchanged first and bounded by
  :data:`MAX_MESSAGE_BYTES`; nothing a peer sends is ever unpickled (a pickle from a
  peer can run code on the receiver).
* **How long**: :func:`twin_group` makes the package's own process groups with the
  timeout of the group they twin, so a stalled peer fails an agreement as soon as it
  would fail the user's own collective.
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import torch
import torch.distributed as dist

from ..books.profiler import ProfileStatistics, WarmupProfiler
from ..core._json import loads as json_loads
from ..core.codebooks import CodebookSet, as_codebook_set
from ..core.errors import AgreementError, CollectiveError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "build_books",
    "check_same_books",
    "check_same_settings",
    "collective_device",
    "gather_rows",
    "gather_texts",
    "group_timeout",
    "is_initialized",
    "peer_json",
    "max_over_ranks",
    "ranks_per_node",
    "rank_of",
    "sum_statistics",
    "twin_group",
]

# Most bytes one rank's message may hold: settings, a book listing, an error. A peer
# announcing more is refused before anything is allocated for it.
MAX_MESSAGE_BYTES = 1 << 20
# What parsing one peer's message may hold (core._json.estimate): 1 MiB of "[{},{},...]"
# is ~80 MB of objects, a real message a few kB.
_MAX_PEER_PARSE = 128 << 20


def is_initialized() -> bool:
    """Whether a default process group exists (False where torch has no distributed support)."""
    return dist.is_available() and dist.is_initialized()


def rank_of(group=None) -> int:
    """This process's rank in ``group``, or 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


def collective_device(group=None, like: torch.Tensor | None = None) -> torch.device:
    """Return where a small agreement tensor for ``group`` must live.

    Args:
        group: the process group (None: the default one).
        like: a data tensor the agreement belongs to; a CUDA tensor's device wins (its
            collectives run on NCCL).

    Returns:
        The current CUDA device for an NCCL-only group or a CUDA ``like``, else the CPU.
    """
    if like is not None and like.is_cuda:
        return like.device
    if not is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and "mpi" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_timeout(group):
    """Return the timeout of ``group``'s backend for its default device, or None if unknown."""
    try:
        return group._get_backend(group._device_types[0]).options._timeout
    except (AttributeError, IndexError, RuntimeError, ValueError):  # no such backend options: torch's default
        return None


def twin_group(group=None, ranks=None):
    """Create a process group over the ranks of ``group``, with its timeout (collective).

    The package runs its collectives on groups of its own: two threads' collectives on
    one group (DDP's autograd thread and our worker, say) may be ordered differently on
    each rank. torch gives a new group 30 minutes; the twin gets the original's timeout,
    so a stalled peer raises as soon as it would in the user's own collectives.

    Args:
        group: the group to twin (None: the world); its timeout is the twin's.
        ranks: the twin's ranks, where they are not ``group``'s (a rank creating a group
            it is not in, as creating groups requires of every rank).

    Returns:
        The new group. Every rank of the world must call this at the same point.
    """
    base = group or dist.group.WORLD
    members = list(ranks) if ranks is not None else dist.get_process_group_ranks(base)
    return dist.new_group(ranks=members, timeout=group_timeout(base))


def gather_rows(values: list[float], group=None, device=None) -> list[list[float]]:
    """All-gather one row of float64 values per rank (every rank gets the same rows).

    Args:
        values: this rank's row; every rank must send a row of the same length.
        group: the process group (without one initialized: just this row).
        device: the agreement tensor's device (:func:`collective_device`).

    Returns:
        One list per rank, in rank order.
    """
    row = torch.tensor(values, dtype=torch.float64, device=device)
    if not is_initialized() or dist.get_world_size(group) == 1:
        return [row.tolist()]
    out = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, row, group=group)
    return [t.tolist() for t in out]


def max_over_ranks(value: float, group=None, device=None) -> float:
    """Return the largest of every rank's ``value`` (one float64 all-reduce)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def gather_texts(text: str, group=None, device=None, limit: int = MAX_MESSAGE_BYTES) -> list[str]:
    """All-gather one UTF-8 string per rank, as bytes in a padded tensor (never a pickle).

    Args:
        text: this rank's message.
        group: the process group.
        device: the agreement tensors' device.
        limit: the most bytes a rank's message may hold.

    Returns:
        Every rank's message, in rank order.

    Raises:
        ValueError: this rank's message is over ``limit``.
        AgreementError: a peer announced a length outside 0..``limit`` (every rank alike:
            they all see the same lengths).
    """
    data = text.encode("utf-8", "replace")
    if len(data) > limit:
        raise ValueError(f"agreement message of {len(data)} bytes is over the {limit}-byte limit")
    if not is_initialized() or dist.get_world_size(group) == 1:
        return [data.decode("utf-8")]
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    parts = _gather_uneven(mine, limit, "a {}-byte message", group, device)
    return [bytes(p.numpy()).decode("utf-8", "replace") for p in parts]


def check_same_settings(owner: str, settings: dict, group=None, device=None) -> list[str]:
    """Raise the same AgreementError on every rank if the ranks' settings differ (collective).

    Ranks configured differently would issue collectives that do not match and wait on
    each other forever; comparing first turns that into one clear error everywhere.

    Args:
        owner: what the settings belong to, for the message ("HuffmanState").
        settings: JSON-serializable values that change which collectives a rank issues.
        group: the process group.
        device: the agreement tensors' device.

    Returns:
        Every rank's host name, in rank order (for the ranks-per-node count).

    Raises:
        AgreementError: on every rank, naming the first setting that differs and its values.
    """
    mine = json.dumps({"settings": settings, "host": socket.gethostname()}, sort_keys=True)
    seen = []
    for r, text in enumerate(gather_texts(mine, group, device)):
        entry = peer_json(text, f"comm_codec agreement: rank {r} sent settings that are not JSON")
        if not isinstance(entry, dict) or not isinstance(entry.get("settings", {}), dict):
            raise AgreementError(f"comm_codec agreement: rank {r} sent settings that are not a JSON object")
        seen.append(entry)
    first = seen[0].get("settings", {})
    for rank, entry in enumerate(seen):
        theirs = entry.get("settings", {})
        for name in sorted(set(first) | set(theirs)):
            if theirs.get(name) != first.get(name):
                raise AgreementError(
                    f"{owner} differs across ranks: {name} is {first.get(name)!r} on rank 0 but "
                    f"{theirs.get(name)!r} on rank {rank}; give every rank the same settings"
                )
    return [str(entry.get("host", "")) for entry in seen]


def peer_json(text: str, what: str):
    """Parse JSON a peer sent, sized before parsing (:func:`comm_codec.core._json.loads`).

    Args:
        text: the message, as :func:`gather_texts` returned it.
        what: the error's first words ("rank 1 sent settings that are not JSON").

    Returns:
        The parsed value (its type is the caller's to check).

    Raises:
        CollectiveError: ``"<what> (<reason>)"``: malformed, nested too deeply, or too
            large to parse.
    """
    return json_loads(text, limit=_MAX_PEER_PARSE, error=lambda reason: CollectiveError(f"{what} ({reason})"))


def ranks_per_node(hosts: list[str]) -> int:
    """The ranks that share this node: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else counted by host name."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    return local or max(1, sum(h == socket.gethostname() for h in hosts))


def check_same_books(books: CodebookSet, group=None, device=None) -> None:
    """Verify that every rank holds the same codebook set; every rank must call it.

    Args:
        books: this rank's set (or a path to one; None: the defaults).
        group: the group to check over (default: the world).
        device: the agreement tensors' device.

    Raises:
        AgreementError: the sets differ; the message names the ranks and the first
            (kind, dtype, stream) whose book differs, on every rank.
    """
    books = as_codebook_set(books)
    listing = "\n".join("%s/%s/%d=%s" % (*k, g.id) for k, g in books.groups())
    seen = gather_texts(books.digest + "\n" + listing, group, device)
    if len(set(seen)) == 1:
        return
    mine = dict(line.split("=", 1) for line in seen[0].splitlines()[1:] if "=" in line)
    for rank, other in enumerate(seen):
        theirs = dict(line.split("=", 1) for line in other.splitlines()[1:] if "=" in line)
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                raise AgreementError(
                    f"codebooks differ across ranks: {key} is {mine.get(key, 'missing')} on rank 0 "
                    f"but {theirs.get(key, 'missing')} on rank {rank}; load the same codebook file on "
                    "every rank or build them with comm_codec.comm.agreement.build_books(profiler, group)"
                )
    raise AgreementError("codebook set digests differ across ranks")


def sum_statistics(stats: ProfileStatistics, group=None, device=None) -> ProfileStatistics:
    """Sum every rank's profiling statistics (collective): the same result on every rank.

    The averaged distributions and observation counts are all-reduced; the kept chunk
    histograms are all-gathered in rank order, each rank sending its share of the row
    budget, so the gathered rows stay bounded however many ranks there are.

    Args:
        stats: this rank's :meth:`WarmupProfiler.statistics`.
        group: the process group.
        device: the agreement tensors' device.

    Returns:
        The summed statistics, with ``world_size`` set.

    Raises:
        AgreementError: ranks observed different (kind, dtype) pairs (on every rank).
    """
    if not is_initialized():
        return stats
    world = dist.get_world_size(group)
    keys = sorted(stats.sums)
    seen = gather_texts(";".join("%s/%s" % k for k in keys), group, device)
    if len(set(seen)) != 1:
        raise AgreementError(
            "ranks observed different tensor kinds/dtypes before building books: "
            + " | ".join(f"rank {r}: {s or '(none)'}" for r, s in enumerate(seen))
        )
    sums = {}
    for k in keys:
        dist_sum, n_obs, raw = stats.sums[k]
        packed = torch.from_numpy(np.concatenate([dist_sum.ravel(), [n_obs], raw.ravel().astype(np.float64)]))
        packed = packed.to(device)
        dist.all_reduce(packed, group=group)
        arr = packed.cpu().numpy()
        ns = dist_sum.shape[0]
        sums[k] = (arr[: ns * 256].reshape(ns, 256), float(arr[ns * 256]), arr[ns * 256 + 1 :].reshape(ns, 256))
    rows = stats.rows
    if stats.rows_wanted:
        share = max(1, -(-stats.max_rows // world))
        rows = {k: _gather_chunk_rows(stats.merged_rows(k, share), share, group, device) for k in keys}
    return ProfileStatistics(sums, rows, stats.max_rows, stats.rows_wanted, world)


def build_books(profiler: WarmupProfiler, group=None, meta: dict | None = None, device=None) -> CodebookSet:
    """Build books from every rank's statistics (collective): byte-identical on every rank.

    Args:
        profiler: this rank's profiler (every rank must have observed the same
            (kind, dtype) pairs).
        group: the process group.
        meta: extra metadata for the set.
        device: the agreement tensors' device.

    Returns:
        The books.
    """
    summed = sum_statistics(profiler.statistics(), group, device if device is not None else collective_device(group))
    return profiler.build(meta=meta, statistics=summed)


def _gather_chunk_rows(rows: np.ndarray, limit: int, group, device) -> np.ndarray:
    """All ranks' chunk histograms, in rank order (the same array on every rank)."""
    parts = _gather_uneven(
        torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), limit, "{} chunk histograms", group, device
    )
    return np.concatenate([p.numpy() for p in parts])


def _gather_uneven(mine: torch.Tensor, limit: int, what: str, group, device) -> list[torch.Tensor]:
    """All-gather a tensor whose first dimension differs by rank, in rank order, on the CPU.

    The lengths travel first and are claims: one outside 0..``limit`` is refused (on every
    rank alike) before anything is allocated for it. ``what`` names one rank's part in that
    message, with ``{}`` for its length.
    """
    world = dist.get_world_size(group)
    n = torch.tensor([mine.shape[0]], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    lengths = [int(s.item()) for s in sizes]
    bad = [(r, k) for r, k in enumerate(lengths) if not 0 <= k <= limit]
    if bad:
        raise AgreementError(
            "comm_codec agreement: "
            + ", ".join(f"rank {r} announced " + what.format(k) for r, k in bad)
            + f" (at most {limit})"
        )
    longest = max(1, max(lengths))  # never a zero-element collective (gloo rejects them)
    padded = torch.zeros((longest,) + tuple(mine.shape[1:]), dtype=mine.dtype)
    padded[: mine.shape[0]] = mine
    padded = padded.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p.cpu()[:k] for p, k in zip(parts, lengths)]
