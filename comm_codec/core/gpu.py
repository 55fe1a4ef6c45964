"""The host side of the GPU codec: launches, header reads and planning around the numba.cuda kernels.

:class:`comm_codec.Codec` calls :func:`encode_frame` and :func:`decode_frame` for
CUDA tensors; the kernels themselves are in :mod:`comm_codec.kernels.cuda` (arrays in,
status out: they import nothing of this package). This module lays out frames with
:mod:`comm_codec.core.frame`, reads their headers to the host and runs the kernels on torch's
current stream. Importing it imports ``numba.cuda``; the codec imports it only when a
CUDA tensor (or an explicit GPU call) arrives, so CPU users never pay for it.

Work per frame:

1. ``plan_kernel`` (one block per chunk) plans every chunk as the CPU planner does.
2. **The one host synchronisation of an encode**: that plan (``nchunks x (3 + ns)`` u32)
   is copied to the host. The frame's length, which the caller needs to allocate it and
   which collectives exchange, depends on every chunk's size, so it cannot be avoided.
   The host then lays out the header with :mod:`comm_codec.core.frame` (checksums still 0)
   and the chunk offsets, and copies both to the device (no wait on the device).
3. ``encode_kernel`` (one block per chunk) writes the payloads and chunk checksums.
4. ``crc_segments`` and ``crc_combine`` recompute the header's CRC-32 on the device,
   because the checksums it covers were made there.

Decode reads the header to the host (:func:`read_header`: one small copy, two for
headers over 4 KiB), checks it with :func:`comm_codec.core.frame.get_frame_parameters`, runs
``decode_kernel`` and copies the per-chunk status back (one more small copy) so that
the codec can raise FrameError.
"""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import torch
from numba import cuda

from ..kernels.cuda import (
    CRC_SEGMENT,
    DECODE_THREADS,
    MAX_STREAMS,
    PLAN_THREADS,
    SIMULATOR,
    crc_combine,
    crc_segments,
    decode_kernel,
    encode_kernel,
    plan_kernel,
)
from ..kernels.layout import UNSIGNED_BITS
from . import frame as _frame

__all__ = ["Launch", "DeviceTables", "encode_frame", "decode_frame", "header_crc", "read_header", "frame_parameters"]

_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _crc_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        r = i
        for _ in range(8):
            r = (r >> 1) ^ (0xEDB88320 if r & 1 else 0)
        table[i] = r
    return table


_CRC_TABLE = _crc_table()
if SIMULATOR:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _FakeArray
# Column b: the CRC register 1 << b after CRC_SEGMENT zero bytes; zlib.crc32(d, v) runs
# the register from ~v and returns its complement.
_CRC_SHIFT = np.array(
    [~zlib.crc32(bytes(CRC_SEGMENT), ~(1 << b) & 0xFFFFFFFF) & 0xFFFFFFFF for b in range(32)], dtype=np.uint32
)


class Launch:
    """Kernel arguments and launch configuration for one device (a CUDA one or the simulator).

    Args:
        device: a CUDA device, or (under ``NUMBA_ENABLE_CUDASIM=1``) the CPU.

    Raises:
        RuntimeError: a CUDA device while the simulator is on.
        ValueError: a CPU device without the simulator.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.real = device.type == "cuda"
        if self.real and SIMULATOR:
            raise RuntimeError("NUMBA_ENABLE_CUDASIM=1 is set: CUDA tensors cannot go through the simulator")
        if not self.real and not SIMULATOR:
            raise ValueError(f"the GPU codec needs a CUDA tensor, got one on {device}")
        self.stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream) if self.real else 0

    def array(self, t: torch.Tensor, np_dtype=None):
        """A kernel argument viewing tensor t (no copy); np_dtype re-types same-width elements."""
        t = t.detach()
        if self.real:
            a = cuda.as_cuda_array(t, sync=False)  # ordered by torch's current stream
            return a.view(np_dtype) if np_dtype is not None else a
        a = t.numpy()
        if np_dtype is not None:
            a = a.view(np_dtype)
        # Wrapped, a numpy array is not copied in and back around each launch by the
        # simulator: two views of one frame (bytes and words) stay one memory.
        return _FakeArray(a)

    def put(self, host: np.ndarray) -> torch.Tensor:
        """Copy a host array to the device (asynchronously where the memory allows)."""
        return torch.from_numpy(np.ascontiguousarray(host)).to(self.device, non_blocking=True)

    def __call__(self, kernel, grid, block, *args):
        if grid == 0:
            return
        if self.real:
            with cuda.gpus[self.device.index or 0]:
                kernel[grid, block, self.stream](*args)
        else:
            # The simulator computes with numpy scalars, which warn on the (intended)
            # wrap-around of the 64-bit hash multiply.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                kernel[grid, block](*args)


class DeviceTables:
    """A codec's per-stream tables (:class:`comm_codec.core.tables.KernelTables`) copied to one device, once.

    ``enc_code``, ``enc_len`` and ``dec`` hold every book of each stream's group
    (``[ns, nbooks_max, ...]``); ``nbooks`` says how many of them are real.
    """

    __slots__ = ("enc_code", "enc_len", "nbooks", "raw", "dec", "crc_table", "crc_shift")

    def __init__(self, launch: Launch, tables):
        self.enc_code = launch.put(tables.enc_code.view(np.int32))
        self.enc_len = launch.put(tables.enc_len)
        self.nbooks = launch.put(tables.nbooks.astype(np.int64))
        self.raw = launch.put(tables.raw.astype(np.uint8))
        self.dec = launch.put(tables.dec.view(np.int16))
        self.crc_table = launch.put(_CRC_TABLE.view(np.int32))
        self.crc_shift = launch.put(_CRC_SHIFT.view(np.int32))


def _bits_of(tensor: torch.Tensor, spec) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(_TORCH_INT[spec.itemsize])


def encode_frame(
    tensor: torch.Tensor, spec, tables, dev_tables: DeviceTables, chunk_elems: int, checksum: bool
) -> torch.Tensor:
    """Encode a tensor into a frame on its device, the same bytes as the CPU encoder.

    Args:
        tensor: a CUDA tensor (a CPU tensor under the simulator) of ``spec.dtype``.
        spec: its :class:`comm_codec.core.streams.StreamSpec`.
        tables: the codec's host tables (book ids for the header, whether exponents are split).
        dev_tables: the same tables on the tensor's device.
        chunk_elems: elements per chunk.
        checksum: compute per-chunk checksums.

    Returns:
        The frame, a 1-D torch.uint8 tensor on the tensor's device. Its bytes may still be
        being written by the device (torch's current stream orders every later use).
    """
    launch = Launch(tensor.device)
    bits_t = _bits_of(tensor, spec)
    numel = bits_t.numel()
    ns = spec.nstreams
    nchunks = -(-numel // chunk_elems)
    ra = 1 if spec.rotate else 0
    width = spec.itemsize
    bits = launch.array(bits_t, UNSIGNED_BITS[width])
    plan_t = torch.empty((nchunks, 3 + ns), dtype=torch.int32, device=tensor.device)
    if nchunks:
        launch(
            plan_kernel,
            nchunks,
            PLAN_THREADS,
            bits,
            numel,
            chunk_elems,
            width,
            ra,
            spec.exp_shift,
            tables.split,
            launch.array(dev_tables.enc_len),
            launch.array(dev_tables.nbooks),
            launch.array(dev_tables.raw),
            launch.array(plan_t, np.uint32),
        )
    # The one synchronisation: the frame's length depends on every chunk's plan.
    plan = plan_t.cpu().numpy().view(np.uint32)
    cflags = plan[:, 0].astype(np.uint8)
    sizes = np.ascontiguousarray(plan[:, 3:])
    counts = _frame.chunk_counts(numel, chunk_elems, nchunks)
    lengths = _frame.payload_bytes(cflags.astype(np.int64), sizes, counts)
    hsize = _frame.header_size(ns, nchunks)
    offsets = (hsize + np.concatenate(([0], np.cumsum(lengths)[:-1]))).astype(np.int64)
    total = int(hsize + lengths.sum())
    table = np.zeros(nchunks, dtype=_frame.table_dtype(ns))
    table["cflags"], table["ref"], table["sizes"] = cflags, plan[:, 1].astype(np.uint8), sizes
    table["books"] = plan[:, 2].astype(np.uint16)  # with the flags, decides the version write_header writes
    header = np.zeros(hsize, dtype=np.uint8)
    flags = _frame.header_flags(checksum, tables.split)
    _frame.write_header(header, spec, numel, chunk_elems, flags, tables.ids, table)
    out = torch.empty(total, dtype=torch.uint8, device=tensor.device)
    out[:hsize].copy_(torch.from_numpy(header), non_blocking=True)
    if not nchunks:
        return out
    out8 = launch.array(out)
    out64 = launch.array(out.view(torch.int64), np.uint64)
    table_pos = _frame.HEADER_BYTES + 8 * ns
    launch(
        encode_kernel,
        nchunks,
        PLAN_THREADS,
        bits,
        numel,
        chunk_elems,
        width,
        ra,
        spec.exp_shift,
        tables.split,
        launch.array(dev_tables.enc_code, np.uint32),
        launch.array(dev_tables.enc_len),
        launch.array(plan_t, np.uint32),
        launch.array(launch.put(offsets)),
        out8,
        out64,
        table_pos,
        table.dtype.itemsize,
        checksum,
    )
    if checksum:  # the header CRC covers the checksums just written
        header_crc(launch, out, hsize - 8, dev_tables)
    return out


def header_crc(launch: Launch, buf: torch.Tensor, crc_end: int, dev_tables: DeviceTables) -> None:
    """Store zlib's CRC-32 of buf[:crc_end] at buf[crc_end:crc_end+4], on the device.

    :func:`encode_frame` calls it for the header, whose chunk checksums were made on the
    device. Segments of :data:`~comm_codec.kernels.cuda.CRC_SEGMENT` bytes are CRC'd in
    parallel and joined with the "shift by L zero bytes" operator.
    """
    nseg = crc_end // CRC_SEGMENT
    seg_crcs = torch.empty(max(nseg, 1), dtype=torch.int64, device=buf.device)
    buf8 = launch.array(buf)
    launch(
        crc_segments,
        -(-nseg // 128),
        128,
        buf8,
        CRC_SEGMENT,
        nseg,
        launch.array(dev_tables.crc_table, np.uint32),
        launch.array(seg_crcs),
    )
    launch(
        crc_combine,
        1,
        1,
        buf8,
        CRC_SEGMENT,
        nseg,
        crc_end,
        launch.array(seg_crcs),
        launch.array(dev_tables.crc_shift, np.uint32),
        launch.array(dev_tables.crc_table, np.uint32),
    )


def read_header(frame: torch.Tensor) -> np.ndarray:
    """Copy a device frame's header to the host: one small copy, two past 4 KiB of header.

    Args:
        frame: a 1-D uint8 frame on a CUDA device (any device under the simulator).

    Returns:
        A host uint8 array as long as the frame whose first bytes hold the header (the
        rest is zero pages, never touched), so that
        :func:`comm_codec.core.frame.get_frame_parameters` can check the header against the
        frame's true length without the payload crossing to the host.
    """
    n = frame.numel()
    host = np.zeros(n, dtype=np.uint8)  # calloc: untouched pages cost nothing
    first = min(n, 4096)
    host[:first] = frame[:first].cpu().numpy()
    if first >= _frame.HEADER_BYTES:
        ns = int(host[6])
        nchunks = int.from_bytes(host[20:24].tobytes(), "little")
        hsize = _frame.header_size(ns, nchunks) if 1 <= ns <= MAX_STREAMS else 0
        if first < hsize <= n:
            host[first:hsize] = frame[first:hsize].cpu().numpy()
    return host


def decode_frame(frame: torch.Tensor, params, dev_tables: DeviceTables, result: torch.Tensor) -> np.ndarray:
    """Decode a checked frame into result on its device; return the per-chunk status.

    Args:
        frame: the frame, 1-D torch.uint8 on the device, 8-byte aligned.
        params: its :class:`comm_codec.core.frame.FrameParameters` (from :func:`read_header`).
        dev_tables: the decode tables of its books (every book of each stream's group) on
            the device. Each chunk's book indices (``params.table["books"]``) must
            already have been checked against the group sizes (:meth:`KernelTables.check_books
            <comm_codec.core.tables.KernelTables.check_books>`);
            an index past the tables gives the chunk a bad-code status.
        result: contiguous output tensor of the frame's dtype and element count.

    Returns:
        int32[nchunks] status codes on the host (0 = ok; see
        :data:`comm_codec.kernels.layout.STATUS_MESSAGES`). The
        copy back is the decode's second synchronisation.
    """
    launch = Launch(frame.device)
    spec = params.spec
    nchunks = params.nchunks
    table = params.table
    ns = spec.nstreams
    cflags = launch.put(np.ascontiguousarray(table["cflags"]))
    refs = launch.put(np.ascontiguousarray(table["ref"]))
    books = launch.put(table["books"].astype(np.int32))  # u16 in the table; torch has no uint16 copies
    sizes = launch.put(np.ascontiguousarray(table["sizes"]).reshape(nchunks, ns).view(np.int32))
    checks = launch.put(np.ascontiguousarray(table["checksum"]).view(np.int32))
    offsets = launch.put(params.offsets)
    status = torch.zeros(nchunks, dtype=torch.int32, device=frame.device)
    out_bits = _bits_of(result, spec)
    launch(
        decode_kernel,
        nchunks,
        DECODE_THREADS,
        launch.array(frame),
        launch.array(frame.view(torch.int64), np.uint64),
        frame.numel(),
        params.numel,
        params.chunk_elems,
        spec.itemsize,
        1 if spec.rotate else 0,
        spec.exp_shift,
        params.split,
        launch.array(dev_tables.dec, np.uint16),
        launch.array(cflags),
        launch.array(refs),
        launch.array(books),
        launch.array(sizes, np.uint32),
        launch.array(offsets),
        launch.array(checks, np.uint32),
        params.checksums,
        launch.array(out_bits, UNSIGNED_BITS[spec.itemsize]),
        launch.array(status),
    )
    return status.cpu().numpy()


def frame_parameters(frame: torch.Tensor) -> _frame.FrameParameters:
    """Parse and check a device frame's header; only the header crosses to the host.

    Args:
        frame: a 1-D uint8 frame on a CUDA device (any device under the simulator).

    Returns:
        Its :class:`comm_codec.core.frame.FrameParameters`.

    Raises:
        FrameError: as :func:`comm_codec.core.frame.get_frame_parameters`.
    """
    return _frame.get_frame_parameters(read_header(frame))
