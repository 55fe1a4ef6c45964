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
import math
import os
import zlib

import numpy as np

from ..core.frame import FrameError
from ..core.quoting import printable
from .container import parse_json, zstd_bounded
from .errors import CheckpointError
from .exact_index import load_index
from .files import FileMap
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
    from .exact import decompress_file
    from .exact_index import read_index

    path = os.fspath(path)
    source = read_index(path)["source"]
    fmt = source["format"]
    if fmt == "safetensors":
        # Every segment decoded in order straight into one buffer (no pipeline, no copy),
        # then the buffer's digest checked: the tensors are views of it.
        with CompressedTensors(path, device=device) as f:
            return f.load_all()
    sink = _Memory(source["size"])
    decompress_file(path, sink, progress=False)  # streamed in order; the digest checked after the last byte
    data = sink.array()
    if fmt in ("torch_zip", "torch_legacy"):
        import io

        import torch

        return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    raise CheckpointError(
        f"{path} holds a {fmt} file, not safetensors or a torch.save file; restore it with decompress_file"
    )


class _Memory:
    """A binary "file" for :func:`~.exact.decompress_file`: the restored bytes, in order, in one array."""

    def __init__(self, size: int):
        self._buf, self._pos = np.empty(size, dtype=np.uint8), 0

    def write(self, data) -> None:
        view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if self._pos + view.size > self._buf.size:  # the index was checked: cannot happen
            raise CheckpointError("restored more bytes than the original had")
        self._buf[self._pos : self._pos + view.size] = view  # a copy: the restorer reuses its buffers
        self._pos += view.size

    def array(self) -> np.ndarray:
        return self._buf[: self._pos]


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
        from .exact import attach_codecs

        self.path, self.device = os.fspath(path), device
        self._m = FileMap(self.path)
        try:
            index = load_index(self._m)
            books = index.pop("_books")
            if index["base"] is not None:
                raise CheckpointError(
                    f"{self.path} is a delta against {printable(index['base']['name'])}; "
                    "restore it with decompress_file(..., base=...) first"
                )
            if index["source"]["format"] != "safetensors":
                raise CheckpointError(
                    f"{self.path} holds a {index['source']['format']} file, not safetensors; "
                    "load_file reads torch.save files whole"
                )
            self._tensors = index["tensors"]
            attach_codecs(self._tensors, books)
            self._segments = index["segments"]
            self._starts = [s[0] for s in self._segments]
            self._size = index["source"]["size"]
            self._source = index["source"]
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
        from .files import new_hasher, recorded_digest

        data = self._read(0, self._size)
        algo, want = recorded_digest(self._source)
        h = new_hasher(algo)
        if algo == "blake3" and data.size >= 1 << 20:
            import blake3  # one buffer, hashed on every core

            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update(data)
        if h.hexdigest() != want:
            raise CheckpointError(
                f"{self.path}: restored bytes have {algo} {h.hexdigest()[:16]}..., the original "
                f"had {want[:16]}...: corrupted"
            )
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
