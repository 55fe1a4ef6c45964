"""The codec: tensors in, self-describing frames out, and back, bit for bit.

:class:`Codec` holds a :class:`~comm_codec.core.codebooks.CodebookSet` (the model) and drives
the numba kernels (the coder). Encoding is one pass over the data per stream after a
cheap planning pass that sizes every chunk, so the frame is allocated once at its exact
size: encode allocates the frame plus O(chunks) scratch, decode the output plus
O(chunks) scratch (and one chunk of scratch per thread for chunks with a zero mask).

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

import collections
import contextlib
import logging
import threading

import numba
import numpy as np
import torch

from . import frame as _frame
from . import precompile as _warmup
from .codebooks import CodebookGroup, CodebookSet, as_codebook_set
from .frame import FrameError
from .huffman import Codebook
from ..kernels import cpu as _cpu
from ..kernels import empty_output, torch_threads_kept
from .streams import as_bits, spec_for

__all__ = ["Codec", "DEFAULT_CHUNK_ELEMS", "DECODE_CACHE_SIZE"]

log = logging.getLogger(__name__)

# 16 Ki elements. Smaller chunks follow the scale of each layer more closely through
# their reference exponent: on TinyLM's bf16 gradient buckets the frame ratio was 1.425
# with 64 Ki-element chunks, 1.470 with 32 Ki, 1.497 with 16 Ki, 1.509 with 8 Ki, while
# the fixed per-chunk cost (table entry, lane lengths, padding: ~40 bytes) stays ~0.2 %.
# 32 KiB of bf16 per chunk also stays in L1/L2 while its streams are coded.
DEFAULT_CHUNK_ELEMS = 1 << 14

# Decode tables kept per codec, by the frame's tuple of book ids, least recently used
# out first. A job's frames name a handful of tuples (one per kind and dtype); frames
# from an untrusted peer can name any mix of the set's ids, and each tuple's tables take
# up to 2.5 MiB (per stream 16 books x 4096 entries of 2 + 8 bytes, plain and
# multi-symbol): unbounded, 3000 crafted 88-byte frames held 864 MB; bounded, at most 80.
DECODE_CACHE_SIZE = 32


def _raise_on_status(status: np.ndarray, nchunks: int) -> None:
    """Raise FrameError naming the first bad chunk, if the decode kernel reported any."""
    bad = np.nonzero(status)[0]
    if bad.size:
        first = int(bad[0])
        raise FrameError(
            f"chunk {first} of {nchunks} is bad: {_cpu.STATUS_MESSAGES[int(status[first])]}"
            + (f" ({bad.size} chunks bad)" if bad.size > 1 else "")
        )


_ACCUMULABLE = (torch.bfloat16, torch.float16, torch.float32)


def _check_accumulable(params, acc: torch.Tensor, device: torch.device) -> None:
    """Raise unless a frame of these parameters can be added into acc (see Codec.decode_accumulate)."""
    if params.spec.dtype not in _ACCUMULABLE:
        raise TypeError(f"decode_accumulate adds bfloat16, float16 or float32 frames; this one holds {params.spec.dtype}")
    if acc.numel() != params.numel:
        raise ValueError(f"acc has {acc.numel()} elements, the frame holds {params.numel}")
    if acc.requires_grad:
        raise ValueError("acc requires grad: decode_accumulate writes into it behind autograd's back; pass acc.detach()")
    if acc.device != device or not acc.is_contiguous():
        where = "CPU" if device.type == "cpu" else str(device)
        raise ValueError(f"acc must be a contiguous {where} tensor (on the frame's device), got one on {acc.device}")


class _Tables:
    """Kernel-ready tables for one tuple of per-stream book groups."""

    __slots__ = ("ids", "nbooks", "enc_code", "enc_len", "dec", "raw", "on_device", "_multi")

    def __init__(self, groups: list[CodebookGroup]):
        ns = len(groups)
        kmax = max(len(g) for g in groups)
        self.ids = np.array([g.id_int for g in groups], dtype=np.uint64)
        self.nbooks = np.array([len(g) for g in groups], dtype=np.int64)
        self.enc_code = np.zeros((ns, kmax, 256), dtype=np.uint32)
        self.enc_len = np.zeros((ns, kmax, 256), dtype=np.uint8)
        self.dec = np.zeros((ns, kmax, 1 << 12), dtype=np.uint16)
        self.raw = np.array([g.raw for g in groups], dtype=np.bool_)
        self.on_device: dict = {}  # torch.device -> gpu.DeviceTables
        self._multi = None
        for s, group in enumerate(groups):
            for k, book in enumerate(group):
                self.enc_code[s, k], self.enc_len[s, k], self.dec[s, k] = book.tables()

    @property
    def multi(self) -> np.ndarray:
        """The multi-symbol decode tables, built on first use (~4096 lookups per book)."""
        if self._multi is None:
            multi = np.zeros(self.dec.shape[:2] + (1 << _cpu.MULTI_BITS,), dtype=np.uint64)
            _cpu.multi_tables(self.dec, multi)
            self._multi = multi
        return self._multi

    def check_books(self, books: np.ndarray) -> None:
        """Raise FrameError if a chunk names a book beyond its stream's group."""
        for s, n in enumerate(self.nbooks):
            k = (books.astype(np.int64) >> (4 * s)) & 15
            if np.any(k >= n):
                bad = int(np.nonzero(k >= n)[0][0])
                raise FrameError(
                    f"chunk {bad} says stream {s} was coded with book {int(k[bad])} of its group, "
                    f"which holds {int(n)}"
                )


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

    Raises:
        TypeError: codebooks is neither a CodebookSet, a path nor None.
        FileNotFoundError, CodebookError: a codebooks path that is missing or not a
            codebook file.
        ValueError: threads or chunk_elems out of range.
    """

    def __init__(
        self,
        codebooks: CodebookSet | None = None,
        threads: int | None = None,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        checksum: bool = True,
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
        self._enc_cache: dict = {}  # (kind, dtype): at most len(KINDS) x len(SUPPORTED_DTYPES)
        self._dec_cache: collections.OrderedDict = collections.OrderedDict()  # LRU, DECODE_CACHE_SIZE
        self._dec_lock = threading.Lock()

    # -- encode -------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, kind: str = "gradient") -> torch.Tensor:
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
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            return self._encode_cuda(tensor, kind)
        bits, spec = as_bits(tensor)
        tables = self._encode_tables(kind, spec)
        numel = bits.size
        ns = spec.nstreams
        nchunks = -(-numel // self.chunk_elems)
        cflags = np.zeros(nchunks, dtype=np.uint8)
        refs = np.zeros(nchunks, dtype=np.uint8)
        books = np.zeros(nchunks, dtype=np.uint16)
        sizes = np.zeros((nchunks, ns), dtype=np.uint32)
        args = (self.chunk_elems, spec.exp_shift)
        with self._threads(), _warmup.first_use("encode", spec):
            if nchunks:
                _cpu.plan_chunks(bits, *args, tables.enc_len, tables.nbooks, tables.raw, cflags, refs, books, sizes)
            counts = _frame.chunk_counts(numel, self.chunk_elems, nchunks)
            lengths = _frame.payload_bytes(cflags.astype(np.int64), sizes, counts)
            hsize = _frame.header_size(ns, nchunks)
            offsets = (hsize + np.concatenate(([0], np.cumsum(lengths)[:-1]))).astype(np.int64)
            total = int(hsize + lengths.sum())
            out = empty_output(total, torch.uint8)
            out8 = out.numpy()
            checksums = np.zeros(nchunks, dtype=np.uint32)
            if nchunks:
                _cpu.encode_chunks(
                    bits, *args, tables.enc_code, tables.enc_len, cflags, refs, books, sizes,
                    offsets, out8, out8.view(np.uint64), checksums, self.checksum,
                )
        table = np.zeros(nchunks, dtype=_frame.table_dtype(ns))
        table["cflags"], table["ref"], table["books"], table["checksum"] = cflags, refs, books, checksums
        table["sizes"] = sizes
        flags = _frame.FLAG_CHECKSUM if self.checksum else 0
        _frame.write_header(out8, spec, numel, self.chunk_elems, flags, tables.ids, table)
        return out

    # -- decode -------------------------------------------------------------------------
    def decode(self, frame, out: torch.Tensor | None = None, max_output_bytes: int | None = None) -> torch.Tensor:
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
        if isinstance(frame, torch.Tensor) and frame.device.type == "cuda":
            return self._decode_cuda(frame, out, max_output_bytes)
        buf = _frame._as_u8(frame)
        params = _frame.get_frame_parameters(buf)
        spec = params.spec
        tables, result = self._decode_target(params, out, max_output_bytes, torch.device("cpu"))
        if params.nchunks == 0:
            return result
        bits, _ = as_bits(result)
        status = np.zeros(params.nchunks, dtype=np.int32)
        with self._threads(), _warmup.first_use("decode", spec):
            _cpu.decode_chunks(*self._kernel_args(buf, params, tables), bits, status)
        _raise_on_status(status, params.nchunks)
        return result

    def decode_accumulate(self, frame, acc: torch.Tensor, *, add: bool = True) -> torch.Tensor:
        """Decode a frame and add its values into a float32 tensor, in one pass.

        ``acc[i] += float32(decoded[i])`` element by element (``add=False``: ``acc[i] =
        float32(decoded[i])``), bit for bit what ``acc.add_(codec.decode(frame).float())``
        (``acc.copy_(...)``) gives with torch on the CPU, NaNs included: a sum's NaN is
        the added value's when it is one, else acc's, quieted (see
        :func:`comm_codec.kernels.cpu._add_f32`); a float16 NaN widens with its sign and
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
        if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32:
            what = acc.dtype if isinstance(acc, torch.Tensor) else type(acc).__name__
            raise TypeError(f"acc must be a float32 tensor, got {what}")
        if isinstance(frame, torch.Tensor) and frame.device.type == "cuda":
            params = self.frame_parameters(frame)
            _check_accumulable(params, acc, frame.device)
            decoded = self.decode(frame, max_output_bytes=params.numel * params.spec.itemsize)
            (acc.view(-1).add_ if add else acc.view(-1).copy_)(decoded)
            return acc
        buf = _frame._as_u8(frame)
        params = _frame.get_frame_parameters(buf)
        _check_accumulable(params, acc, torch.device("cpu"))
        tables = self._decode_tables(params.book_ids)
        if params.nchunks == 0:
            return acc
        tables.check_books(params.table["books"])
        spec = params.spec
        status = np.zeros(params.nchunks, dtype=np.int32)
        accu = acc.detach().view(-1).view(torch.int32).numpy().view(np.uint32)
        with self._threads(), _warmup.first_use("decode_accumulate", spec):
            _cpu.decode_accumulate_chunks(
                *self._kernel_args(buf, params, tables), np.empty(0, dtype=spec.bits_dtype),
                spec.dtype == torch.float16, accu, bool(add), status,
            )
        _raise_on_status(status, params.nchunks)
        return acc

    @staticmethod
    def _kernel_args(buf: np.ndarray, params, tables: _Tables) -> tuple:
        """The frame and chunk-table arguments that the decode kernels share."""
        if buf.ctypes.data % 8:
            buf = buf.copy()  # a frame sliced out of a larger buffer; kernels read words
        table = params.table
        ns = params.spec.nstreams
        return (
            buf, buf.view(np.uint64), params.numel, params.chunk_elems, params.spec.exp_shift, tables.dec,
            tables.multi, np.ascontiguousarray(table["cflags"]), np.ascontiguousarray(table["ref"]),
            np.ascontiguousarray(table["books"]), np.ascontiguousarray(table["sizes"]).reshape(params.nchunks, ns),
            params.offsets, np.ascontiguousarray(table["checksum"]), params.checksums,
        )

    # -- ahead of time ---------------------------------------------------------------------
    def warmup(self, dtypes=None) -> dict:
        """Load the kernels for these dtypes now, compiling them if numba's cache lacks them.

        The first encode and decode of each element type in a process otherwise load
        the kernels (~0.3 s from numba's on-disk cache) or, on a machine where nothing
        was cached yet, compile them (~20 s per type here). Call this where that time
        may go, e.g. when a training job sets up, and not inside a timed step; run
        ``comm-codec warmup`` once after installing so that no process compiles. See
        :mod:`comm_codec.core.precompile`.

        Args:
            dtypes: torch dtypes (or names such as ``"bf16"``) to be coded; None: all.

        Returns:
            dtype name -> seconds spent.

        Raises:
            TypeError: an unsupported dtype.
        """
        return _warmup.warm(self, dtypes)

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
        if isinstance(frame, torch.Tensor) and frame.device.type == "cuda":
            from . import gpu as _gpu

            return _gpu.frame_parameters(frame)
        return _frame.get_frame_parameters(frame)

    # -- helpers --------------------------------------------------------------------------
    def _encode_tables(self, kind: str, spec) -> _Tables:
        key = (kind, spec.name)
        tables = self._enc_cache.get(key)
        if tables is None:
            groups = [self.codebooks.group(kind, spec.name, s) for s in range(spec.nstreams)]
            tables = self._enc_cache[key] = _Tables(groups)
        return tables

    def _decode_tables(self, ids: tuple) -> _Tables:
        with self._dec_lock:
            tables = self._dec_cache.get(ids)
            if tables is not None:
                self._dec_cache.move_to_end(ids)
                return tables
        groups = []
        for s, book_id in enumerate(ids):
            if book_id == "0" * 16:
                groups.append(CodebookGroup(Codebook.raw_book()))
                continue
            group = self.codebooks.group_by_id(book_id)
            if group is None:
                book = self.codebooks.by_id(book_id)  # a member of a group, named alone
                group = CodebookGroup(book) if book is not None else None
            if group is None:
                raise FrameError(
                    f"frame stream {s} was coded with codebook {book_id}, which this codec's "
                    "codebook set does not hold; decode with the books it was encoded with"
                )
            groups.append(group)
        tables = _Tables(groups)
        with self._dec_lock:
            self._dec_cache[ids] = tables
            while len(self._dec_cache) > DECODE_CACHE_SIZE:
                self._dec_cache.popitem(last=False)
        return tables

    def _decode_target(self, params, out, max_output_bytes, device: torch.device):
        """Check a frame's size limit and books; return its tables and the output tensor."""
        spec = params.spec
        if max_output_bytes is not None and params.numel * spec.itemsize > max_output_bytes:
            raise FrameError(
                f"frame decodes to {params.numel * spec.itemsize} bytes, more than max_output_bytes={max_output_bytes}"
            )
        tables = self._decode_tables(params.book_ids)
        if params.nchunks:
            tables.check_books(params.table["books"])
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
    def _check_out(out, params, device: torch.device) -> torch.Tensor:
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
    def _encode_cuda(self, tensor: torch.Tensor, kind: str = "gradient") -> torch.Tensor:
        """Encode with the numba.cuda kernels: a CUDA tensor, or a CPU one under the simulator.

        The frame's bytes equal :meth:`encode`'s on the CPU. Tests call this directly
        with CPU tensors when ``NUMBA_ENABLE_CUDASIM=1``; :meth:`encode` calls it for
        CUDA tensors.

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
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        spec = spec_for(tensor.dtype)
        tables = self._encode_tables(kind, spec)
        from . import gpu as _gpu

        return _gpu.encode_frame(tensor, spec, tables, self._device_tables(tables, tensor.device),
                                  self.chunk_elems, self.checksum)

    def _decode_cuda(self, frame: torch.Tensor, out: torch.Tensor | None = None,
                     max_output_bytes: int | None = None) -> torch.Tensor:
        """Decode with the numba.cuda kernels: a frame on a CUDA device, or a CPU one under the simulator.

        Args, Returns and Raises: as for :meth:`decode`; the output is on the frame's device.
        """
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
    def _device_tables(tables: _Tables, device: torch.device):
        from . import gpu as _gpu

        dev = tables.on_device.get(device)
        if dev is None:
            dev = tables.on_device[device] = _gpu.DeviceTables(_gpu._Launch(device), tables)
        return dev

    @contextlib.contextmanager
    def _threads(self):
        previous = numba.get_num_threads()  # per calling thread; restored for the caller
        if self.threads is not None:
            numba.set_num_threads(self.threads)
        try:
            with torch_threads_kept():
                yield
        finally:
            numba.set_num_threads(previous)

    def __repr__(self) -> str:
        return f"Codec(codebooks={self.codebooks!r}, threads={self.threads}, chunk_elems={self.chunk_elems})"
