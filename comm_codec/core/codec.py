"""The codec: tensors in, self-describing frames out, and back, bit for bit.

:class:`Codec` holds a :class:`~comm_codec.core.codebooks.CodebookSet` (the model) and drives
the numba kernels (the coder). Encoding is one pass over the data per stream after a
cheap planning pass that sizes every chunk, so the frame is allocated once at its exact
size: encode allocates the frame plus O(chunks) scratch, decode the output plus
O(chunks) scratch (and one chunk of scratch per thread for chunks with a zero mask).
A frame under 1 MiB that threads would not speed up (one chunk, or ``threads=1``) is
planned and written by one kernel call, header included: checkpoints code hundreds of
small tensors, and the host work around separate calls cost more than their coding.

:meth:`Codec.encode_array` and :meth:`Codec.decode_into` are the same coder on numpy
arrays of element bit patterns: the checkpoint commands code a file's bytes through them
without importing torch (this module imports torch only inside the methods that take or
make tensors).

CUDA tensors are coded on their GPU by the numba.cuda kernels of
:mod:`comm_codec.kernels.cuda`, driven by :mod:`comm_codec.core.gpu` (imported on first use),
on torch's current stream, into
the same frame bytes: a frame made on either device decodes on the other. A GPU encode
waits for the device once (to learn the frame's length); a GPU decode waits to read the
header (once, twice past 4 KiB of header) and for the per-chunk status that becomes
FrameError.

Example::

    >>> import torch, comm_codec as cc
    >>> codec = cc.Codec()
    >>> g = torch.randn(1000, dtype=torch.bfloat16) * 1e-3
    >>> frame = codec.encode(g, kind="gradient")
    >>> torch.equal(codec.decode(frame).view(torch.int16), g.view(torch.int16))
    True
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import numpy as np

# kernels.jit imports numba first and turns a bad numba setting (NUMBA_NUM_THREADS) into one clear error
from ..kernels import jit  # noqa: F401  (isort: skip)
import numba  # noqa: E402 - after the kernels: see above

from ..kernels.decode import decode_range
from ..kernels.encode import encode_frame, encode_frame_into, encode_range, frame_room, plan_range
from ..kernels.layout import STATUS_MESSAGES
from . import frame as _frame
from . import precompile as _precompile
from .codebooks import CodebookSet, as_codebook_set
from .frame import FrameError
from .memory import POOL_MIN_BYTES, empty_bytes, empty_output, front
from .parallel import run_ranges, thread_count
from .streams import StreamSpec, as_bits, is_accumulable, spec_for
from .tables import KernelTables, TablesCache, encode_tables

if TYPE_CHECKING:  # annotations only: torch is imported where a tensor is first used
    import torch

__all__ = ["Codec", "DEFAULT_CHUNK_ELEMS", "DECODE_CACHE_SIZE"]

log = logging.getLogger(__name__)

# 16 Ki elements. Smaller chunks follow the scale of each layer more closely through
# their reference exponent: on TinyLM's bf16 gradient buckets the frame ratio is 1.425
# with 64 Ki-element chunks, 1.470 with 32 Ki, 1.497 with 16 Ki, 1.509 with 8 Ki, while
# the fixed per-chunk cost (table entry, lane lengths, padding: ~40 bytes) stays ~0.2 %.
# 32 KiB of bf16 per chunk also stays in L1/L2 while its streams are coded.
DEFAULT_CHUNK_ELEMS = 1 << 14

# Decode tables kept per codec, by the frame's tuple of book ids (see TablesCache).
DECODE_CACHE_SIZE = 32


_NO_ORDER = np.zeros(0, dtype=np.int64)  # decode_range: order the chunks itself
_NO_ACC = np.zeros(0, dtype=np.uint32)  # decode_range: into the output, not added


# Tensors smaller than this are coded on the calling thread: handing ranges to the pool
# and waiting for them costs tens of microseconds, what a thread codes 32 KiB in.
_THREADS_MIN_BYTES = 1 << 18


def _threads_for(nchunks: int, nbytes: int, threads: int | None) -> int:
    """Threads to share a frame of ``nchunks`` chunks and ``nbytes`` elements' bytes among."""
    if nchunks <= 1 or nbytes < _THREADS_MIN_BYTES:
        return 1
    return thread_count(threads)


def _read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only view: numba compiles a kernel again for each mix of read-only
    and writable arrays (a frame from bytes or a mapped file is read-only), and decoding
    writes none of the frame's arrays, so they are always passed read-only."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def _chunk_order(books: np.ndarray) -> np.ndarray:
    """Chunks in the order the decode kernel takes them by itself: by stream 0's book, in
    chunk order within a book (its counting sort, as a stable sort), for threads to split."""
    return np.argsort(books & 15, kind="stable").astype(np.int64)


def _raise_on_status(status: np.ndarray, nchunks: int) -> None:
    """Raise FrameError naming the first bad chunk, if the decode kernel reported any."""
    bad = np.nonzero(status)[0]
    if bad.size:
        first = int(bad[0])
        raise FrameError(
            f"chunk {first} of {nchunks} is bad: {STATUS_MESSAGES[int(status[first])]}"
            + (f" ({bad.size} chunks bad)" if bad.size > 1 else "")
        )


def _check_accumulable(params, acc, device) -> None:
    """Raise unless a frame of these parameters can be added into acc (see Codec.decode_accumulate)."""
    if not is_accumulable(params.spec):
        raise TypeError(
            f"decode_accumulate adds bfloat16, float16 or float32 frames; this one holds {params.spec.dtype}"
        )
    if acc.numel() != params.numel:
        raise ValueError(f"acc has {acc.numel()} elements, the frame holds {params.numel}")
    if acc.requires_grad:
        raise ValueError(
            "acc requires grad: decode_accumulate writes into it behind autograd's back; pass acc.detach()"
        )
    if acc.device != device or not acc.is_contiguous():
        where = "CPU" if device.type == "cpu" else str(device)
        raise ValueError(f"acc must be a contiguous {where} tensor (on the frame's device), got one on {acc.device}")


def _is_cuda_tensor(x) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only once torch is loaded
    return torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _as_bits_array(a, spec) -> np.ndarray:
    """A numpy array's bytes as a 1-D array of ``spec.bits_dtype`` (a view), for the kernels."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError("the array must be contiguous")
    if a.dtype == spec.bits_dtype and a.ndim == 1:
        return a
    if a.nbytes % spec.itemsize:
        raise ValueError(f"{a.nbytes} bytes are not a whole number of {spec.name} elements")
    return a.reshape(-1).view(np.uint8).view(spec.bits_dtype)


class Codec:
    """Encode tensors into frames and decode them, with fixed codebooks.

    A codec is cheap to keep and safe to share between threads; reuse one per process.

    Args:
        codebooks: the :class:`CodebookSet` to code with, or a path to one saved with
            :meth:`CodebookSet.save`; None loads :meth:`CodebookSet.default` (the books
            shipped in ``codebooks/``).
        threads: numba threads for encode/decode; None uses numba's setting
            (``NUMBA_NUM_THREADS`` / ``numba.set_num_threads``).
        chunk_elems: elements per independently decodable chunk.
        checksum: store and verify a checksum per chunk (detects corruption of the
            payload; the header is always CRC-checked).
        split_exponent: in frames of float16 and the float8 types, code each element's
            exponent alone and store the 3 bits that share its byte (fp16's top
            mantissa bits, fp8's low mantissa bits and sign) uncoded beside it. Decode
            runs 1.4-1.6x as fast on those types for 0.4-0.65 % of ratio (2 % on e5m2;
            see ``comm_codec/core/frame_format.md``): the choice for the wire, the
            default. False keeps the ratio and writes frames that decoders from before
            the split (frame versions 1 and 2) read; the checkpoint writers choose that.
            Decoding takes both kinds of frame either way; other dtypes are unaffected.

    Raises:
        TypeError: codebooks is neither a CodebookSet, a path nor None.
        FileNotFoundError, CodebookError: a codebooks path that is missing or not a
            codebook file.
        ValueError: threads or chunk_elems out of range.

    Attributes:
        decode_cache: the decode tables this codec keeps, by the book ids that frames
            name and their split bits (a :class:`comm_codec.core.tables.TablesCache` of
            :data:`DECODE_CACHE_SIZE` entries; ``len()`` and ``in`` tell what it holds).
    """

    def __init__(
        self,
        codebooks: CodebookSet | None = None,
        threads: int | None = None,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        checksum: bool = True,
        split_exponent: bool = True,
    ):
        codebooks = as_codebook_set(codebooks)
        if threads is not None and not 1 <= int(threads) <= numba.config.NUMBA_NUM_THREADS:
            raise ValueError(
                f"threads must be in 1..{numba.config.NUMBA_NUM_THREADS} (NUMBA_NUM_THREADS), got {threads}"
            )
        if not 8 <= int(chunk_elems) <= _frame.MAX_CHUNK_ELEMS:
            raise ValueError(f"chunk_elems must be in 8..{_frame.MAX_CHUNK_ELEMS}, got {chunk_elems}")
        self.codebooks = codebooks
        self.threads = None if threads is None else int(threads)
        self.chunk_elems = int(chunk_elems)
        self.checksum = bool(checksum)
        self.split_exponent = bool(split_exponent)
        self._enc_cache: dict = {}  # (kind, dtype): at most len(KINDS) x len(SUPPORTED_DTYPES)
        self._heads: dict = {}  # (kind, dtype) -> header bytes for _encode_serial
        self.decode_cache = TablesCache(DECODE_CACHE_SIZE)

    # -- encode -------------------------------------------------------------------------
    def encode(self, tensor, kind: str = "gradient") -> torch.Tensor:
        """Encode a tensor into a frame.

        Args:
            tensor: a CPU or CUDA tensor of a supported dtype (see
                :data:`comm_codec.core.streams.SUPPORTED_DTYPES`), any shape; non-contiguous
                tensors are copied first. A CUDA tensor is coded on its GPU, on torch's
                current stream, and its frame stays there.
            kind: which books to use: "gradient", "reduced_gradient", "activation",
                "weight", "optimizer_state" (see :class:`CodebookSet`).

        Returns:
            The frame: a 1-D torch.uint8 tensor on the tensor's device. Never longer
            than the raw tensor plus the header (:func:`comm_codec.core.frame.header_size`)
            plus at most 7 bytes of padding per chunk and stream: a stream that coding
            would not shrink is stored raw.

        Raises:
            TypeError: not a tensor, or an unsupported dtype.
            ValueError: a tensor neither on the CPU nor on a CUDA device, or an unknown
                kind.
        """
        import torch

        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            return self.encode_cuda(tensor, kind)
        bits, spec = as_bits(tensor)
        return torch.from_numpy(self.encode_array(bits, spec, kind))

    def encode_array(self, bits: np.ndarray, spec, kind: str = "gradient") -> np.ndarray:
        """Encode elements given as a numpy array of their bit patterns into a frame.

        The same frame :meth:`encode` makes of a tensor holding these bits: the
        checkpoint commands code a file's bytes this way, without torch.

        Args:
            bits: a 1-D contiguous array of ``spec.bits_dtype`` (see
                :func:`comm_codec.core.streams.as_bits`), or any contiguous array whose
                bytes are the elements (viewed as ``spec.bits_dtype``).
            spec: the elements' :class:`~comm_codec.core.streams.StreamSpec`, or a dtype
                :func:`~comm_codec.core.streams.spec_for` takes (``"bfloat16"``, ``"bf16"``).
            kind: which books to use, as for :meth:`encode`.

        Returns:
            The frame, a 1-D numpy uint8 array.

        Raises:
            TypeError: bits is not a numpy array, or an unsupported dtype.
            ValueError: bits not contiguous, its size not a whole number of elements, or
                an unknown kind.
        """
        spec = spec if isinstance(spec, StreamSpec) else spec_for(spec)
        bits = _as_bits_array(bits, spec)
        numel = bits.size
        # One kernel call for a frame without threads: a codec of one thread (checkpoints),
        # or a small tensor of one chunk. It writes each chunk as it goes; the threaded
        # path plans every chunk first, a second pass over the elements (on one thread
        # 20-35 % slower for MiniLM's 1-4 MiB weights).
        if 0 < numel and (self.threads == 1 or (numel <= self.chunk_elems and numel * spec.itemsize < POOL_MIN_BYTES)):
            return self._encode_serial(bits, spec, kind)
        return self._encode_planned(bits, spec, kind)

    def _encode_planned(self, bits: np.ndarray, spec, kind: str) -> np.ndarray:
        """encode_array in three steps: plan every chunk, allocate the frame at its size, write it."""
        tables = self._encode_tables(kind, spec)
        numel = bits.size
        ns = spec.nstreams
        nchunks = -(-numel // self.chunk_elems)
        cflags = np.zeros(nchunks, dtype=np.uint8)
        refs = np.zeros(nchunks, dtype=np.uint8)
        books = np.zeros(nchunks, dtype=np.uint16)
        sizes = np.zeros((nchunks, ns), dtype=np.uint32)
        args = (self.chunk_elems, spec.exp_shift, tables.split)
        threads = _threads_for(nchunks, numel * spec.itemsize, self.threads)
        with _precompile.first_use("encode", spec):
            if nchunks:
                run_ranges(
                    plan_range,
                    nchunks,
                    threads,
                    lambda lo, hi: (
                        bits,
                        *args,
                        tables.enc_len,
                        tables.nbooks,
                        tables.raw,
                        cflags,
                        refs,
                        books,
                        sizes,
                        lo,
                        hi,
                    ),
                )
            counts = _frame.chunk_counts(numel, self.chunk_elems, nchunks)
            lengths = _frame.payload_bytes(cflags.astype(np.int64), sizes, counts)
            hsize = _frame.header_size(ns, nchunks)
            offsets = (hsize + np.concatenate(([0], np.cumsum(lengths)[:-1]))).astype(np.int64)
            total = int(hsize + lengths.sum())
            out8 = empty_bytes(total)
            out64 = out8.view(np.uint64)
            checksums = np.zeros(nchunks, dtype=np.uint32)
            if nchunks:
                run_ranges(
                    encode_range,
                    nchunks,
                    threads,
                    lambda lo, hi: (
                        bits,
                        *args,
                        tables.enc_code,
                        tables.enc_len,
                        *tables.pairs,
                        cflags,
                        refs,
                        books,
                        sizes,
                        offsets,
                        out8,
                        out64,
                        checksums,
                        self.checksum,
                        lo,
                        hi,
                    ),
                )
        table = np.zeros(nchunks, dtype=_frame.table_dtype(ns))
        table["cflags"], table["ref"], table["books"], table["checksum"] = cflags, refs, books, checksums
        table["sizes"] = sizes
        _frame.write_header(out8, spec, numel, self.chunk_elems, self._flags(tables), tables.ids, table)
        return out8

    def _encode_serial(self, bits: np.ndarray, spec, kind: str) -> np.ndarray:
        """encode_array by one kernel call that writes the whole frame (no threads).

        A checkpoint writer codes hundreds of small tensors per save (a DCP save of
        MiniLM: 189 of its ~300 tensors hold under 16 Ki elements); around the three
        kernel calls of :meth:`_encode_planned`, the host work (scratch arrays, offsets,
        the structured chunk table, the header) cost ~40 us a call, more than coding them.
        A frame whose room (its largest size) reaches POOL_MIN_BYTES is written into a
        recycled block, as the planned path's frames are.
        """
        key = (kind, spec.name)
        head = self._heads.get(key)
        tables = self._encode_tables(kind, spec)
        if head is None:  # write_header's bytes: the kernel fills in numel, nchunks and the version
            ns = spec.nstreams
            buf = np.zeros(_frame.header_size(ns, 1), dtype=np.uint8)
            _frame.write_header(
                buf, spec, 0, self.chunk_elems, self._flags(tables), tables.ids, np.zeros(1, _frame.table_dtype(ns))
            )
            head = buf[: _frame.HEADER_BYTES + 8 * ns].copy()
            tables.pairs  # noqa: B018 - built outside the first-use timing below
            with _precompile.first_use("encode", spec):
                out = self._write_frame(bits, spec, tables, head)
            self._heads[key] = head
            return out
        return self._write_frame(bits, spec, tables, head)

    def _write_frame(self, bits: np.ndarray, spec, tables: KernelTables, head: np.ndarray) -> np.ndarray:
        version = _frame.VERSION_SPLIT if tables.split else _frame.VERSION
        args = (
            bits,
            self.chunk_elems,
            spec.exp_shift,
            tables.split,
            tables.enc_code,
            tables.enc_len,
            tables.nbooks,
            tables.raw,
            *tables.pairs,
            head,
            version,
            self.checksum,
        )
        room = frame_room(bits.size, self.chunk_elems, spec.nstreams, head.size)
        if room < POOL_MIN_BYTES:
            return encode_frame(*args)
        out8 = empty_bytes(room)
        pos = encode_frame_into(*args, out8)
        if pos < 0:  # pragma: no cover - the room was sized by the same function
            raise RuntimeError("encode_frame_into refused a block of its own frame_room")
        # As encode_frame: a frame under half its room (zeros) gets memory of its own.
        return front(out8, pos) if 2 * pos >= room else out8[:pos].copy()

    # -- decode -------------------------------------------------------------------------
    def decode(self, frame, out=None, max_output_bytes: int | None = None) -> torch.Tensor:
        """Decode a frame back into the elements of the tensor it was made from, bit for bit.

        A frame records the dtype and the number of elements, not the shape: the result
        is **1-D**. To get the shape back, reshape it (``codec.decode(frame).view(shape)``)
        or decode into a tensor of that shape (``codec.decode(frame, out=torch.empty(shape,
        dtype=dtype))``); the collectives and the checkpoint reader do the latter.

        **Untrusted frames:** a frame of all-zero chunks is a few hundred bytes whatever
        size it claims, so with ``max_output_bytes=None`` a 560-byte frame can make this
        allocate (and zero) 4.4 GB. Whenever the frame comes from outside the process
        (a peer, a file), pass the size you expect: ``max_output_bytes=expected_numel *
        element_size`` (or ``out=``, which bounds it by ``out``'s size).

        Args:
            frame: a frame from :meth:`encode` (1-D torch.uint8 tensor, numpy uint8
                array, or a bytes-like object: bytes, bytearray, contiguous memoryview).
                A frame on a CUDA device is decoded there, on torch's current stream,
                into a tensor on that device.
            out: optional tensor to write into, on the frame's device (the CPU for
                numpy arrays and bytes): same dtype and number of elements as the
                encoded tensor, contiguous, any shape, not requiring grad.
            max_output_bytes: refuse frames that decode to more bytes than this; None:
                no limit beyond what can be allocated (see above).

        Returns:
            ``out`` if given, else a new 1-D tensor of the original dtype; its bits
            equal the encoded tensor's (flattened).

        Raises:
            FrameError: the frame is truncated, corrupted, not a comm_codec frame, of
                an unknown version, made with codebooks this codec does not hold,
                larger than max_output_bytes, or larger than memory can hold.
            TypeError: frame or out of the wrong type or dtype (a non-contiguous
                memoryview included).
            ValueError: out of the wrong size, non-contiguous, not on the frame's
                device, or requiring grad.
        """
        import torch

        if isinstance(frame, torch.Tensor) and frame.device.type == "cuda":
            return self.decode_cuda(frame, out, max_output_bytes)
        buf = _frame.as_frame_bytes(frame)
        params = _frame.get_frame_parameters(buf)
        tables, result = self._decode_target(params, out, max_output_bytes, torch.device("cpu"))
        if params.nchunks == 0:
            return result
        self._decode_bits(buf, params, tables, as_bits(result)[0])
        return result

    def decode_into(self, frame, out: np.ndarray, max_output_bytes: int | None = None) -> np.ndarray:
        """Decode a frame into a numpy array, bit for bit: :meth:`decode` without torch.

        Args:
            frame: a frame (numpy uint8 array or bytes-like; a CPU tensor works too).
            out: a contiguous numpy array holding exactly the frame's bytes of elements
                (any dtype: its bytes are written), e.g. a uint8 buffer of
                ``numel * itemsize`` bytes.
            max_output_bytes: as for :meth:`decode`; ``out`` bounds the size anyway.

        Returns:
            ``out``.

        Raises:
            FrameError: as :meth:`decode`.
            TypeError: out is not a numpy array.
            ValueError: out is not contiguous, or not the frame's size.
        """
        buf = _frame.as_frame_bytes(frame)
        params = _frame.get_frame_parameters(buf)
        tables = self._decode_tables(params, max_output_bytes)
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
        if out.nbytes != params.numel * params.spec.itemsize:
            raise ValueError(
                f"out has {out.nbytes} bytes, the frame holds {params.numel * params.spec.itemsize} "
                f"({params.numel} x {params.spec.name})"
            )
        if params.nchunks:
            self._decode_bits(buf, params, tables, _as_bits_array(out, params.spec))
        return out

    def _decode_bits(self, buf: np.ndarray, params, tables: KernelTables, bits: np.ndarray) -> None:
        status = np.zeros(params.nchunks, dtype=np.int32)
        args = self._kernel_args(buf, params, tables)
        threads = _threads_for(params.nchunks, params.numel * params.spec.itemsize, self.threads)
        # One thread: the kernel orders the chunks itself (no host work for a small frame).
        order = _chunk_order(args[10]) if threads > 1 else _NO_ORDER
        with _precompile.first_use("decode", params.spec):
            run_ranges(
                decode_range,
                params.nchunks,
                threads,
                lambda lo, hi: (*args, bits, status, order, lo, hi, _NO_ACC, False, False),
            )
        if status.any():
            _raise_on_status(status, params.nchunks)

    def decode_accumulate(self, frame, acc, *, add: bool = True) -> torch.Tensor:
        """Decode a frame and add its values into a float32 tensor, in one pass.

        ``acc[i] += float32(decoded[i])`` element by element (``add=False``: ``acc[i] =
        float32(decoded[i])``), bit for bit what ``acc.add_(codec.decode(frame).float())``
        (``acc.copy_(...)``) gives with torch on the CPU, NaNs included: a sum's NaN is
        the added value's when it is one, else acc's, quieted (see
        :mod:`comm_codec.kernels.decode`); a float16 NaN widens with its sign and
        payload, quieted, as torch's vectorized conversion does (torch's scalar loop tail
        makes it 0x7FFFFFFF). So a rank-order sum of decoded shards stays the same sum.
        The decoded tensor never exists: each chunk is decoded into cache-resident
        scratch and added from there.

        A frame on a CUDA device is decoded there and added with torch (acc on the same
        device), as ``acc.add_(decoded)`` would.

        Args:
            frame: a frame from :meth:`encode` of a bfloat16, float16 or float32 tensor
                (any type :meth:`decode` takes). Its size is bounded by ``acc``'s: no
                ``max_output_bytes`` is needed for untrusted frames.
            acc: a contiguous float32 tensor with as many elements as the frame (any
                shape), on the frame's device, not requiring grad; updated in place.
            add: add into acc (True) or overwrite it (False, for the first addend).

        Returns:
            ``acc``.

        Raises:
            FrameError: the frame is truncated, corrupted, not a comm_codec frame, or
                needs codebooks this codec lacks. ``acc`` may then hold a partial sum:
                the chunks that decoded are added, the others are not.
            TypeError: acc is not a float32 tensor, or the frame holds another dtype
                than bfloat16, float16 or float32.
            ValueError: acc has another number of elements than the frame, is not
                contiguous, not on the frame's device, or requires grad.
        """
        import torch

        if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32:
            what = acc.dtype if isinstance(acc, torch.Tensor) else type(acc).__name__
            raise TypeError(f"acc must be a float32 tensor, got {what}")
        if isinstance(frame, torch.Tensor) and frame.device.type == "cuda":
            params = self.frame_parameters(frame)
            _check_accumulable(params, acc, frame.device)
            decoded = self.decode(frame, max_output_bytes=params.numel * params.spec.itemsize)
            (acc.view(-1).add_ if add else acc.view(-1).copy_)(decoded)
            return acc
        buf = _frame.as_frame_bytes(frame)
        params = _frame.get_frame_parameters(buf)
        _check_accumulable(params, acc, torch.device("cpu"))
        tables = self.decode_cache.get(self.codebooks, params.book_ids, params.split)
        if params.nchunks == 0:
            return acc
        tables.check_books(params.table["books"])
        spec = params.spec
        status = np.zeros(params.nchunks, dtype=np.int32)
        accu = acc.detach().view(-1).view(torch.int32).numpy().view(np.uint32)
        args = self._kernel_args(buf, params, tables)
        proto = np.empty(0, dtype=spec.bits_dtype)
        half = spec.dtype == torch.float16
        threads = _threads_for(params.nchunks, params.numel * spec.itemsize, self.threads)
        order = _chunk_order(args[10]) if threads > 1 else _NO_ORDER
        with _precompile.first_use("decode_accumulate", spec):
            run_ranges(
                decode_range,
                params.nchunks,
                threads,
                lambda lo, hi: (*args, proto, status, order, lo, hi, accu, half, bool(add)),
            )
        _raise_on_status(status, params.nchunks)
        return acc

    @staticmethod
    def _kernel_args(buf: np.ndarray, params, tables: KernelTables) -> tuple:
        """The frame and chunk-table arguments that the decode kernels share."""
        if buf.ctypes.data % 8:
            buf = buf.copy()  # a frame sliced out of a larger buffer; kernels read words
        table = params.table
        ns = params.spec.nstreams
        return tuple(
            _read_only(a) if isinstance(a, np.ndarray) else a
            for a in (
                buf,
                buf.view(np.uint64),
                params.numel,
                params.chunk_elems,
                params.spec.exp_shift,
                params.split,
                tables.dec,
                tables.multi,
                np.ascontiguousarray(table["cflags"]),
                np.ascontiguousarray(table["ref"]),
                np.ascontiguousarray(table["books"]),
                np.ascontiguousarray(table["sizes"]).reshape(params.nchunks, ns),
                params.offsets,
                np.ascontiguousarray(table["checksum"]),
                params.checksums,
            )
        )

    # -- ahead of time ---------------------------------------------------------------------
    def precompile(self, dtypes=None) -> dict:
        """Load the kernels for these dtypes now, compiling them if numba's cache lacks them.

        The first encode and decode of each element type in a process otherwise load
        the kernels from numba's on-disk cache (a fraction of a second) or, on a machine
        where nothing was cached yet, compile them (tens of seconds per element type).
        Call this where that time may go, e.g. when a training job sets up, and not
        inside a timed step; precompile once after installing (the command line's
        precompile command) so that no process compiles. See
        :mod:`comm_codec.core.precompile`.

        Args:
            dtypes: torch dtypes (or names such as ``"bf16"``) to be coded; None: all.

        Returns:
            dtype name -> seconds spent.

        Raises:
            TypeError: an unsupported dtype.
        """
        return _precompile.precompile(self, dtypes)

    # -- frames ---------------------------------------------------------------------------
    @staticmethod
    def frame_parameters(frame) -> _frame.FrameParameters:
        """Parse and check a frame's header and chunk table, on whatever device it is.

        Of a CUDA frame only the header crosses to the host (one small copy, two past
        4 KiB of header); the payload stays put. Callers that need a frame's dtype or
        element count before decoding (the collectives check what a peer sent) use this
        instead of reaching into the kernels.

        Args:
            frame: a frame from :meth:`encode`: a CPU or CUDA torch.uint8 tensor, a numpy
                uint8 array or a bytes-like object.

        Returns:
            Its :class:`comm_codec.core.frame.FrameParameters` (``numel``, ``dtype``, ...).

        Raises:
            FrameError: as :func:`comm_codec.core.frame.get_frame_parameters`.
            TypeError: not a frame's type.
        """
        if _is_cuda_tensor(frame):
            from . import gpu as _gpu

            return _gpu.frame_parameters(frame)
        return _frame.get_frame_parameters(frame)

    # -- helpers --------------------------------------------------------------------------
    def _encode_tables(self, kind: str, spec) -> KernelTables:
        key = (kind, spec.name)
        tables = self._enc_cache.get(key)
        if tables is None:
            tables = self._enc_cache[key] = encode_tables(self.codebooks, kind, spec, self.split_exponent)
        return tables

    def _flags(self, tables: KernelTables) -> int:
        """The frame header's flags for frames coded with these tables."""
        return _frame.header_flags(self.checksum, tables.split)

    def _decode_tables(self, params, max_output_bytes) -> KernelTables:
        """Check a frame's size limit and books; return its decode tables."""
        spec = params.spec
        if max_output_bytes is not None and params.numel * spec.itemsize > max_output_bytes:
            raise FrameError(
                f"frame decodes to {params.numel * spec.itemsize} bytes, more than max_output_bytes={max_output_bytes}"
            )
        tables = self.decode_cache.get(self.codebooks, params.book_ids, params.split)
        if params.nchunks:
            tables.check_books(params.table["books"])
        return tables

    def _decode_target(self, params, out, max_output_bytes, device):
        """Check a frame's size limit and books; return its tables and the output tensor."""
        import torch

        spec = params.spec
        tables = self._decode_tables(params, max_output_bytes)
        if out is not None:
            return tables, self._check_out(out, params, device)
        try:
            if device.type == "cpu":
                return tables, empty_output(params.numel, spec.dtype)
            return tables, torch.empty(params.numel, dtype=spec.dtype, device=device)
        except (RuntimeError, MemoryError) as exc:  # torch's allocator: "can't allocate memory", OOM
            raise FrameError(
                f"frame decodes to {params.numel * spec.itemsize} bytes ({params.numel} x {spec.name}), which "
                f"cannot be allocated on {device} ({type(exc).__name__}); a frame from outside the process "
                "should be decoded with max_output_bytes= the size you expect"
            ) from None

    @staticmethod
    def _check_out(out, params, device) -> torch.Tensor:
        import torch

        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != params.spec.dtype:
            raise TypeError(f"out has dtype {out.dtype}, the frame holds {params.spec.dtype}")
        if out.numel() != params.numel:
            raise ValueError(f"out has {out.numel()} elements, the frame holds {params.numel}")
        if out.requires_grad:
            raise ValueError(
                "out requires grad: decoding writes into it behind autograd's back; "
                "pass out.detach() (same memory) or a tensor without requires_grad"
            )
        if out.device != device or not out.is_contiguous():
            where = "CPU" if device.type == "cpu" else str(device)
            raise ValueError(
                f"out must be a contiguous {where} tensor (on the frame's device), got one on {out.device}"
            )
        return out

    # -- GPU ------------------------------------------------------------------------------
    def encode_cuda(self, tensor, kind: str = "gradient") -> torch.Tensor:
        """Encode with the numba.cuda kernels: a CUDA tensor, or a CPU one under the simulator.

        The frame's bytes equal :meth:`encode`'s on the CPU. :meth:`encode` calls this
        for CUDA tensors; with ``NUMBA_ENABLE_CUDASIM=1`` set (before numba is imported)
        it takes CPU tensors and runs the GPU kernels in numba's CUDA simulator, which
        is how the GPU path is tested without a GPU.

        Args:
            tensor: as for :meth:`encode`, on a CUDA device (any device under the simulator).
            kind: as for :meth:`encode`.

        Returns:
            The frame, a 1-D torch.uint8 tensor on the tensor's device.

        Raises:
            TypeError: not a tensor, or an unsupported dtype.
            ValueError: an unknown kind, or a CPU tensor without the simulator.
            RuntimeError: a CUDA tensor while ``NUMBA_ENABLE_CUDASIM=1`` is set.
        """
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        spec = spec_for(tensor.dtype)
        tables = self._encode_tables(kind, spec)
        from . import gpu as _gpu

        return _gpu.encode_frame(
            tensor, spec, tables, self._device_tables(tables, tensor.device), self.chunk_elems, self.checksum
        )

    def decode_cuda(self, frame, out=None, max_output_bytes: int | None = None) -> torch.Tensor:
        """Decode with the numba.cuda kernels: a frame on a CUDA device, or a CPU one under the simulator.

        :meth:`decode` calls this for CUDA frames; see :meth:`encode_cuda` for the
        simulator. Args, Returns and Raises: as for :meth:`decode`; the output is on the
        frame's device.
        """
        import torch

        if not isinstance(frame, torch.Tensor):
            raise TypeError(f"a frame is a 1-D torch.uint8 tensor, got {type(frame).__name__}")
        if frame.dtype != torch.uint8 or frame.dim() != 1:
            raise TypeError(f"a frame is a 1-D torch.uint8 tensor, got {frame.dtype} with shape {tuple(frame.shape)}")
        from . import gpu as _gpu

        # Checked on the host: the header alone crosses over, the payload stays put.
        params = _gpu.frame_parameters(frame)
        tables, result = self._decode_target(params, out, max_output_bytes, frame.device)
        if params.nchunks == 0:
            return result
        if not frame.is_contiguous() or frame.data_ptr() % 8:
            frame = frame.clone()  # sliced out of a larger buffer; kernels read words
        status = _gpu.decode_frame(frame, params, self._device_tables(tables, frame.device), result)
        _raise_on_status(status, params.nchunks)
        return result

    @staticmethod
    def _device_tables(tables: KernelTables, device):
        from . import gpu as _gpu

        dev = tables.on_device.get(device)
        if dev is None:
            dev = tables.on_device[device] = _gpu.DeviceTables(_gpu.Launch(device), tables)
        return dev

    def __repr__(self) -> str:
        return (
            f"Codec(codebooks={self.codebooks!r}, threads={self.threads}, chunk_elems={self.chunk_elems}, "
            f"split_exponent={self.split_exponent})"
        )
