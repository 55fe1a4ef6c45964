"""Check and describe ``comm_codec.dcp`` directories and their data files, without loading them into a model.

What ``comm-codec verify / ls / inspect`` call for a DCP directory (one holding a
``.metadata``) or one of its ``.distcp`` data files. :func:`verify_dcp` reads the
metadata through the reader's checks, then every data file it names: the book table
(CRC-32, every book rebuilt), every frame and pack frame decoded in full (each chunk's
checksum checked) against what the metadata says it holds, and every item stored as DCP
stores it against the CRC-32 its file recorded (files of torch's own writer record none:
their items are only checked to be ``torch.save`` records that torch can read in
bounded time). The checks themselves are :meth:`comm_codec.checkpoint.dcp.Reader.verify`.
"""

from __future__ import annotations

import math
import os

import torch

from ..core.quoting import printable
from ._dcp_file import DATA_SUFFIX, DataFile
from ._dcp_items import ZSTD_DESCRIPTOR
from ._dcp_metadata import METADATA_NAME, read_metadata
from .dcp import FRAME_DESCRIPTOR, PACK_DESCRIPTOR, Reader
from .errors import CheckpointError

__all__ = ["describe_dcp", "describe_dcp_file", "is_dcp_dir", "is_dcp_file", "verify_dcp"]


def is_dcp_dir(path) -> bool:
    """Whether path is a directory holding a DCP ``.metadata`` file."""
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_NAME))


def is_dcp_file(path) -> bool:
    """Whether path is a ``.distcp`` data file of a DCP directory (or ends with comm_codec.dcp's book table)."""
    path = os.fspath(path)
    if not path.endswith(DATA_SUFFIX) or not os.path.isfile(path):
        return False
    if os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(path)), METADATA_NAME)):
        return True
    try:
        data = DataFile(path)
    except OSError:
        return False
    try:
        return data.has_trailer()
    finally:
        data.close()


def _is_tensor(entry) -> bool:
    """Whether a checked metadata entry is a tensor's (TensorStorageMetadata; the other kind is a value's)."""
    return hasattr(entry, "chunks")


def _kind(info) -> str:
    descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
    if descriptors == (FRAME_DESCRIPTOR,):
        return "frame"
    if len(descriptors) == 2 and descriptors[0] == PACK_DESCRIPTOR:
        return "pack"
    if descriptors == (ZSTD_DESCRIPTOR,):
        return "zstd"
    if not descriptors:
        return "plain"
    return "foreign"


def _per_file(md) -> dict:
    """relative path -> [(MetadataIndex, _StorageInfo, entry)], by offset."""
    files: dict = {}
    for index, info in md.storage_data.items():
        files.setdefault(info.relative_path, []).append((index, info, md.state_dict_metadata[index.fqn]))
    for items in files.values():
        items.sort(key=lambda x: x[1].offset)
    return files


def _chunk(entry, index):
    """(dtype, elements) of the chunk a tensor record holds."""
    offsets = tuple(index.offset or ())
    for chunk in entry.chunks:
        if tuple(chunk.offsets) == offsets:
            return entry.properties.dtype, math.prod(chunk.sizes)
    return entry.properties.dtype, 0


def verify_dcp(path, codebooks=None) -> str:
    """Check every data file of a DCP directory (:meth:`Reader.verify`); return a one-line summary.

    Args:
        path: the directory (with ``.metadata``).
        codebooks: the shipped books, for data files written before files held every
            book they use (None: the default set).

    Returns:
        ``verified DIR: N data files, F frames, P pack frames, C items by CRC-32, U items ...``.

    Raises:
        CheckpointError: the metadata, a book table, a frame or an item is corrupted,
            truncated or foreign (the message names the file).
    """
    path = os.fspath(path)
    counts = Reader(path, codebooks=codebooks).verify()
    if counts["frames"] + counts["packs"] + counts["crc"] == 0:
        # A plain torch DCP directory: nothing in it carries a check, and a verify that checked
        # nothing must not look like one that passed.
        raise CheckpointError(
            f"{printable(path)} holds no compressed file (.cckp) and no comm_codec.dcp data file, so there is "
            f"nothing to verify ({counts['unchecked']} plain DCP items); compress it with 'comm-codec compress DIR OUT'"
        )
    return (
        f"verified {printable(path)}: {counts['files']} data files, {counts['frames']} frames, {counts['packs']} "
        f"pack frames, {counts['crc']} items by CRC-32, {counts['unchecked']} items with no checksum "
        "(checked to be torch.save records torch reads in bounded time)"
    )


def describe_dcp(path) -> str:
    """Return a table of a DCP directory: per data file and item, how it is stored and its size.

    Nothing is decoded: sizes come from the metadata (tensor sizes) and the records.

    Raises:
        CheckpointError: the metadata is foreign or tampered.
    """
    path = os.fspath(path)
    md = read_metadata(path)
    lines = [f"DCP directory {printable(path)}: {len(md.state_dict_metadata)} entries"]
    total_raw = total_stored = 0
    for name, items in sorted(_per_file(md).items()):
        lines.append(f"  {printable(name)}")
        counted = set()
        for index, info, entry in items:
            kind = _kind(info)
            if _is_tensor(entry):
                dtype, numel = _chunk(entry, index)
                raw = numel * torch.empty(0, dtype=dtype).element_size()
                what = f"{str(dtype).replace('torch.', '')} {numel} elements"
            else:
                raw, what = info.length, "value"
            stored = 0 if (kind == "pack" and (info.offset, info.length) in counted) else info.length
            counted.add((info.offset, info.length))
            total_raw, total_stored = total_raw + raw, total_stored + stored
            lines.append(
                f"    {printable(index.fqn, 60):<60} {kind:<6} {what:<28} {raw:>12} -> {info.length:>12}"
                + (" (shared pack frame)" if kind == "pack" else "")
            )
    lines.append(f"  total {total_raw} -> {total_stored} bytes of items, ratio {total_raw / max(1, total_stored):.3f}")
    return "\n".join(lines)


def describe_dcp_file(path) -> str:
    """Describe one ``.distcp`` data file: its book table, and its items when its directory's metadata is there.

    Raises:
        CheckpointError: the book table is corrupted, or the metadata foreign.
    """
    path = os.fspath(path)
    data = DataFile(path)
    try:
        lines = [f"file        {printable(path)}", f"size        {data.size} bytes"]
        if data.has_trailer():
            table = data.table()
            lines.append(
                f"format      comm_codec.dcp data file, book table version {table['version']} "
                f"({len(table['books'])} books, {len(table['groups'])} groups, "
                f"{len(table.get('checksums', {}))} item checksums; written with shipped books "
                f"{printable(str(table.get('shipped')), 40)})"
            )
        else:
            lines.append("format      DCP data file of torch's FileSystemWriter (no comm_codec book table)")
    finally:
        data.close()
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(folder, METADATA_NAME)):
        md = read_metadata(folder)
        name = os.path.basename(path)
        kinds: dict = {}
        for info in md.storage_data.values():
            if info.relative_path == name:
                kinds[_kind(info)] = kinds.get(_kind(info), 0) + 1
        lines.append("items       " + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"))
    return "\n".join(lines)
