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
with a book table (JSON) and a fixed trailer (:mod:`comm_codec.checkpoint._dcp_file`):
every book and group its frames use, shipped ones included, so that a later release
with other default books still reads it; and a CRC-32 of every item stored as DCP
stores it (frames carry their own). Frames name their books by id, so a frame decodes
only with the very books it was made with. Files written before books were stored name
the shipped books by id only: they read with the shipped set that wrote them
(``codebooks=``).

**Records.** Each frame's entry in ``.metadata`` is DCP's own per-item record with the
transform descriptor :data:`FRAME_DESCRIPTOR`; a packed tensor's record is its pack
frame's place with the descriptors :data:`PACK_DESCRIPTOR` and
``"elements=<start>+<count>"``. A plain ``FileSystemReader`` refuses such a directory with
"Unknown extension" instead of misreading frames as ``torch.save`` data.

**Untrusted directories.** DCP's ``FileSystemReader`` unpickles ``.metadata`` with
``pickle.load`` and the default planner loads non-tensor values with
``torch.load(weights_only=False)``: a crafted directory runs code. :class:`Reader`
unpickles ``.metadata`` with an allow-list of DCP's metadata classes whose constructors
cannot grow their input (:mod:`comm_codec.checkpoint._dcp_metadata`), checks every
record (file names inside the directory, chunks that tile their tensors), reads a
``torch.save`` record only when its zip members are stored and its pickle small
(:mod:`comm_codec.checkpoint._dcp_items`), loads each non-tensor value with
``weights_only=True`` and hands DCP's planner a fresh ``torch.save`` of the result, never
the file's bytes (unless ``trusted=True``), and checks every size a file claims against
what the metadata says the item holds before reading or decoding it; a pack
range must hold exactly the item's elements and lie inside a pack frame of at most 1 Mi
elements. Any problem raises :class:`CheckpointError`
naming the file; ``dcp.load`` wraps it in DCP's ``CheckpointException`` (its
``failures``), which :func:`load` unwraps.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import re
import time
import warnings
import zlib

import numba
import numpy as np
import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import load as dcp_load

# _StorageInfo is the per-item record FileSystemReader reads; storing ours in the same
# class keeps the directory an ordinary DCP one (and .metadata loadable by DCP itself).
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..core.codebooks import as_codebook_set
from ..core.codec import Codec
from ..core.errors import CheckpointError, CodebookError, FrameError
from ..core.huffman import Codebook
from ..core.quoting import printable
from ..core.streams import SUPPORTED_DTYPES, spec_for
from ._dcp_file import (
    DATA_SUFFIX,
    RAW_ID,
    TRAILER,
    TRAILER_MAGIC,
    DataFile,
    book_table,
    max_frame_bytes,
)
from ._dcp_items import (
    MAX_TENSOR_PICKLE,
    MAX_VALUE_PICKLE,
    ZSTD_DESCRIPTOR,
    check_torch_zip,
    load_checked,
    resave,
    zstd_decode,
)
from ._dcp_metadata import MAX_METADATA_BYTES, METADATA_NAME, read_metadata
from ._dcp_stats import Counts
from .files import atomic_output
from .formats import FileTensor
from .plan import CHUNK_SIZES, BookChooser, make_codec, plan_bytes
from .report import Summary

__all__ = ["FRAME_DESCRIPTOR", "MAX_METADATA_BYTES", "PACK_DESCRIPTOR", "Reader", "Writer", "kind_of", "load"]

log = logging.getLogger(__name__)

# The transform descriptor of a frame's record (DCP's "name/version" form).
FRAME_DESCRIPTOR = "comm_codec.frame/1"
# The descriptor of an item that is a range of a pack frame; a second descriptor,
# "elements=<start>+<count>", says which elements of it.
PACK_DESCRIPTOR = "comm_codec.pack/1"
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
# The most bytes a non-tensor value of a DCP + ZStandard directory decompresses to.
_MAX_VALUE_BYTES = 256 << 20
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


_default_kind_of = kind_of  # Writer's parameter of the same name shadows it there


def _as_u8(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, without a copy."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.reshape(-1).view(ints).numpy().view(np.uint8)


class Writer(FileSystemWriter):
    """A DCP ``StorageWriter`` that stores tensors as codec frames.

    Use as ``dcp.save(state_dict, storage_writer=Writer(path))`` or
    ``dcp.async_save(...)``: with ``async_save`` the state dict is staged (copied to CPU)
    on the calling thread and coded on DCP's writer thread. Each rank writes one data
    file (one per item with ``single_file_per_rank=False``); tensors of a codec dtype
    become frames, other tensors and non-tensor values are stored as
    :class:`FileSystemWriter` stores them, with a CRC-32 of each in the file's book
    table. Each data file holds every book its frames use, so it reads with any later
    release. Files are written under a temporary name (``O_EXCL | O_NOFOLLOW``) and
    renamed into place: a symlink or FIFO planted at a data file's name is replaced,
    never written through.

    Args:
        path: the checkpoint directory (created if missing).
        codebooks: the shipped books tensors are weighed against (a
            :class:`CodebookSet`, a path to one, or None for the default set).
        kind_of: ``fqn -> kind`` choosing those books per tensor; default :func:`kind_of`.
        single_file_per_rank: one data file per rank (default), or one per item.
        sync_files: fsync the metadata (as FileSystemWriter); data files are always
            fsynced before their rename.
        thread_count: threads that code each large tensor (capped at numba's thread
            count); FileSystemWriter writes that many files instead.
        per_thread_copy_ahead: accepted for FileSystemWriter's signature (unused: the
            tensors are coded where they are).
        cache_staged_state_dict: keep the CPU copy that ``async_save`` stages into,
            for the next save (as FileSystemWriter).
        force: write over an existing checkpoint in path. Default: refuse one
            (:class:`FileExistsError`), as every comm_codec writer does.
        overwrite: FileSystemWriter's name for ``force``, kept so that a
            ``FileSystemWriter(...)`` call works unchanged (give one or the other).
        _extensions: DCP stream extensions: refused (frames are compressed already).
        serialization_format: only ``SerializationFormat.TORCH_SAVE`` (how items that
            are not frames are stored).

    Raises:
        TypeError: ``kind_of`` is not callable.
        CodebookError: bad ``codebooks`` (a missing or invalid file, or another type).
        ValueError: ``thread_count`` under 1, extensions, another serialization format,
            ``force`` and ``overwrite`` that disagree.
    """

    def __init__(
        self,
        path,
        *,
        codebooks=None,
        kind_of=None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        force: bool = False,
        overwrite: bool | None = None,
        _extensions=None,
        serialization_format=SerializationFormat.TORCH_SAVE,
    ):
        if _extensions:
            raise ValueError(
                "comm_codec.dcp.Writer takes no DCP stream extensions: its frames are compressed "
                "already, and an extension would see them as opaque bytes"
            )
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise ValueError(
                f"comm_codec.dcp.Writer stores items that are not frames with torch.save; "
                f"serialization_format={serialization_format!r} is not supported"
            )
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be an int >= 1, got {thread_count!r}")
        if overwrite is not None:
            if force and not overwrite:
                raise ValueError(
                    "force=True and overwrite=False disagree: overwrite is FileSystemWriter's name for force"
                )
            force = bool(overwrite)
        if kind_of is not None and not callable(kind_of):
            raise TypeError(f"kind_of must be a callable fqn -> kind, got {kind_of!r}")
        super().__init__(
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=1,
            per_thread_copy_ahead=per_thread_copy_ahead,
            overwrite=force,
            cache_staged_state_dict=cache_staged_state_dict,
        )
        self.codebooks = as_codebook_set(codebooks)
        self.kind_of = _default_kind_of if kind_of is None else kind_of
        self._counts = Counts((FRAME_DESCRIPTOR, PACK_DESCRIPTOR))
        self.coding_threads = min(thread_count, numba.config.NUMBA_NUM_THREADS)
        self._shipped_codec = None  # for the packs of tensors too small to plan; made on first use
        self._threaded: dict = {}  # a planned codec's id -> the same books on coding_threads threads

    def prepare_local_plan(self, plan):
        """Refuse a directory that holds a checkpoint already unless ``force`` (FileSystemWriter's check, our error)."""
        if not self.overwrite:
            self.fs.mkdir(self.path)
            if self._metadata_exists():
                raise FileExistsError(
                    17, f"{self.path} holds a checkpoint already; pass force=True to replace it", os.fspath(self.path)
                )
        with warnings.catch_warnings():
            # FileSystemWriter warns that its overwrite default will change; force=True was asked for.
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            return super().prepare_local_plan(plan)

    def stats(self) -> Summary:
        """Return what this writer's saves did on this rank (a Summary, ``op="save"``: :mod:`._dcp_stats`)."""
        return self._counts.summary("save", self.coding_threads)

    def write_data(self, plan, planner) -> Future:
        """Write this rank's items into ``<prefix>0.distcp`` (or one file per item); return their records."""
        started = time.perf_counter()
        files = [plan.items] if self.single_file_per_rank else [[item] for item in plan.items]
        results: list = []
        for n, items in enumerate(files):
            name = f"{plan.storage_data.prefix}{n}{DATA_SUFFIX}"
            results += self._write_file(os.path.join(os.fspath(self.path), name), name, items, planner)
        self._counts.seconds += time.perf_counter() - started
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        """Write ``.metadata`` as FileSystemWriter does, but through the atomic writer.

        FileSystemWriter opens ``.metadata.tmp`` with ``open(..., "wb")``, which follows a
        symlink planted there; here the pickle goes to an ``O_EXCL | O_NOFOLLOW`` temp file
        renamed over ``.metadata``.
        """
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        metadata.storage_meta = self.storage_meta()
        rank_local = not self.use_collectives and self.rank is not None
        name = f"__{self.rank}{METADATA_NAME}" if rank_local else METADATA_NAME
        with atomic_output(os.path.join(os.fspath(self.path), name)) as fh:
            fh.write(pickle.dumps(metadata))
            fh.commit()

    def _write_file(self, path: str, name: str, items, planner) -> list:
        out = _FileOut(name, BookChooser(self.codebooks))
        with atomic_output(path) as fh:
            out.fh = fh
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    out.write_plain(item, data.getbuffer())
                    continue
                tensor = data.detach()
                if tensor.device.type != "cpu":  # frames of CUDA tensors would stay on the GPU
                    tensor = tensor.cpu()
                if tensor.dtype not in SUPPORTED_DTYPES:
                    out.write_plain(item, _torch_save(tensor))
                elif tensor.numel() < _PLAN_MIN_ELEMS:
                    self._pack(out, item, tensor)
                else:
                    frame = self._encode(tensor, item.index.fqn, out)
                    out.write(
                        item, memoryview(frame.numpy()), [FRAME_DESCRIPTOR], tensor.numel() * tensor.element_size()
                    )
            for key in list(out.packs):
                self._flush_pack(out, key)
            table = book_table(
                out.used,
                {i: e["book"] for i, e in out.chooser.books.items()},
                out.chooser.groups,
                self.codebooks,
                out.checksums,
            )
            fh.write(table)
            fh.write(TRAILER.pack(TRAILER_MAGIC, out.pos, len(table), zlib.crc32(table), 0))
            fh.commit()
        tensors = sum(i.type != WriteItemType.BYTE_IO for i in items)
        self._counts.add_file(out.raw, out.checksums, out.results, out.pos + len(table) + TRAILER.size, tensors)
        log.info(
            "%s: %d items, tensors of codec dtypes %d -> %d bytes (%d tensors planned, %d taking an earlier "
            "tensor's plan)",
            path,
            len(out.results),
            out.raw,
            out.coded,
            out.planned,
            out.reused,
        )
        return out.results

    def _pack(self, out: _FileOut, item, tensor: torch.Tensor) -> None:
        """Add a small tensor to the pack of its dtype and kind (written when full or at the end)."""
        key = (tensor.dtype, self.kind_of(item.index.fqn))
        if key in out.packs and out.pack_elems[key] + tensor.numel() > _PACK_MAX_ELEMS:
            self._flush_pack(out, key)
        out.packs.setdefault(key, []).append((item, tensor.reshape(-1)))
        out.pack_elems[key] = out.pack_elems.get(key, 0) + tensor.numel()

    def _flush_pack(self, out: _FileOut, key) -> None:
        """Write one frame of a pack's tensors, one after the other; record each as its range of it."""
        dtype, kind = key
        members = out.packs.pop(key)
        del out.pack_elems[key]
        if self._shipped_codec is None:
            # A stored file: the ratio over split exponents' speed, as the other writers.
            self._shipped_codec = Codec(self.codebooks, threads=1, chunk_elems=_PACK_CHUNK_ELEMS, split_exponent=False)
        flat = torch.cat([t for _, t in members]) if len(members) > 1 else members[0][1].contiguous()
        frame = memoryview(self._shipped_codec.encode(flat, kind=kind).numpy())
        out.used.update(Codec.frame_parameters(frame).book_ids)
        pos, start = out.pos, 0
        for item, t in members:
            out.record(item, pos, len(frame), [PACK_DESCRIPTOR, f"elements={start}+{t.numel()}"])
            start += t.numel()
        out.write(None, frame, None, flat.numel() * flat.element_size())

    def _encode(self, tensor: torch.Tensor, fqn: str, out: _FileOut) -> torch.Tensor:
        """One tensor's frame, with the books its sample says are smallest (or a sibling's plan)."""
        tensor = tensor.contiguous()
        key = (_DIGITS.sub("#", fqn), tensor.dtype, tuple(tensor.shape))
        earlier = out.plans.get(key)
        if earlier is not None:
            codec, size = earlier
            frame = self._threads(codec).encode(tensor, kind="weight")
            if abs(frame.numel() / size - 1.0) <= _REUSE_TOLERANCE:
                out.reused += 1
                out.used.update(Codec.frame_parameters(frame.numpy()).book_ids)
                return frame
        spec = spec_for(tensor.dtype)
        u8 = _as_u8(tensor)
        planned = FileTensor(
            name=fqn,
            dtype=spec.name,
            shape=list(tensor.shape),
            offset=0,
            nbytes=u8.size,
            kind=self.kind_of(fqn),
            codable=True,
        )
        plan_bytes(planned, u8, out.chooser)
        out.planned += 1
        frame = self._threads(planned.codec).encode(tensor, kind="weight")  # make_codec keys its books as "weight"
        out.used.update(Codec.frame_parameters(frame.numpy()).book_ids)
        if earlier is None:
            out.plans[key] = (planned.codec, frame.numel())
        return frame

    def _threads(self, codec: Codec) -> Codec:
        """The codec's books and chunk size on :attr:`coding_threads` threads (the same frames)."""
        if self.coding_threads == 1:
            return codec
        found = self._threaded.get(id(codec))
        if found is None or found[0] is not codec:
            found = self._threaded[id(codec)] = (
                codec,
                Codec(
                    codec.codebooks,
                    threads=self.coding_threads,
                    chunk_elems=codec.chunk_elems,
                    split_exponent=codec.split_exponent,
                ),
            )
        return found[1]


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
        self.used: set = set()  # ids of every book or group a frame of the file names
        self.checksums: dict = {}  # offset -> (length, CRC-32) of items stored as DCP stores them

    def record(self, item, pos: int, length: int, descriptors) -> None:
        self.results.append(
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(self.name, pos, length, transform_descriptors=descriptors),
            )
        )

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

    def write_plain(self, item, payload) -> None:
        """Append an item stored as DCP stores it, and note its CRC-32 for the book table."""
        self.checksums[self.pos] = (len(payload), zlib.crc32(payload))
        self.write(item, payload)


def _torch_save(tensor: torch.Tensor) -> memoryview:
    """A tensor as FileSystemWriter stores it: ``torch.save`` of it, storage cut to its elements."""
    if tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # torch.save writes the whole storage of a view
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getbuffer()


class Reader(FileSystemReader):
    """A DCP ``StorageReader`` for every DCP directory: :class:`Writer`'s, plain DCP, DCP + ZStandard.

    Use as ``dcp.load(state_dict, storage_reader=Reader(path))``, on any number of ranks
    (or in one process without a process group): DCP's planner reshards. Frames are
    decoded bit for bit into the destination tensors; items stored as DCP stores them
    (plain DCP directories too, and those written with ``FileSystemWriter(...,
    _extensions=[ZStandard()])``) are read as ``FileSystemReader`` reads them, after the
    checks below.

    Nothing from the directory is trusted: see the module docstring. Problems raise
    :class:`CheckpointError` naming the file; :func:`load` surfaces it unwrapped.

    Args:
        path: the checkpoint directory.
        codebooks: the shipped books, for data files written before files held every
            book they use (None: the default set); later files need none.
        trusted: hand non-tensor values to DCP's planner as the file holds them
            (DCP's planner loads them with ``weights_only=False``), without first
            checking that ``torch.load(weights_only=True)`` accepts them. Only for
            directories you wrote yourself.

    Raises:
        CodebookError: bad ``codebooks`` (a missing or invalid file, or another type).
    """

    def __init__(self, path, *, codebooks=None, trusted: bool = False):
        super().__init__(path)
        self.codebooks = as_codebook_set(codebooks)
        self.trusted = bool(trusted)
        self._chunks: dict = {}  # (fqn, chunk offsets) -> (dtype, chunk sizes)
        self._codecs: dict = {}  # (dtype name, book ids) -> Codec
        self._last_pack = None  # ((path, offset, length), its decoded elements)
        self._preread = None  # metadata that load() read and checked, handed to DCP's first read_metadata
        self._counts = Counts((FRAME_DESCRIPTOR, PACK_DESCRIPTOR))

    # No **kwargs: DCP then reads the global .metadata only, never a rank's own.
    def read_metadata(self) -> Metadata:
        """Read ``.metadata`` with an allow-list unpickler and check it.

        Returns:
            The checkpoint's :class:`Metadata`.

        Raises:
            CheckpointError: no such file, not a regular file, larger than
                :data:`MAX_METADATA_BYTES`, a pickle that refers to anything but DCP's
                metadata classes, or records that point outside the directory, chunks
                that do not tile their tensors.
        """
        md, self._preread = self._preread, None
        if md is None:
            md = read_metadata(self.path)
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
        started = time.perf_counter()
        per_file: dict = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise CheckpointError(
                    f"{os.path.join(os.fspath(self.path), METADATA_NAME)}: no storage record "
                    f"for {printable(req.storage_index.fqn, 80)}"
                )
            per_file.setdefault(info.relative_path, []).append((req, info))
        for name, reqs in per_file.items():
            path = os.path.join(os.fspath(self.path), name)
            try:
                data = DataFile(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: no such file (the checkpoint's metadata names it)") from None
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
            seen: set = set()
            try:
                for req, info in sorted(reqs, key=lambda r: r[1].offset):
                    try:
                        self._read_item(data, req, info, planner)
                        self._counts.add_read(req, info, seen, self._chunks, req.type == LoadItemType.BYTE_IO)
                    except CheckpointError:
                        raise
                    except (
                        FrameError,
                        CodebookError,
                        OSError,
                        RuntimeError,
                        ValueError,
                        TypeError,
                        EOFError,
                        pickle.UnpicklingError,
                    ) as exc:
                        raise CheckpointError(
                            f"{path}: {printable(req.storage_index.fqn, 80)}: {printable(str(exc), 200)}"
                        ) from None
            finally:
                data.close()
                self._last_pack = None
        self._counts.seconds += time.perf_counter() - started
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def stats(self) -> Summary:
        """Return what this reader's loads did on this rank (a Summary, ``op="load"``: :mod:`._dcp_stats`)."""
        return self._counts.summary("load", 1)

    def verify(self) -> dict:
        """Check every data file the metadata names, without a state dict to load into.

        The metadata is read through :meth:`read_metadata`'s checks; each data file's
        book table (CRC-32, every book and group rebuilt); every frame and pack frame
        decoded in full (each chunk's checksum) against what the metadata says it holds;
        every item stored as DCP stores it against its CRC-32 (files written before
        checksums, and torch's own, record none: those items are checked to be
        ``torch.save`` records torch reads in bounded time).

        Returns:
            Counts: ``files``, ``frames``, ``packs``, ``crc`` (items checked by CRC-32),
            ``unchecked`` (items with no checksum).

        Raises:
            CheckpointError: anything corrupted, truncated or foreign, naming the file.
        """
        md = read_metadata(self.path)
        counts = dict.fromkeys(("files", "frames", "packs", "crc", "unchecked"), 0)
        per_file: dict = {}
        for index, info in md.storage_data.items():
            per_file.setdefault(info.relative_path, []).append((index, info, md.state_dict_metadata[index.fqn]))
        for name, items in sorted(per_file.items()):
            path = os.path.join(os.fspath(self.path), name)
            try:
                data = DataFile(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: no such file (the checkpoint's metadata names it)") from None
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
            counts["files"] += 1
            try:
                if data.has_trailer():
                    data.books(self.codebooks)
                seen: set = set()
                for index, info, entry in sorted(items, key=lambda x: x[1].offset):
                    fqn = printable(index.fqn, 80)
                    try:
                        self._verify_item(data, index, info, entry, seen, counts, fqn)
                    except CheckpointError:
                        raise
                    except (FrameError, CodebookError, OSError, RuntimeError, ValueError, TypeError) as exc:
                        raise CheckpointError(f"{path}: {fqn}: {printable(str(exc), 200)}") from None
            finally:
                data.close()
        return counts

    def _verify_item(self, data: DataFile, index, info, entry, seen: set, counts: dict, fqn: str) -> None:
        descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
        packed = len(descriptors) == 2 and descriptors[0] == PACK_DESCRIPTOR
        if descriptors not in ((), (FRAME_DESCRIPTOR,), (ZSTD_DESCRIPTOR,)) and not packed:
            raise CheckpointError(
                f"{data.path}: {fqn} was written with DCP extension(s) "
                f"{printable(', '.join(descriptors), 80)}, which this reader does not know"
            )
        tensor = isinstance(entry, TensorStorageMetadata)
        if packed or descriptors == (FRAME_DESCRIPTOR,):
            if not tensor:
                raise CheckpointError(f"{data.path}: {fqn}: a non-tensor value recorded as a frame")
            if (info.offset, info.length) in seen:
                return  # a pack frame checked for an earlier item
            seen.add((info.offset, info.length))
            dtype = entry.properties.dtype
            sizes = next((c.sizes for c in entry.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
            if sizes is None:
                raise CheckpointError(f"{data.path}: {fqn}: the metadata has no chunk at {tuple(index.offset or ())}")
            what = "pack frame" if packed else "frame"
            buf, params = self._read_frame(
                data, info, dtype, _PACK_MAX_ELEMS if packed else math.prod(sizes), not packed, what, fqn
            )
            self._codec(data, params).decode(buf, out=torch.empty(params.numel, dtype=dtype))
            counts["packs" if packed else "frames"] += 1
            return
        crc = data.checksum(info.offset, info.length, fqn)
        limit = (
            _MAX_VALUE_BYTES
            if not tensor
            else math.prod(entry.size) * torch.empty(0, dtype=entry.properties.dtype).element_size() + _TORCH_SAVE_SLACK
        )
        raw = self._plain_bytes(data, info, descriptors, limit, fqn)
        if crc is not None:
            counts["crc"] += 1
            return
        counts["unchecked"] += 1
        check_torch_zip(raw, MAX_TENSOR_PICKLE if tensor else MAX_VALUE_PICKLE, f"{data.path}: {fqn}")

    def _plain_bytes(self, data: DataFile, info, descriptors, limit: int, fqn: str) -> bytes:
        """The bytes of an item stored as DCP stores it (decompressed if DCP's ZStandard wrote it), checked."""
        if info.length > limit:
            raise CheckpointError(
                f"{data.path}: {fqn}: its record claims {info.length} bytes, more than the {limit} the item may take"
            )
        raw = data.read(info.offset, info.length, fqn).tobytes()
        crc = data.checksum(info.offset, info.length, fqn)
        if crc is not None and zlib.crc32(raw) != crc:
            raise CheckpointError(f"{data.path}: {fqn}: its bytes are corrupted (CRC-32 mismatch)")
        if descriptors == (ZSTD_DESCRIPTOR,):
            raw = zstd_decode(raw, limit, f"{data.path}: {fqn}")
        return raw

    def _read_item(self, data: DataFile, req, info, planner) -> None:
        descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
        fqn = printable(req.storage_index.fqn, 80)
        packed = len(descriptors) == 2 and descriptors[0] == PACK_DESCRIPTOR
        if descriptors not in ((), (FRAME_DESCRIPTOR,), (ZSTD_DESCRIPTOR,)) and not packed:
            raise CheckpointError(
                f"{data.path}: {fqn} was written with DCP extension(s) "
                f"{printable(', '.join(descriptors), 80)}, which this reader does not know"
            )
        if req.type == LoadItemType.BYTE_IO:
            if descriptors not in ((), (ZSTD_DESCRIPTOR,)):
                raise CheckpointError(f"{data.path}: {fqn}: a non-tensor value recorded as a frame")
            raw = self._plain_bytes(data, info, descriptors, _MAX_VALUE_BYTES, fqn)
            if self.trusted:
                planner.load_bytes(req, io.BytesIO(raw))
                return
            try:
                value = load_checked(raw, MAX_VALUE_PICKLE, f"{data.path}: {fqn}")
            except CheckpointError as exc:
                raise CheckpointError(
                    f"{exc}; a non-tensor value that DCP's planner would unpickle with weights_only=False. "
                    "If you trust this checkpoint, read it with Reader(path, trusted=True)"
                ) from None
            planner.load_bytes(req, resave(value))
            return
        known = self._chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        if known is None:
            raise CheckpointError(
                f"{data.path}: {fqn}: the metadata has no chunk at {tuple(req.storage_index.offset or ())}"
            )
        dtype, sizes = known
        if len(req.storage_offsets) != len(sizes) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, sizes)
        ):
            raise CheckpointError(f"{data.path}: {fqn}: a read outside its stored chunk {sizes}")
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise CheckpointError(
                f"{data.path}: {fqn}: the destination has shape {tuple(target.shape)}, the read {tuple(req.lengths)}"
            )
        numel = math.prod(sizes)
        if packed:
            stored = self._unpack(data, info, dtype, sizes, numel, descriptors[1], fqn)
        elif descriptors == (FRAME_DESCRIPTOR,):
            stored = self._decode(data, info, dtype, sizes, numel, target, fqn)
        else:
            stored = self._torch_load(data, info, descriptors, dtype, sizes, numel, fqn)
        if stored is not target:
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                stored = stored.narrow(dim, offset, length)
            target.copy_(stored)
        planner.commit_tensor(req, target)

    def _read_frame(self, data: DataFile, info, dtype, numel: int, exact: bool, what: str, fqn):
        """Read and check a frame record of numel elements of dtype (at most numel unless exact).

        Returns:
            (the frame's bytes, its parameters).
        """
        if dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(
                f"{data.path}: {fqn}: a {what} recorded for a {dtype} tensor, which the codec does not code"
            )
        spec = spec_for(dtype)
        most = max_frame_bytes(numel, spec)
        if info.length > most:
            raise CheckpointError(
                f"{data.path}: {fqn}: its record claims a {info.length}-byte {what}; one of "
                f"{'' if exact else 'at most '}{numel} x {spec.name} takes at most {most}"
            )
        buf = data.read(info.offset, info.length, fqn)
        params = Codec.frame_parameters(buf)
        if params.dtype != dtype or (params.numel != numel if exact else params.numel > numel):
            raise CheckpointError(
                f"{data.path}: {fqn}: the {what} holds {params.numel} x {params.spec.name}, "
                f"{'the metadata says' if exact else 'one holds at most'} {numel} x {spec.name}"
            )
        return buf, params

    def _decode(self, data: DataFile, info, dtype, sizes, numel, target, fqn):
        """Decode a frame record: into target when it is the whole chunk, else into a new tensor."""
        buf, params = self._read_frame(data, info, dtype, numel, True, "frame", fqn)
        whole = (
            tuple(target.shape) == tuple(sizes)
            and target.dtype == dtype
            and target.is_contiguous()
            and target.device.type == "cpu"
        )
        out = target if whole else torch.empty(sizes, dtype=dtype)
        self._codec(data, params).decode(buf, out=out)
        return out

    def _unpack(self, data: DataFile, info, dtype, sizes, numel, where: str, fqn):
        """An item's range of a pack frame (decoded once for the items that follow it in the file)."""
        found = _PACK_RANGE.fullmatch(where)
        if found is None:
            raise CheckpointError(f"{data.path}: {fqn}: a malformed pack range {printable(where, 60)}")
        start, count = int(found.group(1)), int(found.group(2))
        if count != numel:
            raise CheckpointError(
                f"{data.path}: {fqn}: its pack range holds {count} elements, the metadata says {numel}"
            )
        key = (data.path, info.offset, info.length)
        if self._last_pack is None or self._last_pack[0] != key:
            buf, params = self._read_frame(data, info, dtype, _PACK_MAX_ELEMS, False, "pack frame", fqn)
            self._last_pack = (key, self._codec(data, params).decode(buf, out=torch.empty(params.numel, dtype=dtype)))
        pack = self._last_pack[1]
        if start + count > pack.numel():
            raise CheckpointError(
                f"{data.path}: {fqn}: its pack range {start}+{count} lies outside the pack frame "
                f"of {pack.numel()} elements"
            )
        return pack[start : start + count].view(sizes)

    def _codec(self, data: DataFile, params) -> Codec:
        key = (params.spec.name, params.book_ids)
        codec = self._codecs.get(key)
        if codec is None:
            groups = [
                Codebook.raw_book() if book_id == RAW_ID else data.lookup(book_id, self.codebooks)
                for book_id in params.book_ids
            ]
            # Frames carry their chunk size; the codec's own is not used to decode.
            codec = self._codecs[key] = make_codec(groups, params.spec, CHUNK_SIZES[0])
        return codec

    def _torch_load(self, data: DataFile, info, descriptors, dtype, sizes, numel, fqn):
        """Load a tensor stored as DCP stores it, checked against its metadata."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        raw = self._plain_bytes(data, info, descriptors, numel * itemsize + _TORCH_SAVE_SLACK, fqn)
        check_torch_zip(raw, MAX_TENSOR_PICKLE, f"{data.path}: {fqn}")
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != tuple(sizes):
            what = (
                f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            raise CheckpointError(f"{data.path}: {fqn}: holds {what}, the metadata says {dtype} {tuple(sizes)}")
        return tensor


def load(state_dict: dict, path, *, process_group=None, planner=None, codebooks=None, trusted: bool = False) -> Summary:
    """``dcp.load`` from a :class:`Reader` of path, raising its CheckpointError itself.

    ``dcp.load`` wraps what a storage reader raises in DCP's ``CheckpointException``
    (per rank, with tracebacks); this raises the first rank's :class:`CheckpointError`
    instead, and checks the metadata before DCP plans anything.

    Args:
        state_dict: as for ``dcp.load``: tensors allocated where they are to be loaded.
        path: the checkpoint directory.
        process_group: as for ``dcp.load``.
        planner: as for ``dcp.load``.
        codebooks: as for :class:`Reader`.
        trusted: as for :class:`Reader`.

    Returns:
        This rank's figures: :meth:`Reader.stats`.

    Raises:
        CheckpointError: the directory is missing, foreign, truncated or tampered, or
            lacks an entry the state dict asks for.
        CheckpointException: any other failure, as ``dcp.load`` raises it.
    """
    reader = Reader(path, codebooks=codebooks, trusted=trusted)
    reader._preread = read_metadata(reader.path)  # checked once, before DCP plans; DCP's own read gets it
    try:
        dcp_load(state_dict, storage_reader=reader, process_group=process_group, planner=planner)
        return reader.stats()
    except CheckpointException as exc:
        for rank in sorted(exc.failures):
            error = exc.failures[rank][0]
            if isinstance(error, CheckpointError):
                raise error.with_traceback(None) from None
        for rank in sorted(exc.failures):
            error = exc.failures[rank][0]
            # DCP's planner: the state dict asks for an entry the metadata does not list
            if isinstance(error, RuntimeError) and str(error).startswith("Missing key in checkpoint"):
                raise CheckpointError(
                    f"{os.path.join(os.fspath(reader.path), METADATA_NAME)}: {printable(str(error), 200)}"
                ) from None
        raise
