"""Read a DCP ``.metadata`` file that nobody vouches for: an allow-list unpickler and the checks after it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load``: a crafted file
runs code. Here only DCP's metadata classes, torch dtypes and a few value constructors
are reachable, and none of those can make its output larger than its input: a pickle
can name the same object many times for two bytes (a memo reference), so a callable that
copies or concatenates its arguments (``pathlib.PosixPath(p, p)``, ``OrderedDict(d)``,
``torch.Size(t)``) would let 330 bytes grow to gigabytes. Paths come back as plain
strings built from string parts, sizes from at most :data:`MAX_DIMS` plain ints, ordered
dicts only empty (their items arrive as pickle opcodes, which cost bytes).

After unpickling, every field reading relies on is checked (a ``BUILD`` opcode can give
any allowed object any attributes), and the chunks of every tensor must tile it: no
overlaps, no repeats, full coverage; a metadata file that lists one 128 MB chunk 6,000
times would otherwise make the planner read and decode it 6,000 times.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..core.errors import CheckpointError
from ..core.quoting import printable

__all__ = ["MAX_DIMS", "MAX_METADATA_BYTES", "METADATA_NAME", "open_regular", "plain_name", "read_metadata"]

# Largest .metadata read: DCP writes ~300 bytes per tensor chunk.
MAX_METADATA_BYTES = 1 << 30
METADATA_NAME = ".metadata"  # FileSystemWriter's name for it
# Most dimensions a tensor of a checkpoint has (torch itself allows 64).
MAX_DIMS = 64
# A checkpoint path as StorageMeta.checkpoint_id records it: at most this many characters.
_MAX_PATH_CHARS = 4096
# Pairs of chunks compared when checking that a tensor's chunks do not overlap (after
# sorting along the dimension that separates them best, a real sharding compares few).
_MAX_CHUNK_PAIRS = 1 << 24
_PAIR_BATCH = 1 << 20


def _path(*parts) -> str:
    """``pathlib.PosixPath(*parts)`` as metadata pickles hold it: string parts only, joined."""
    if (
        not 1 <= len(parts) <= _MAX_PATH_CHARS
        or not all(type(p) is str for p in parts)
        or sum(map(len, parts)) > _MAX_PATH_CHARS
    ):
        raise pickle.UnpicklingError("a checkpoint path that is not a few strings")
    return os.path.join(*parts)


def _size(dims=()) -> torch.Size:
    """``torch.Size(dims)`` for a tuple or list of at most MAX_DIMS non-negative ints."""
    if (
        type(dims) not in (tuple, list)
        or len(dims) > MAX_DIMS
        or not all(type(d) is int and 0 <= d < 1 << 62 for d in dims)
    ):
        raise pickle.UnpicklingError("a tensor size that is not a few non-negative ints")
    return torch.Size(dims)


def _ordered_dict(*args):
    """An empty OrderedDict (a pickled one gets its items from SETITEMS opcodes)."""
    if args:
        raise pickle.UnpicklingError("an OrderedDict built from an argument")
    return __import__("collections").OrderedDict()


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name):
    """``torch.serialization._get_layout``: a layout by its name (``"torch.strided"``)."""
    found = _LAYOUTS.get(name) if type(name) is str else None
    if found is None:
        raise pickle.UnpicklingError("a tensor layout that torch does not have")
    return found


_GLOBALS = {
    **{
        ("torch.distributed.checkpoint.metadata", c.__name__): c
        for c in (
            Metadata,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            MetadataIndex,
            StorageMeta,
            _MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): _size,
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch.serialization", "_get_layout"): _layout,
    # pathlib's classes as Python 3.11-3.12 (pathlib) and 3.13+ (pathlib._local) pickle them
    **{
        (module, name): _path
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")
    },
}


class _MetadataUnpickler(pickle._Unpickler):  # pickle's pure-Python unpickler, on purpose
    """Unpickle DCP metadata: its own classes, torch dtypes, sizes, paths as strings; nothing else.

    Python's own unpickler, not the C one: the C unpickler keeps its memo in an array that a
    5-byte ``LONG_BINPUT 2**31`` resizes to that index (zero-filled: 16 GB), and it allocates
    a ``BINBYTES8`` / ``BYTEARRAY8`` of the claimed length before reading it; the Python one
    keeps the memo in a dict and reads only the bytes there are. It is about 2.3x slower on
    a large ``.metadata`` (160,000 chunks), a price paid once per load.
    """

    def find_class(self, module, name):
        found = _GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refers to {printable(module, 60)}.{printable(name, 60)}, which DCP metadata never holds"
        )

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("holds a persistent id, which DCP metadata never holds")


def open_regular(path: str):
    """Open a regular file for reading (checked before and after open: a FIFO would block)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    fh = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        fh.close()
        raise CheckpointError(f"{path} is not a regular file")
    return fh


def plain_name(name) -> bool:
    """Whether a recorded file name is one file inside the checkpoint directory."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and name != METADATA_NAME
    )


def read_metadata(directory) -> Metadata:
    """Read and check the ``.metadata`` of a DCP directory.

    Args:
        directory: the checkpoint directory.

    Returns:
        Its :class:`Metadata`, every field reading relies on checked; ``storage_meta``
        is a :class:`StorageMeta` (a new one if the file had none).

    Raises:
        CheckpointError: no such file, not a regular file, larger than
            :data:`MAX_METADATA_BYTES`, a pickle that refers to anything but DCP's
            metadata classes, or records that point outside the directory, chunks that
            do not tile their tensor.
    """
    path = os.path.join(os.fspath(directory), METADATA_NAME)
    try:
        with open_regular(path) as fh:
            raw = fh.read(MAX_METADATA_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file: {os.fspath(directory)} is not a DCP checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_METADATA_BYTES} bytes: not DCP metadata")
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - a crafted pickle raises whatever its opcodes provoke
        raise CheckpointError(
            f"{path}: not DCP metadata, or truncated or tampered ({type(exc).__name__}: {printable(str(exc), 160)})"
        ) from None
    check_metadata(md, path)
    if md.storage_meta is None:
        md.storage_meta = StorageMeta()
    return md


def _is_int(x) -> bool:
    return type(x) is int


def _check_size(x, ndim: int | None = None) -> bool:
    return isinstance(x, torch.Size) and (ndim is None or len(x) == ndim) and all(_is_int(d) and d >= 0 for d in x)


_MISSING = object()


def check_metadata(md, path: str) -> None:
    """Check every field of unpickled metadata that reading relies on; CheckpointError if not."""

    def bad(what):
        raise CheckpointError(f"{path}: not a DCP checkpoint's metadata ({what})")

    def field(obj, name):
        value = getattr(obj, name, _MISSING)
        if value is _MISSING:
            bad(f"a {type(obj).__name__} without {name}")
        return value

    if type(md) is not Metadata:
        bad(f"holds a {type(md).__name__}")
    entries, records, meta = field(md, "state_dict_metadata"), field(md, "storage_data"), field(md, "storage_meta")
    if type(entries) is not dict or type(records) is not dict:
        bad("no state_dict_metadata or storage_data mapping")
    if meta is not None:
        if type(meta) is not StorageMeta:
            bad(f"storage_meta is a {type(meta).__name__}")
        for name in ("checkpoint_id", "save_id", "load_id"):
            if not isinstance(field(meta, name), (str, type(None))):
                bad(f"storage_meta.{name} is not a string")
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            bad("a key that is not a string")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            bad(f"entry {printable(fqn, 80)} is a {type(entry).__name__}")
        props, size, chunks = field(entry, "properties"), field(entry, "size"), field(entry, "chunks")
        if (
            type(props) is not TensorProperties
            or not isinstance(field(props, "dtype"), torch.dtype)
            or not _check_size(size)
            or type(chunks) is not list
        ):
            bad(f"entry {printable(fqn, 80)} is malformed")
        for chunk in chunks:
            if (
                type(chunk) is not ChunkStorageMetadata
                or not _check_size(field(chunk, "offsets"), len(size))
                or not _check_size(field(chunk, "sizes"), len(size))
                or any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size))
            ):
                bad(f"entry {printable(fqn, 80)} has a chunk outside its tensor {tuple(size)}")
        why = _tiling_problem(size, chunks)
        if why:
            bad(f"the chunks of entry {printable(fqn, 80)} do not tile its tensor {tuple(size)}: {why}")
    for index, info in records.items():
        if type(index) is not MetadataIndex or type(field(index, "fqn")) is not str or index.fqn not in entries:
            bad("a storage record for no entry")
        if (
            type(info) is not _StorageInfo
            or not plain_name(field(info, "relative_path"))
            or not (
                _is_int(field(info, "offset"))
                and _is_int(field(info, "length"))
                and info.offset >= 0
                and info.length >= 0
            )
        ):
            bad(
                f"the storage record of {printable(index.fqn, 80)} is malformed (a file name must name a file "
                "in the checkpoint directory)"
            )
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            type(descriptors) in (list, tuple)
            and len(descriptors) <= 8
            and all(type(d) is str and len(d) <= 256 for d in descriptors)
        ):
            bad(f"the storage record of {printable(index.fqn, 80)} has malformed transforms")


def _tiling_problem(size, chunks) -> str:
    """Why chunks (each inside the tensor) do not tile a tensor of size; "" when they do.

    Tiling: distinct offsets, element counts that sum to the tensor's, and no two chunks
    with elements in common (then they cover it). Overlaps are looked for along the
    dimension with the most distinct chunk starts, comparing each chunk only with those
    that start before it ends there.
    """
    total = math.prod(size)
    if len({tuple(c.offsets) for c in chunks}) != len(chunks):
        return "a chunk is listed twice"
    if sum(math.prod(c.sizes) for c in chunks) != total:
        return "their elements do not add up to the tensor's"
    if total == 0 or len(size) == 0:
        return ""
    full = [c for c in chunks if math.prod(c.sizes) > 0]
    if len(full) < 2:
        return ""
    starts = np.array([list(c.offsets) for c in full], dtype=np.int64)
    ends = starts + np.array([list(c.sizes) for c in full], dtype=np.int64)
    dim = max(range(len(size)), key=lambda d: len(np.unique(starts[:, d])))
    order = np.argsort(starts[:, dim], kind="stable")
    starts, ends = starts[order], ends[order]
    # chunk i can overlap only chunks i+1 .. hi[i]-1: those that start before it ends along dim
    hi = np.searchsorted(starts[:, dim], ends[:, dim], side="left")
    counts = np.maximum(hi - np.arange(len(full)) - 1, 0)
    if int(counts.sum()) > _MAX_CHUNK_PAIRS:
        return f"{len(full)} chunks that overlap along every dimension"
    first = 0
    while first < len(full):
        last, pairs = first, 0
        while last < len(full) and (pairs == 0 or pairs + counts[last] <= _PAIR_BATCH):
            pairs += int(counts[last])
            last += 1
        i = np.repeat(np.arange(first, last), counts[first:last])
        if i.size:
            within = np.arange(i.size) - np.repeat(
                np.cumsum(counts[first:last]) - counts[first:last], counts[first:last]
            )
            j = i + 1 + within
            overlap = np.all(np.maximum(starts[i], starts[j]) < np.minimum(ends[i], ends[j]), axis=1)
            if overlap.any():
                return "two chunks overlap"
        first = last
    return ""
