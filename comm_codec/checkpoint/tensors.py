"""Tensors straight out of a compressed checkpoint, as ``safetensors`` hands them out.

:func:`load_file` returns every tensor of a compressed file as a dict (the whole file
restored in memory and its digest checked first, as :func:`~.exact.decompress_file`
does, but nothing written); :func:`safe_open` (also :func:`open`) opens a compressed
safetensors file lazily: ``keys()`` reads only the header, and ``get_tensor(name)``
decodes only the segments that hold that tensor. Both mirror
``safetensors.torch.load_file`` and ``safetensors.safe_open``::

    >>> from comm_codec.checkpoint import tensors
    >>> sd = tensors.load_file("model.safetensors.cckp")                # doctest: +SKIP
    >>> with tensors.safe_open("model.safetensors.cckp") as f:         # doctest: +SKIP
    ...     w = f.get_tensor("embeddings.word_embeddings.weight")

What is checked: the container's index (schema and layout) when a file is opened, every
frame's header CRC and chunk checksums and every zstd segment's CRC-32 as it is decoded,
and the safetensors header (offsets inside the file, sizes that match dtype and shape).
The whole-file digest is checked by :func:`load_file`, not by a lazy ``get_tensor``
(which never reads the whole file). Nothing is unpickled: ``load_file`` of a
``torch.save`` original goes through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..core.frame import FrameError
from ..core.parallel import run_ranges, thread_count
from ..core.quoting import printable
from .container import parse_json, zstd_bounded
from .errors import CheckpointError
from .exact_index import load_index
from .files import FileMap, new_hasher, recorded_digest
from .formats import ST_DTYPES  # safetensors' dtype names -> torch dtype attribute names

__all__ = ["load_file", "safe_open", "open", "CompressedTensors"]

# Largest safetensors header read (safetensors itself refuses more than 100 MB).
_MAX_HEADER = 100 << 20
# Decoded opaque segments kept for the next tensor (small tensors share segments).
_KEEP_SEGMENTS = 4


def load_file(path, device: str = "cpu") -> dict:
    """Return every tensor of a compressed checkpoint, as ``safetensors.torch.load_file`` would.

    The original is restored in memory (nothing is written) and its digest checked
    before any tensor is returned.

    Args:
        path: a file written by :func:`~comm_codec.checkpoint.compress_file` from a
            safetensors file, or from a ``torch.save`` file (zip or legacy).
        device: where the tensors go ("cpu", "cuda:0"...).

    Returns:
        ``{name: tensor}`` in the original's order.

    Raises:
        CheckpointError: corrupted, a delta (it needs its base: use decompress_file), or
            the original is neither safetensors nor a torch.save file.
    """
    tensors, check = load_file_check_later(path, device)
    check()
    return tensors


def load_file_check_later(path, device: str = "cpu") -> tuple[dict, Callable[[], None]]:
    """:func:`load_file`, the whole-file digest hashed on a thread while the caller goes on.

    Every segment's own check (frame checksums, CRC-32s) has passed when this returns;
    the digest of the whole restored original is computed in the background. Call
    ``check()`` before the tensors (or anything made from them) leave your hands: it
    waits for the digest and raises if it is wrong. The tensors must not be written to
    before then. :func:`comm_codec.integrations.hf.from_pretrained` builds the model
    meanwhile, so the digest costs no time on a core that would otherwise wait.

    Args:
        path, device: as :func:`load_file`.

    Returns:
        (``{name: tensor}``, ``check``). An original that is a ``torch.save`` file is
        checked before it is parsed (``check`` then does nothing).

    Raises:
        CheckpointError: as :func:`load_file` (``check()`` raises it for the digest).
    """
    path = os.fspath(path)
    m = FileMap(path)
    try:
        index = load_index(m)  # read once: the restore and the tensors share it
        fmt = index["source"]["format"]
        if fmt not in ("safetensors", "torch_zip", "torch_legacy"):
            raise CheckpointError(
                f"{path} holds a {fmt} file, not safetensors or a torch.save file; restore it with decompress_file"
            )
        if fmt == "safetensors":
            f = CompressedTensors._opened(path, m, index, device)
            m = None  # f owns it now
            with f:
                data = _restore_in_memory(f._m, index)
                tensors = f._views(data)
            return tensors, _check_in_background(path, index["source"], data)
        data = _restore_in_memory(m, index)
    finally:
        if m is not None:
            m.close()
    _check_digest(path, index["source"], data)  # before torch parses a byte of it
    import io

    import torch

    return torch.load(io.BytesIO(data), map_location=device, weights_only=True), lambda: None


def _refuse_delta(path: str, index: dict) -> None:
    if index["base"] is not None:
        raise CheckpointError(
            f"{path} is a delta against {printable(index['base']['name'])}; "
            "restore it with decompress_file(..., base=...) first"
        )


def _restore_in_memory(m: FileMap, index: dict, threads: int | None = None) -> np.ndarray:
    """Restore a standalone compressed file's original into one new array (its digest is
    not checked here: :func:`_check_digest`).

    Each segment is decoded straight into its place in the array (no buffer in between),
    several segments at once on worker threads.

    Args:
        m: the compressed file.
        index: its index, from :func:`~.exact_index.load_index` (books under ``"_books"``).
        threads: worker threads; None: one per core (at most numba's thread count), one for
            a file under :data:`~.exact.SMALL_FILE_BYTES`.

    Returns:
        The original's bytes (``index["source"]["size"]`` of them).

    Raises:
        CheckpointError: a delta, or a segment corrupted.
    """
    from .exact import attach_codecs

    _refuse_delta(m.path, index)
    size = index["source"]["size"]
    threads = _restore_threads(size) if threads is None else threads
    tensors = index["tensors"]
    if any("_codec" not in t for t in tensors if t["coding"] == "frame"):
        attach_codecs(tensors, index["_books"])
    data = np.empty(size, dtype=np.uint8)
    segments = index["segments"]
    # One contiguous run of segments per thread, of about equal source bytes: one hand-over
    # each way per thread (on a busy machine every hand-over waits for a core).
    ends = list(itertools.accumulate(seg[1] for seg in segments))
    bounds = [0] + [bisect.bisect_left(ends, size * k // threads) for k in range(1, threads)] + [len(segments)]

    def restore(lo: int, hi: int) -> None:
        for k in range(bounds[lo], bounds[hi]):
            seg = segments[k]
            _restore_segment(m, seg, tensors, data[seg[0] : seg[0] + seg[1]])

    run_ranges(restore, threads, threads, lambda lo, hi: (lo, hi))
    return data


def _restore_threads(size: int) -> int:
    from .exact import SMALL_FILE_BYTES

    if size < SMALL_FILE_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, thread_count(None)))


def _restore_segment(m: FileMap, seg, tensors: list, out: np.ndarray) -> None:
    """Restore one segment of a standalone file into ``out`` (its source bytes' place)."""
    src_off, src_len, off, length, method, crc, ti = seg
    where = f"{m.path}: segment at source bytes {src_off}..{src_off + src_len}"
    if method == "frame":
        t = tensors[ti]
        if t["transform"] != "none":  # a delta's transform: refused before (no base)
            raise CheckpointError(f"{where} needs the base it was compressed against")
        try:
            t["_codec"].decode_into(m.u8(off, length), out, max_output_bytes=src_len)
        except (FrameError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{m.path}: tensor {printable(t['name'])!r}, segment at source bytes "
                f"{src_off}..{src_off + src_len}: {exc}"
            ) from None
        return
    if method == "stored":
        if length != src_len:  # the index was checked: cannot happen
            raise CheckpointError(f"{where} holds {length} bytes, expected {src_len}")
        m.read_into(off, out)
        if zlib.crc32(out) != crc:
            raise CheckpointError(f"{where} is corrupted (CRC-32 mismatch)")
        return
    payload = bytes(m.u8(off, length))
    if zlib.crc32(payload) != crc:
        raise CheckpointError(f"{where} is corrupted (CRC-32 mismatch)")
    raw = zstd_bounded(payload, src_len, m.path, where)
    if len(raw) != src_len:
        raise CheckpointError(f"{where} decoded to {len(raw)} bytes, expected {src_len}")
    out[:] = np.frombuffer(raw, dtype=np.uint8)


def _check_digest(path: str, source: dict, data: np.ndarray) -> None:
    """Raise CheckpointError unless ``data`` has the digest the index records for the original."""
    algo, want = recorded_digest(source)
    h = new_hasher(algo)
    if algo == "blake3" and data.size >= 1 << 20:
        import blake3  # one buffer, hashed on every core

        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(data)
    if h.hexdigest() != want:
        raise CheckpointError(
            f"{path}: restored bytes have {algo} {h.hexdigest()[:16]}..., the original had {want[:16]}...: corrupted"
        )


def _check_in_background(path: str, source: dict, data: np.ndarray) -> Callable[[], None]:
    """Start :func:`_check_digest` on a thread (hashing releases the GIL); return the wait
    for it, which raises what it raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="comm_codec-digest")
    done = pool.submit(_check_digest, path, source, data)
    pool.shutdown(wait=False)
    return done.result


def _tensor(raw: np.ndarray, dtype: str, shape: list, device: str):
    import torch

    t = torch.frombuffer(raw, dtype=getattr(torch, dtype)) if raw.size else torch.empty(0, dtype=getattr(torch, dtype))
    t = t.reshape(shape)
    return t if device == "cpu" else t.to(device)


def _header(read, size: int, path: str) -> tuple[list, int]:
    """Parse a safetensors header from ``read(a, b)`` (bytes a..b of the original).

    Returns:
        ([(name, (torch dtype name, shape, begin, end)), ...] in file order, data start).
    """
    if size < 8:
        raise CheckpointError(f"{path}: the original is not a safetensors file (shorter than its header)")
    hlen = int.from_bytes(bytes(read(0, 8)), "little")
    if hlen > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{path}: safetensors header of {hlen} bytes does not fit the original ({size} bytes)")
    try:
        meta = parse_json(bytes(read(8, 8 + hlen)), path)
    except ValueError as exc:
        raise CheckpointError(f"{path}: safetensors header is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    start, out = 8 + hlen, []
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = info["shape"]
            begin, end = info["data_offsets"]
            ok = (
                all(type(d) is int and 0 <= d < 1 << 62 for d in shape)
                and len(shape) <= 64
                and type(begin) is int
                and type(end) is int
                and 0 <= begin <= end <= size - start
                and math.prod(shape) * _ITEMSIZE[dtype] == end - begin
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: tensor {printable(str(name))!r}: malformed safetensors entry")
        out.append((str(name), (dtype, list(shape), begin, end)))
    out.sort(key=lambda kv: kv[1][2])
    return out, start


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}


class CompressedTensors:
    """A compressed safetensors file opened lazily (what :func:`safe_open` returns).

    Decodes one tensor at a time, from the segments that hold it; memory is that
    tensor and a few decoded segments. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path, framework: str = "pt", device: str = "cpu"):
        if framework not in ("pt", "torch"):
            raise ValueError(f"framework must be 'pt', got {framework!r}")
        path = os.fspath(path)
        m = FileMap(path)
        try:
            index = load_index(m)
        except BaseException:
            m.close()
            raise
        self._setup(path, m, index, device)

    @classmethod
    def _opened(cls, path: str, m: FileMap, index: dict, device: str) -> CompressedTensors:
        """The file ``m`` whose index was read (by :func:`load_file`): not read again."""
        self = cls.__new__(cls)
        self._setup(path, m, index, device)
        return self

    def _setup(self, path: str, m: FileMap, index: dict, device: str) -> None:
        from .exact import attach_codecs

        self.path, self.device, self._m = path, device, m
        try:
            _refuse_delta(self.path, index)
            if index["source"]["format"] != "safetensors":
                raise CheckpointError(
                    f"{self.path} holds a {index['source']['format']} file, not safetensors; "
                    "load_file reads torch.save files whole"
                )
            self._index = index
            self._tensors = index["tensors"]
            attach_codecs(self._tensors, index["_books"])
            self._segments = index["segments"]
            self._starts = [s[0] for s in self._segments]
            self._size = index["source"]["size"]
            self._kept: dict = {}
            entries, self._start = _header(self._read, self._size, self.path)
            self._entries = dict(entries)
            self._metadata = None
        except BaseException:
            self._m.close()
            raise

    def keys(self) -> list:
        """Return the tensor names, in the original file's order."""
        return list(self._entries)

    def get_tensor(self, name: str):
        """Decode and return one tensor, bit for bit as in the original file.

        Raises:
            KeyError: no such tensor.
            CheckpointError: a segment holding it is corrupted.
        """
        dtype, shape, begin, end = self._entries[name]
        return _tensor(self._read(self._start + begin, self._start + end), dtype, shape, self.device)

    def _read(self, a: int, b: int) -> np.ndarray:
        """Restore bytes a..b of the original from the segments that cover them."""
        out = np.empty(b - a, dtype=np.uint8)
        k = max(0, bisect.bisect_right(self._starts, a) - 1)
        while a < b and k < len(self._segments):
            src_off, src_len, _, _, method, _, _ = self._segments[k]
            lo, hi = max(a, src_off), min(b, src_off + src_len)
            if hi > lo:
                dst = out[lo - a : hi - a]
                if method == "frame" and lo == src_off and hi == src_off + src_len:
                    self._decode_frame(k, dst)  # straight into the tensor's bytes
                else:
                    dst[:] = self._segment(k)[lo - src_off : hi - src_off]
            k += 1
            if src_off + src_len >= b:
                break
        return out

    def _segment(self, k: int) -> np.ndarray:
        got = self._kept.get(k)
        if got is None:
            src_off, src_len, off, length, method, crc, _ = self._segments[k]
            if method == "frame":
                got = self._decode_frame(k, np.empty(src_len, dtype=np.uint8))
            else:
                payload = bytes(self._m.u8(off, length))
                where = f"{self.path}: segment at source bytes {src_off}..{src_off + src_len}"
                if zlib.crc32(payload) != crc:
                    raise CheckpointError(f"{where} is corrupted (CRC-32 mismatch)")
                raw = payload if method == "stored" else zstd_bounded(payload, src_len, self.path, where)
                if len(raw) != src_len:
                    raise CheckpointError(f"{where} decoded to {len(raw)} bytes, expected {src_len}")
                got = np.frombuffer(raw, dtype=np.uint8)
            if len(self._kept) >= _KEEP_SEGMENTS:
                del self._kept[next(iter(self._kept))]
            self._kept[k] = got
        return got

    def _decode_frame(self, k: int, out: np.ndarray) -> np.ndarray:
        src_off, src_len, off, length, _, _, ti = self._segments[k]
        t = self._tensors[ti]
        try:
            return t["_codec"].decode_into(self._m.u8(off, length), out, max_output_bytes=src_len)
        except (FrameError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{self.path}: tensor {printable(t['name'])!r}, segment at source bytes "
                f"{src_off}..{src_off + src_len}: {exc}"
            ) from None

    def load_all(self) -> dict:
        """Decode the whole original into one buffer, check its digest, and return every
        tensor (views of that buffer), as :func:`load_file` does.

        Raises:
            CheckpointError: corrupted (a segment, a frame, or the digest of the whole).
        """
        data = _restore_in_memory(self._m, self._index)
        _check_digest(self.path, self._index["source"], data)
        return self._views(data)

    def _views(self, data: np.ndarray) -> dict:
        """Every tensor of the restored original ``data``, as views of it."""
        return {
            name: _tensor(data[self._start + a : self._start + b], dtype, shape, self.device)
            for name, (dtype, shape, a, b) in self._entries.items()
        }

    def metadata(self) -> dict | None:
        """Return the header's ``__metadata__`` (str -> str), or None."""
        hlen = int.from_bytes(bytes(self._read(0, 8)), "little")
        meta = parse_json(bytes(self._read(8, 8 + hlen)), self.path).get("__metadata__")
        return meta if isinstance(meta, dict) else None

    def close(self) -> None:
        self._kept.clear()
        self._m.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def safe_open(path, framework: str = "pt", device: str = "cpu") -> CompressedTensors:
    """Open a compressed safetensors file lazily, as ``safetensors.safe_open`` opens a file.

    Args:
        path: a file written by :func:`~comm_codec.checkpoint.compress_file` from a
            safetensors file (not a delta).
        framework: "pt" (torch tensors).
        device: where ``get_tensor`` puts tensors.

    Returns:
        A :class:`CompressedTensors` (``keys()``, ``get_tensor(name)``, ``metadata()``).

    Raises:
        CheckpointError: not a compressed safetensors file, a delta, or corrupted.
    """
    return CompressedTensors(path, framework, device)


open = safe_open  # the safetensors-style name: comm_codec.checkpoint.tensors.open
