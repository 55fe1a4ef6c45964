"""Items of a DCP data file stored as DCP stores them: ``torch.save`` records, checked before torch reads them.

``torch.load`` inflates a deflated member whole and its weights-only unpickler is pure
Python, so 58 kB of deflate that inflate to a long pickle keep it busy for half a minute
and 1 MiB inflates to 1 GiB. ``torch.save`` itself stores every member; a record is read
here only when every member of its zip is stored (not deflated), lies inside the record,
and its ``data.pkl`` is at most the bound given (a tensor's is a few hundred bytes).

Records written with DCP's ZStandard extension are decompressed first, into at most the
bytes the item may hold (a zstd frame claims its size, and that claim is not trusted).
"""

from __future__ import annotations

import io
import zipfile

import torch

from ..core.errors import CheckpointError
from ..core.quoting import printable

__all__ = [
    "MAX_TENSOR_PICKLE",
    "MAX_VALUE_PICKLE",
    "ZSTD_DESCRIPTOR",
    "check_torch_zip",
    "load_checked",
    "resave",
    "zstd_decode",
]

# The transform descriptor DCP's ZStandard extension records (torch 2.13).
ZSTD_DESCRIPTOR = "stream.zstd/1"
# data.pkl of a non-tensor value: the weights-only unpickler reads ~1-2 M opcodes a second.
MAX_VALUE_PICKLE = 4 << 20
# data.pkl of a tensor stored as DCP stores it (a few hundred bytes).
MAX_TENSOR_PICKLE = 64 << 10
# Largest window a zstd frame may ask the decoder for (zstd's own default limit).
_ZSTD_MAX_WINDOW = 1 << 27


def check_torch_zip(raw: bytes, max_pickle: int, what: str) -> None:
    """Check that raw is a ``torch.save`` zip whose members torch can read in bounded time and memory.

    Args:
        raw: the record's bytes.
        max_pickle: the most bytes its ``data.pkl`` may have.
        what: names the record in errors.

    Raises:
        CheckpointError: not a zip, a member deflated (or otherwise compressed), a member
            outside the record, or a ``data.pkl`` missing or over ``max_pickle``.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            infos = zf.infolist()
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        ValueError,
        OSError,
        EOFError,
        NotImplementedError,
        OverflowError,
    ) as exc:
        raise CheckpointError(f"{what}: not a torch.save record ({printable(str(exc), 80)})") from None
    pickles = 0
    for info in infos:
        name = printable(info.filename, 60)
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CheckpointError(
                f"{what}: member {name} is compressed; torch.save stores every member, and a "
                "compressed one could inflate without bound"
            )
        # the member's data follows its local header (30 bytes, name, extra field)
        if info.header_offset + 30 + len(info.filename.encode("utf-8", "replace")) + info.file_size > len(raw):
            raise CheckpointError(f"{what}: member {name} claims {info.file_size} bytes past the record's end")
        if info.filename.endswith("data.pkl"):
            pickles += 1
            if info.file_size > max_pickle:
                raise CheckpointError(
                    f"{what}: its pickle has {info.file_size} bytes, more than the {max_pickle} this reader unpickles"
                )
    if pickles != 1:
        raise CheckpointError(f"{what}: not a torch.save record ({pickles} data.pkl members)")


def load_checked(raw: bytes, max_pickle: int, what: str):
    """``torch.load(weights_only=True)`` of a record after :func:`check_torch_zip`; CheckpointError if it fails."""
    check_torch_zip(raw, max_pickle, what)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types on foreign bytes
        raise CheckpointError(
            f"{what}: weights-only loading refuses it ({type(exc).__name__}: {printable(str(exc), 120)})"
        ) from None


def resave(value) -> io.BytesIO:
    """torch.save of a value that weights-only loading produced: bytes this process made, for DCP's planner.

    DCP's default planner loads a non-tensor value with ``torch.load(weights_only=False)``;
    giving it these instead of the file's bytes means it never unpickles what the file holds.
    """
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def zstd_decode(raw: bytes, limit: int, what: str) -> bytes:
    """Decompress a record written with DCP's ZStandard extension into at most limit bytes.

    Raises:
        CheckpointError: no zstd module, not zstd, a window over 128 MiB, or more than limit bytes.
    """
    try:
        import zstandard
    except ImportError:
        raise CheckpointError(f"{what}: written with DCP's ZStandard extension; install zstandard to read it") from None
    try:
        reader = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW).stream_reader(
            io.BytesIO(raw), read_across_frames=True
        )
        out = io.BytesIO()
        while out.tell() <= limit:
            block = reader.read(min(1 << 20, limit + 1 - out.tell()) or 1)
            if not block:
                break
            out.write(block)
    except zstandard.ZstdError as exc:
        raise CheckpointError(f"{what}: not a zstd stream ({printable(str(exc), 80)})") from None
    if out.tell() > limit:
        raise CheckpointError(f"{what}: decompresses to more than the {limit} bytes the item may hold")
    return out.getvalue()
