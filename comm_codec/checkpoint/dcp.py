"""torch.distributed.checkpoint (DCP) storage that keeps tensor data as codec frames.

``dcp.save(sd, storage_writer=Writer(path))`` and ``dcp.load(sd, storage_reader=Reader(path))``
write and read an ordinary DCP directory (``.metadata`` plus one ``__<rank>_0.distcp``
file per rank) in which every tensor of a dtype the codec supports is one frame, coded
with books chosen for it (tensors under 16 Ki elements: a range of one pack frame per
dtype and kind), and everything else (other dtypes, non-tensor values) is stored as
:class:`FileSystemWriter` stores it.

**Why a writer and not an extension.** DCP's extension seam
(``StreamTransformExtension``, as its ``ZStandard``) transforms the byte stream of each
write item: for a tensor that is ``torch.save``'s zip of it, with no dtype in sight, so
it could only code bytes as zstd does. A ``StorageWriter`` gets the ``WriteItem`` (its
fully qualified name and tensor properties) and the tensor itself, so it can split
each element into its byte streams and code weights and optimizer state with their own
books, exactly as ``comm-codec compress`` does. :class:`Writer` subclasses
:class:`FileSystemWriter` for everything but the data files (planning, staging for
``dcp.async_save``, the ``.metadata`` file) and :class:`Reader` subclasses
:class:`FileSystemReader` likewise; both are plain DCP storage, so resharding and
``async_save`` work as with DCP's own.

**Books.** Each tensor's books are chosen as the file compressor chooses them
(:mod:`comm_codec.checkpoint.plan`): from a sample of its chunks, the shipped weight or
optimizer-state books, books of its own, or raw, by expected size. A tensor whose name
differs from an earlier one's only in its numbers (``layer.3.mlp.weight`` after
``layer.0.mlp.weight``), of the same shape and dtype, is coded with that tensor's plan
first and keeps the frame if it comes out within 2 % of that tensor's frame in size;
otherwise it is planned itself. Small tensors are packed, in the order they come, into
frames of the shipped books (at most 1 Mi elements each). A data file ends
with a book table (JSON) and a fixed trailer: the books of its own that its frames
use, the groups they form, and the digest of the shipped set; shipped books are named
by id only. Frames name their books by id, so a frame decodes only with the very books
it was made with.

**Records.** Each frame's entry in ``.metadata`` is DCP's own per-item record with the
transform descriptor :data:`FRAME_DESCRIPTOR`; a packed tensor's record is its pack
frame's place with the descriptors :data:`PACK_DESCRIPTOR` and
``"elements=<start>+<count>"``. A plain ``FileSystemReader`` refuses such a directory with
"Unknown extension" instead of misreading frames as ``torch.save`` data.

**Untrusted directories.** DCP's ``FileSystemReader`` unpickles ``.metadata`` with
``pickle.load`` and the default planner loads non-tensor values with
``torch.load(weights_only=False)``: a crafted directory runs code. :class:`Reader`
unpickles ``.metadata`` with an allow-list of DCP's metadata classes, checks every
record (file names inside the directory, chunks inside their tensors), checks each
non-tensor value with ``torch.load(weights_only=True)`` before handing it on (unless
``trusted=True``), and checks every size a file claims against what the metadata says
the item holds before reading or decoding it; a pack
range must hold exactly the item's elements and lie inside a pack frame of at most 1 Mi
elements. Any problem raises :class:`CheckpointError`
naming the file; ``dcp.load`` wraps it in DCP's ``CheckpointException`` (its
``failures``), which :func:`load` unwraps.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import re
import stat
import struct
import zlib

import numpy as np
import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import load as dcp_load
# _StorageInfo is the per-item record FileSystemReader reads; storing ours in the same
# class keeps the directory an ordinary DCP one (and .metadata loadable by DCP itself).
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..core.codebooks import CodebookGroup, CodebookSet, as_codebook_set
from ..core.codec import Codec
from ..core.errors import CheckpointError, CodebookError, FrameError
from ..core.frame import header_size
from ..core.huffman import Codebook
from ..core.quoting import printable
from ..core.streams import SUPPORTED_DTYPES, spec_for
from .formats import FileTensor
from .plan import CHUNK_SIZES, BookChooser, make_codec, plan_bytes

__all__ = ["FRAME_DESCRIPTOR", "MAX_METADATA_BYTES", "PACK_DESCRIPTOR", "Reader", "Writer", "kind_of", "load"]

log = logging.getLogger(__name__)

# The transform descriptor of a frame's record (DCP's "name/version" form).
FRAME_DESCRIPTOR = "comm_codec.frame/1"
# The descriptor of an item that is a range of a pack frame; a second descriptor,
# "elements=<start>+<count>", says which elements of it.
PACK_DESCRIPTOR = "comm_codec.pack/1"
# Largest .metadata read: DCP writes ~300 bytes per tensor chunk.
MAX_METADATA_BYTES = 1 << 30
_METADATA_NAME = ".metadata"  # FileSystemWriter's name for it
_DATA_SUFFIX = ".distcp"  # and for its data files
_BOOKS_FORMAT = "comm_codec.dcp.books"
_BOOKS_VERSION = 1
_MAX_BOOKS_BYTES = 64 << 20  # a book takes ~400 bytes of JSON
# At the very end of a data file: magic, book table offset and length, its CRC-32, zero.
_TRAILER = struct.Struct("<8sQQII")
_TRAILER_MAGIC = b"CCDCPBK1"
_RAW_ID = "0" * 16
# Tensors this small are coded with the shipped books, packed: a book of their own would
# cost more in the table than it saves, and one frame for all of them saves a header, a
# record and a call per tensor (189 of all-MiniLM-L6-v2's 303 tensors; coded one frame
# each, they took ~20 % of its save, and its load decoded 189 frames for them, now 4).
_PLAN_MIN_ELEMS = 1 << 14
# A pack frame holds at most this many elements (what a reader decodes at once).
_PACK_MAX_ELEMS = 1 << 20
# Chunks of a pack frame: small, so that each tensor of it (a bias about 0.01, a norm's
# weight about 1) gets about its own reference exponent.
_PACK_CHUNK_ELEMS = 1024
_PACK_RANGE = re.compile(r"elements=(\d{1,15})\+(\d{1,15})")
# A tensor whose name differs from an earlier one's only in its numbers (the same matrix
# of another layer, the same moment of another parameter), of the same shape and dtype,
# is first coded with that tensor's plan (chunk size and books), and keeps the frame when
# it is within this fraction of that tensor's frame in size: a different size says a
# different distribution, which gets a plan of its own. Planning a tensor costs ~0.5 ms,
# ~30 % of a save of all-MiniLM-L6-v2 and its Adam state.
_REUSE_TOLERANCE = 0.02
_DIGITS = re.compile(r"\d+")
# torch.save's zip around a tensor that is stored as DCP stores it: a few kB at most.
_TORCH_SAVE_SLACK = 1 << 20
_OPTIMIZER_NAME = re.compile(r"exp_avg|momentum|(^|\.)(optim|optimizer|state)\.", re.IGNORECASE)


def kind_of(fqn: str) -> str:
    """Return the tensor kind whose books suit a state-dict entry, from its name.

    Optimizer state as ``get_state_dict`` and ``Optimizer.state_dict`` name it
    (``optim.state.<param>.exp_avg``, ``state.0.exp_avg_sq``, ``...momentum_buffer``) is
    ``"optimizer_state"``; everything else ``"weight"``. The kind only picks the shipped
    books a tensor is weighed against: a wrong guess costs bytes, never correctness.

    Args:
        fqn: the flattened state-dict key DCP gives a write item.

    Returns:
        ``"optimizer_state"`` or ``"weight"``.
    """
    return "optimizer_state" if _OPTIMIZER_NAME.search(fqn) else "weight"


def _as_u8(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, without a copy."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.reshape(-1).view(ints).numpy().view(np.uint8)


class Writer(FileSystemWriter):
    """A DCP ``StorageWriter`` that stores tensors as codec frames.

    Use as ``dcp.save(state_dict, storage_writer=Writer(path))`` or
    ``dcp.async_save(...)``: with ``async_save`` the state dict is staged (copied to CPU)
    on the calling thread and coded on DCP's writer thread. Each rank writes one data
    file; tensors of a codec dtype become frames, other tensors and non-tensor values
    are stored as :class:`FileSystemWriter` stores them. Coding runs on one thread.

    Args:
        path: the checkpoint directory (created if missing).
        codebooks: the shipped books tensors are weighed against (a
            :class:`CodebookSet`, a path to one, or None for the default set). A reader
            needs the same set for frames that use them.
        kind: ``fqn -> kind`` choosing those books per tensor; default :func:`kind_of`.
        sync_files: fsync each data file and the metadata (as FileSystemWriter).
        overwrite: allow writing over an existing checkpoint (as FileSystemWriter).
        cache_staged_state_dict: keep the CPU copy that ``async_save`` stages into,
            for the next save (as FileSystemWriter).

    Raises:
        TypeError, FileNotFoundError, CodebookError: bad ``codebooks`` (see
            :func:`comm_codec.core.codebooks.as_codebook_set`).
    """

    def __init__(self, path, *, codebooks=None, kind=None, sync_files: bool = True, overwrite: bool = True,
                 cache_staged_state_dict: bool = False):
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1,
                         overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)
        self.codebooks = as_codebook_set(codebooks)
        self.kind = kind_of if kind is None else kind
        self._shipped_codec = None  # for the packs of tensors too small to plan; made on first use

    def write_data(self, plan, planner) -> Future:
        """Write this rank's items into ``<prefix>0.distcp``; return their records (a done Future)."""
        name = f"{plan.storage_data.prefix}0{_DATA_SUFFIX}"
        results = self._write_file(os.path.join(os.fspath(self.path), name), name, plan.items, planner)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, path: str, name: str, items, planner) -> list:
        out = _FileOut(name, BookChooser(self.codebooks))
        with open(path, "wb") as fh:
            out.fh = fh
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    out.write(item, data.getbuffer())
                    continue
                tensor = data.detach()
                if tensor.device.type != "cpu":  # frames of CUDA tensors would stay on the GPU
                    tensor = tensor.cpu()
                if tensor.dtype not in SUPPORTED_DTYPES:
                    out.write(item, _torch_save(tensor))
                elif tensor.numel() < _PLAN_MIN_ELEMS:
                    self._pack(out, item, tensor)
                else:
                    frame = self._encode(tensor, item.index.fqn, out)
                    out.write(item, memoryview(frame.numpy()), [FRAME_DESCRIPTOR],
                              tensor.numel() * tensor.element_size())
            for key in list(out.packs):
                self._flush_pack(out, key)
            table = self._book_table(out.chooser)
            fh.write(table)
            fh.write(_TRAILER.pack(_TRAILER_MAGIC, out.pos, len(table), zlib.crc32(table), 0))
            fh.flush()
            if self.sync_files:
                os.fsync(fh.fileno())
        log.info("%s: %d items, tensors of codec dtypes %d -> %d bytes (%d tensors planned, %d taking an earlier "
                 "tensor's plan)", path, len(out.results), out.raw, out.coded, out.planned, out.reused)
        return out.results

    def _pack(self, out: "_FileOut", item, tensor: torch.Tensor) -> None:
        """Add a small tensor to the pack of its dtype and kind (written when full or at the end)."""
        key = (tensor.dtype, self.kind(item.index.fqn))
        if key in out.packs and out.pack_elems[key] + tensor.numel() > _PACK_MAX_ELEMS:
            self._flush_pack(out, key)
        out.packs.setdefault(key, []).append((item, tensor.reshape(-1)))
        out.pack_elems[key] = out.pack_elems.get(key, 0) + tensor.numel()

    def _flush_pack(self, out: "_FileOut", key) -> None:
        """Write one frame of a pack's tensors, one after the other; record each as its range of it."""
        dtype, kind = key
        members = out.packs.pop(key)
        del out.pack_elems[key]
        if self._shipped_codec is None:
            # A stored file: the ratio over split exponents' speed, as the other writers.
            self._shipped_codec = Codec(self.codebooks, threads=1, chunk_elems=_PACK_CHUNK_ELEMS,
                                        split_exponent=False)
        flat = torch.cat([t for _, t in members]) if len(members) > 1 else members[0][1].contiguous()
        frame = memoryview(self._shipped_codec.encode(flat, kind=kind).numpy())
        pos, start = out.pos, 0
        for item, t in members:
            out.record(item, pos, len(frame), [PACK_DESCRIPTOR, f"elements={start}+{t.numel()}"])
            start += t.numel()
        out.write(None, frame, None, flat.numel() * flat.element_size())

    def _encode(self, tensor: torch.Tensor, fqn: str, out: "_FileOut") -> torch.Tensor:
        """One tensor's frame, with the books its sample says are smallest (or a sibling's plan)."""
        tensor = tensor.contiguous()
        key = (_DIGITS.sub("#", fqn), tensor.dtype, tuple(tensor.shape))
        earlier = out.plans.get(key)
        if earlier is not None:
            codec, size = earlier
            frame = codec.encode(tensor, kind="weight")
            if abs(frame.numel() / size - 1.0) <= _REUSE_TOLERANCE:
                out.reused += 1
                return frame
        spec = spec_for(tensor.dtype)
        u8 = _as_u8(tensor)
        planned = FileTensor(name=fqn, dtype=spec.name, shape=list(tensor.shape), offset=0, nbytes=u8.size,
                             kind=self.kind(fqn), codable=True)
        plan_bytes(planned, u8, out.chooser)
        out.planned += 1
        frame = planned.codec.encode(tensor, kind="weight")  # make_codec keys its books as "weight"
        if earlier is None:
            out.plans[key] = (planned.codec, frame.numel())
        return frame

    def _book_table(self, chooser: BookChooser) -> bytes:
        """The file's book table: books of its own (shipped ones by id only) and groups."""
        own = {book_id: entry["book"] for book_id, entry in chooser.books.items()
               if self.codebooks.by_id(book_id) is None}
        table = {"format": _BOOKS_FORMAT, "version": _BOOKS_VERSION, "shipped": self.codebooks.digest,
                 "books": own, "groups": dict(chooser.groups)}
        return json.dumps(table, separators=(",", ":"), allow_nan=False).encode()


class _FileOut:
    """One data file being written: position, records, packs waiting, plans to reuse, counts."""

    def __init__(self, name: str, chooser: BookChooser):
        self.name = name
        self.chooser = chooser
        self.fh = None
        self.pos = 0
        self.results: list = []
        self.packs: dict = {}  # (dtype, kind) -> [(item, flat tensor)]
        self.pack_elems: dict = {}  # (dtype, kind) -> elements in its pack so far
        self.plans: dict = {}  # (name pattern, dtype, shape) -> (codec, its frame's bytes)
        self.raw = self.coded = self.planned = self.reused = 0

    def record(self, item, pos: int, length: int, descriptors) -> None:
        self.results.append(WriteResult(index=item.index, size_in_bytes=length,
                                        storage_data=_StorageInfo(self.name, pos, length,
                                                                  transform_descriptors=descriptors)))

    def write(self, item, payload, descriptors=None, raw: int = 0) -> None:
        """Append payload; record it for item (None: its records are made by the caller)."""
        self.fh.write(payload)
        length = len(payload)
        if item is not None:
            self.record(item, self.pos, length, descriptors)
        if raw:
            self.raw += raw
            self.coded += length
        self.pos += length


def _torch_save(tensor: torch.Tensor) -> memoryview:
    """A tensor as FileSystemWriter stores it: ``torch.save`` of it, storage cut to its elements."""
    if tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # torch.save writes the whole storage of a view
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getbuffer()


# -- reading ------------------------------------------------------------------------------------
_METADATA_GLOBALS = {
    **{("torch.distributed.checkpoint.metadata", c.__name__): c
       for c in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                 MetadataIndex, StorageMeta)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}
# Named, not imported: what DCP's metadata pickles refer to besides its dataclasses.
_METADATA_NAMES = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum of three values
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),  # StorageMeta.checkpoint_id
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickle DCP metadata: its own classes, torch dtypes and sizes, paths; nothing else."""

    def find_class(self, module, name):
        found = _METADATA_GLOBALS.get((module, name))
        if found is not None:
            return found
        if (module, name) in _METADATA_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {printable(module, 60)}.{printable(name, 60)}, which DCP "
                                     "metadata never holds")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("holds a persistent id, which DCP metadata never holds")


def _open_regular(path: str):
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


def _plain_name(name) -> bool:
    """Whether a recorded file name is one file inside the checkpoint directory."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and name != _METADATA_NAME)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_size(x, ndim: int | None = None) -> bool:
    return isinstance(x, torch.Size) and (ndim is None or len(x) == ndim) and all(_is_int(d) and d >= 0 for d in x)


def _check_metadata(md, path: str) -> None:
    """Check every field of unpickled metadata that reading relies on; CheckpointError if not."""
    def bad(what):
        raise CheckpointError(f"{path}: not a DCP checkpoint's metadata ({what})")

    if not isinstance(md, Metadata):
        bad(f"holds a {type(md).__name__}")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        bad("no state_dict_metadata or storage_data mapping")
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            bad("a key that is not a string")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(entry.properties, TensorProperties) \
                or not isinstance(entry.properties.dtype, torch.dtype) or not _check_size(entry.size) \
                or not isinstance(entry.chunks, list):
            bad(f"entry {printable(fqn, 80)} is malformed")
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or not _check_size(chunk.offsets, len(entry.size)) \
                    or not _check_size(chunk.sizes, len(entry.size)) \
                    or any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size)):
                bad(f"entry {printable(fqn, 80)} has a chunk outside its tensor {tuple(entry.size)}")
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or index.fqn not in md.state_dict_metadata:
            bad("a storage record for no entry")
        if not isinstance(info, _StorageInfo) or not _plain_name(info.relative_path) \
                or not (_is_int(info.offset) and _is_int(info.length) and info.offset >= 0 and info.length >= 0):
            bad(f"the storage record of {printable(index.fqn, 80)} is malformed (a file name must name a file "
                "in the checkpoint directory)")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            bad(f"the storage record of {printable(index.fqn, 80)} has malformed transforms")


def _max_frame_bytes(numel: int, spec) -> int:
    """The most bytes a frame of numel elements can take: raw data, the chunk table of the
    smallest chunks the codec makes (8 elements) and 8 bytes of padding per chunk and stream."""
    nchunks = -(-numel // 8)
    return numel * spec.itemsize + header_size(spec.nstreams, nchunks) + 8 * (spec.nstreams + 1) * nchunks


class _DataFile:
    """One open data file of a checkpoint: bounded reads, and its book table once asked for."""

    def __init__(self, path: str):
        self.path = path
        self.fh = _open_regular(path)
        self.size = os.fstat(self.fh.fileno()).st_size
        self._books = None

    def read(self, offset: int, length: int, what: str) -> np.ndarray:
        if offset + length > self.size:
            raise CheckpointError(f"{self.path}: truncated: {what} lies at bytes {offset}..{offset + length}, "
                                  f"the file has {self.size}")
        buf = np.empty(length, dtype=np.uint8)
        self.fh.seek(offset)
        view, got = memoryview(buf), 0
        while got < length:
            n = self.fh.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{self.path}: truncated while reading {what}")
            got += n
        return buf

    def books(self, shipped: CodebookSet) -> dict:
        """id -> Codebook or CodebookGroup, of every book and group the file's table names."""
        if self._books is None:
            self._books = self._read_books(shipped)
        return self._books

    def _read_books(self, shipped: CodebookSet) -> dict:
        path = self.path
        if self.size < _TRAILER.size:
            raise CheckpointError(f"{path}: truncated or not a comm_codec DCP data file (no book table)")
        magic, offset, length, crc, zero = _TRAILER.unpack(bytes(self.read(self.size - _TRAILER.size,
                                                                          _TRAILER.size, "the trailer")))
        if magic != _TRAILER_MAGIC or zero != 0:
            raise CheckpointError(f"{path}: truncated or not a comm_codec DCP data file (no book table at its end)")
        if length > _MAX_BOOKS_BYTES or offset + length + _TRAILER.size != self.size:
            raise CheckpointError(f"{path}: the book table's place ({offset}, {length} bytes) is not before the "
                                  "trailer: truncated or corrupted")
        raw = bytes(self.read(offset, length, "the book table"))
        if zlib.crc32(raw) != crc:
            raise CheckpointError(f"{path}: the book table is corrupted (CRC-32 mismatch)")
        try:
            table = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise CheckpointError(f"{path}: the book table is not JSON") from None
        if not isinstance(table, dict) or table.get("format") != _BOOKS_FORMAT \
                or table.get("version") != _BOOKS_VERSION or not isinstance(table.get("books"), dict) \
                or not isinstance(table.get("groups"), dict):
            raise CheckpointError(f"{path}: the book table is not a {_BOOKS_FORMAT} version {_BOOKS_VERSION} table")
        books: dict = {}
        for book_id, entry in table["books"].items():
            try:
                book = Codebook.from_dict(entry)
            except (CodebookError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CheckpointError(f"{path}: codebook {printable(book_id, 20)}: {exc}") from None
            if book.id != book_id:
                raise CheckpointError(f"{path}: codebook listed as {printable(book_id, 20)} is {book.id}")
            books[book_id] = book

        def member(book_id):
            found = books.get(book_id) if isinstance(book_id, str) else None
            if found is None and isinstance(book_id, str):
                found = shipped.by_id(book_id)
            if found is None:
                raise CheckpointError(_missing(path, book_id, table.get("shipped"), shipped))
            return found

        for group_id, members in table["groups"].items():
            if not isinstance(members, list) or not 1 <= len(members) <= CodebookGroup.MAX_BOOKS:
                raise CheckpointError(f"{path}: codebook group {printable(group_id, 20)} is malformed")
            try:
                group = CodebookGroup([member(b) for b in members])
            except (ValueError, TypeError) as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"{path}: codebook group {printable(group_id, 20)}: {exc}") from None
            if group.id != group_id:
                raise CheckpointError(f"{path}: codebook group listed as {printable(group_id, 20)} is {group.id}")
            books[group_id] = group
        books["_shipped"] = table.get("shipped")
        return books

    def close(self) -> None:
        self.fh.close()


def _missing(path: str, book_id, written_with, shipped: CodebookSet) -> str:
    why = ("" if written_with == shipped.digest else
           f"; it was written with shipped books {printable(written_with, 40)}, this reader has {shipped.digest}")
    return f"{path}: a frame needs codebook {printable(book_id, 20)}, which neither the file nor the shipped books hold{why}"


class Reader(FileSystemReader):
    """A DCP ``StorageReader`` for directories written by :class:`Writer` (or plain DCP).

    Use as ``dcp.load(state_dict, storage_reader=Reader(path))``, on any number of ranks
    (or in one process without a process group): DCP's planner reshards. Frames are
    decoded bit for bit into the destination tensors; items stored as DCP stores them
    (plain DCP directories too) are read as ``FileSystemReader`` reads them, with
    ``weights_only=True``. Directories written with DCP's stream extensions (ZStandard)
    are refused: read them with ``FileSystemReader``.

    Nothing from the directory is trusted: see the module docstring. Problems raise
    :class:`CheckpointError` naming the file; :func:`load` surfaces it unwrapped.

    Args:
        path: the checkpoint directory.
        codebooks: the shipped books the writer used (None: the default set).
        trusted: hand non-tensor values to DCP's planner without first checking that
            ``torch.load(weights_only=True)`` accepts them (DCP's planner itself loads them
            with ``weights_only=False``). Only for directories you wrote yourself.

    Raises:
        TypeError, FileNotFoundError, CodebookError: bad ``codebooks``.
    """

    def __init__(self, path, *, codebooks=None, trusted: bool = False):
        super().__init__(path)
        self.codebooks = as_codebook_set(codebooks)
        self.trusted = bool(trusted)
        self._chunks: dict = {}  # (fqn, chunk offsets) -> (dtype, chunk sizes)
        self._codecs: dict = {}  # (dtype name, book ids) -> Codec
        self._last_pack = None  # ((path, offset, length), its decoded elements)

    # No **kwargs: DCP then reads the global .metadata only, never a rank's own.
    def read_metadata(self) -> Metadata:
        """Read ``.metadata`` with an allow-list unpickler and check it.

        Returns:
            The checkpoint's :class:`Metadata`.

        Raises:
            CheckpointError: no such file, not a regular file, larger than
                :data:`MAX_METADATA_BYTES`, a pickle that refers to anything but DCP's
                metadata classes, or records that point outside the directory or
                outside their tensors.
        """
        path = os.path.join(os.fspath(self.path), _METADATA_NAME)
        try:
            with _open_regular(path) as fh:
                raw = fh.read(MAX_METADATA_BYTES + 1)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such file: {os.fspath(self.path)} is not a DCP checkpoint") from None
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        if len(raw) > MAX_METADATA_BYTES:
            raise CheckpointError(f"{path}: larger than {MAX_METADATA_BYTES} bytes: not DCP metadata")
        try:
            md = _MetadataUnpickler(io.BytesIO(raw)).load()
        except Exception as exc:  # a crafted pickle raises whatever its opcodes provoke
            raise CheckpointError(f"{path}: not DCP metadata, or truncated or tampered "
                                  f"({type(exc).__name__}: {printable(str(exc), 160)})") from None
        _check_metadata(md, path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        """Take the records of every item (as FileSystemReader) and each chunk's dtype and size."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                for chunk in entry.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (entry.properties.dtype, tuple(chunk.sizes))

    def read_data(self, plan, planner) -> Future:
        """Read and decode every item of this rank's plan into the planner's tensors.

        Raises:
            CheckpointError: a file missing, truncated or tampered; a frame that does not
                hold what the metadata says; books the reader does not have.
        """
        per_file: dict = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise CheckpointError(f"{os.path.join(os.fspath(self.path), _METADATA_NAME)}: no storage record "
                                      f"for {printable(req.storage_index.fqn, 80)}")
            per_file.setdefault(info.relative_path, []).append((req, info))
        for name, reqs in per_file.items():
            path = os.path.join(os.fspath(self.path), name)
            try:
                data = _DataFile(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: no such file (the checkpoint's metadata names it)") from None
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
            try:
                for req, info in sorted(reqs, key=lambda r: r[1].offset):
                    try:
                        self._read_item(data, req, info, planner)
                    except CheckpointError:
                        raise
                    except (FrameError, CodebookError, OSError, RuntimeError, ValueError, TypeError, EOFError,
                            pickle.UnpicklingError) as exc:
                        raise CheckpointError(f"{path}: {printable(req.storage_index.fqn, 80)}: "
                                              f"{printable(str(exc), 200)}") from None
            finally:
                data.close()
                self._last_pack = None
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, data: _DataFile, req, info, planner) -> None:
        descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
        fqn = printable(req.storage_index.fqn, 80)
        packed = len(descriptors) == 2 and descriptors[0] == PACK_DESCRIPTOR
        if descriptors not in ((), (FRAME_DESCRIPTOR,)) and not packed:
            raise CheckpointError(f"{data.path}: {fqn} was written with DCP extension(s) "
                                  f"{printable(', '.join(descriptors), 80)}; read it with FileSystemReader")
        if req.type == LoadItemType.BYTE_IO:
            if descriptors:
                raise CheckpointError(f"{data.path}: {fqn}: a non-tensor value recorded as a frame")
            raw = bytes(data.read(info.offset, info.length, fqn))
            if not self.trusted:
                try:
                    torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                except Exception as exc:  # torch.load raises many types on foreign bytes
                    raise CheckpointError(
                        f"{data.path}: {fqn}: a non-tensor value that weights-only loading refuses "
                        f"({type(exc).__name__}); DCP's planner would unpickle it with weights_only=False. "
                        "If you trust this checkpoint, read it with Reader(path, trusted=True)") from None
            planner.load_bytes(req, io.BytesIO(raw))
            return
        known = self._chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        if known is None:
            raise CheckpointError(f"{data.path}: {fqn}: the metadata has no chunk at "
                                  f"{tuple(req.storage_index.offset or ())}")
        dtype, sizes = known
        if len(req.storage_offsets) != len(sizes) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, sizes)):
            raise CheckpointError(f"{data.path}: {fqn}: a read outside its stored chunk {sizes}")
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise CheckpointError(f"{data.path}: {fqn}: the destination has shape {tuple(target.shape)}, the "
                                  f"read {tuple(req.lengths)}")
        numel = math.prod(sizes)
        if packed:
            stored = self._unpack(data, info, dtype, sizes, numel, descriptors[1], fqn)
        elif descriptors:
            stored = self._decode(data, info, dtype, sizes, numel, target, fqn)
        else:
            stored = self._torch_load(data, info, dtype, sizes, numel, fqn)
        if stored is not target:
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                stored = stored.narrow(dim, offset, length)
            target.copy_(stored)
        planner.commit_tensor(req, target)

    def _read_frame(self, data: _DataFile, info, dtype, numel: int, exact: bool, what: str, fqn):
        """Read and check a frame record of numel elements of dtype (at most numel unless exact).

        Returns:
            (the frame's bytes, its parameters).
        """
        if dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{data.path}: {fqn}: a {what} recorded for a {dtype} tensor, which the codec "
                                  "does not code")
        spec = spec_for(dtype)
        most = _max_frame_bytes(numel, spec)
        if info.length > most:
            raise CheckpointError(f"{data.path}: {fqn}: its record claims a {info.length}-byte {what}; one of "
                                  f"{'' if exact else 'at most '}{numel} x {spec.name} takes at most {most}")
        buf = data.read(info.offset, info.length, fqn)
        params = Codec.frame_parameters(buf)
        if params.dtype != dtype or (params.numel != numel if exact else params.numel > numel):
            raise CheckpointError(f"{data.path}: {fqn}: the {what} holds {params.numel} x {params.spec.name}, "
                                  f"{'the metadata says' if exact else 'one holds at most'} {numel} x {spec.name}")
        return buf, params

    def _decode(self, data: _DataFile, info, dtype, sizes, numel, target, fqn):
        """Decode a frame record: into target when it is the whole chunk, else into a new tensor."""
        buf, params = self._read_frame(data, info, dtype, numel, True, "frame", fqn)
        whole = tuple(target.shape) == tuple(sizes) and target.dtype == dtype and target.is_contiguous() \
            and target.device.type == "cpu"
        out = target if whole else torch.empty(sizes, dtype=dtype)
        self._codec(data, params).decode(buf, out=out)
        return out

    def _unpack(self, data: _DataFile, info, dtype, sizes, numel, where: str, fqn):
        """An item's range of a pack frame (decoded once for the items that follow it in the file)."""
        found = _PACK_RANGE.fullmatch(where)
        if found is None:
            raise CheckpointError(f"{data.path}: {fqn}: a malformed pack range {printable(where, 60)}")
        start, count = int(found.group(1)), int(found.group(2))
        if count != numel:
            raise CheckpointError(f"{data.path}: {fqn}: its pack range holds {count} elements, the metadata "
                                  f"says {numel}")
        key = (data.path, info.offset, info.length)
        if self._last_pack is None or self._last_pack[0] != key:
            buf, params = self._read_frame(data, info, dtype, _PACK_MAX_ELEMS, False, "pack frame", fqn)
            self._last_pack = (key, self._codec(data, params).decode(buf, out=torch.empty(params.numel, dtype=dtype)))
        pack = self._last_pack[1]
        if start + count > pack.numel():
            raise CheckpointError(f"{data.path}: {fqn}: its pack range {start}+{count} lies outside the pack frame "
                                  f"of {pack.numel()} elements")
        return pack[start:start + count].view(sizes)

    def _codec(self, data: _DataFile, params) -> Codec:
        key = (params.spec.name, params.book_ids)
        codec = self._codecs.get(key)
        if codec is None:
            books = None
            groups = []
            for book_id in params.book_ids:
                if book_id == _RAW_ID:
                    groups.append(Codebook.raw_book())
                    continue
                books = data.books(self.codebooks) if books is None else books
                found = books.get(book_id)
                for lookup in (self.codebooks.group_by_id, self.codebooks.by_id):
                    found = lookup(book_id) if found is None else found
                if found is None:
                    raise CheckpointError(_missing(data.path, book_id, books.get("_shipped"), self.codebooks))
                groups.append(found)
            # Frames carry their chunk size; the codec's own is not used to decode.
            codec = self._codecs[key] = make_codec(groups, params.spec, CHUNK_SIZES[0])
        return codec

    def _torch_load(self, data: _DataFile, info, dtype, sizes, numel, fqn):
        """Load a tensor stored as DCP stores it, checked against its metadata."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if info.length > numel * itemsize + _TORCH_SAVE_SLACK:
            raise CheckpointError(f"{data.path}: {fqn}: its record claims {info.length} bytes for a "
                                  f"{numel * itemsize}-byte tensor")
        raw = data.read(info.offset, info.length, fqn)
        tensor = torch.load(io.BytesIO(raw.tobytes()), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != tuple(sizes):
            what = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"{data.path}: {fqn}: holds {what}, the metadata says {dtype} {tuple(sizes)}")
        return tensor


def load(state_dict: dict, path, *, process_group=None, planner=None, codebooks=None, trusted: bool = False) -> None:
    """``dcp.load`` from a :class:`Reader` of path, raising its CheckpointError itself.

    ``dcp.load`` wraps what a storage reader raises in DCP's ``CheckpointException``
    (per rank, with tracebacks); this raises the first rank's :class:`CheckpointError`
    instead, and checks the metadata before DCP plans anything.

    Args:
        state_dict: as for ``dcp.load``: tensors allocated where they are to be loaded.
        path: the checkpoint directory.
        process_group, planner: as for ``dcp.load``.
        codebooks, trusted: as for :class:`Reader`.

    Raises:
        CheckpointError: the directory is missing, foreign, truncated or tampered.
        CheckpointException: any other failure, as ``dcp.load`` raises it.
    """
    reader = Reader(path, codebooks=codebooks, trusted=trusted)
    reader.read_metadata()
    try:
        dcp_load(state_dict, storage_reader=reader, process_group=process_group, planner=planner)
    except CheckpointException as exc:
        for rank in sorted(exc.failures):
            error = exc.failures[rank][0]
            if isinstance(error, CheckpointError):
                raise error.with_traceback(None) from None
        raise
