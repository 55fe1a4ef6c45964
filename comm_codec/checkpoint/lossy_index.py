"""The lossy container's index: what it holds, and the checks a reader runs on it.

The fields are specified in ``comm_codec/checkpoint/lossy_format.md``. A reader checks
the whole index before it uses any of it: the schema (every field's type and range),
then the layout (blobs inside the file, tensors inside the source, rewritten tensors
tiling the reconstruction, codebooks that match their ids). A failure raises
:class:`CheckpointError` naming the first bad field.
"""

from __future__ import annotations

import bisect
import math
import os

from ..core.huffman import Codebook
from ..core.quoting import printable, shown
from ..core.streams import spec_for
from . import schema
from .container import HEADER, LOSSY_MAGIC, NOT_OURS, identify, index_file, read_container_index
from .errors import fail
from .files import FileMap, open_regular
from .formats import CODABLE, is_int
from .lossy_transforms import LOSSY_DTYPES, PACKED
from .schema import Anything, Int, ListOf, MapOf, Nullable, Num, OneOf, Record, Str

__all__ = ["VERSION", "MODES", "INDEX_FORMAT", "STREAMS", "is_lossy", "load_index", "read_index"]

VERSION = 1
MODES = ("excp", "precision")
INDEX_FORMAT = "comm_codec.lossy"
# The excp streams, in the order their frames are written.
STREAMS = ("weight_mask", "weight_index", "exp_avg_mask", "exp_avg_index", "exp_avg_sq_index")

_SHA = Str(length=64)
_BLOB = {"offset": Int(), "length": Int()}
# The lossy index (lossy_format.md), as read: every field the readers use.
_INDEX = Record(
    {
        "format": OneOf(INDEX_FORMAT),
        "version": OneOf(VERSION),
        "mode": OneOf(*MODES),
        "params": MapOf(Str(32), Num()),
        "source": Record({"name": Str(), "size": Int(), "sha256": _SHA, "format": OneOf("safetensors", "torch_zip")}),
        "reconstruction": Record({"size": Int(), "sha256": _SHA}),
        "base": Nullable(Record({"name": Str(), "sha256": _SHA})),
        "notes": ListOf(Str(), 64),
        "books": MapOf(Str(length=16), Anything(dict)),
        "streams": Record(
            {name: Nullable(Record({**_BLOB, "size": Int(), "book": Str(length=16)})) for name in STREAMS}
        ),
        "skeleton": Record({**_BLOB, "size": Int(), "crc32": Int(0, 0xFFFFFFFF)}),
        "tensors": ListOf(
            Record(
                {
                    "name": Str(1 << 16),
                    "dtype": Str(64),
                    "shape": Nullable(ListOf(Int(), 64)),
                    "offset": Int(),
                    "nbytes": Int(),
                    "role": OneOf("weight", "exp_avg", "exp_avg_sq", "tensor"),
                    "coding": OneOf("residual", "value", "frame", "precision", "skeleton"),
                    "param": Nullable(Str(1 << 16)),
                    "centroids": Nullable(ListOf(Num(), 255)),
                    "domain": Nullable(OneOf("value", "sqrt")),
                    "kept": Nullable(Int()),
                    "fill": Num(lo=0.0),
                    "frame": Nullable(Record({**_BLOB, "dtype": Str(64), "books": ListOf(Str(length=16), 8)})),
                    "skeleton_offset": Nullable(Int()),
                    "crc_at": ListOf(Int(), 8),
                    "crc32": Int(0, 0xFFFFFFFF),
                    "stats": MapOf(Str(32), Nullable(Num(finite=False))),
                },
                optional=("crc32",),
            )
        ),
        "errors": MapOf(Str(64), Num(finite=False)),
    },
    optional=("created_by",),
)


def is_lossy(path) -> bool:
    """Return True when the file starts with the lossy container's magic.

    Args:
        path: any file.

    Returns:
        Whether it is a lossy comm_codec checkpoint (by its first 8 bytes).

    Raises:
        OSError: the file cannot be opened.
    """
    with open_regular(os.fspath(path)) as fh:
        return fh.read(len(LOSSY_MAGIC)) == LOSSY_MAGIC


def load_index(m: FileMap) -> dict:
    """Read and check the index of a mapped lossy file.

    Returns:
        The index dict, with the parsed codebooks added under ``"_books"`` (``{id:
        Codebook}``; :func:`read_index` leaves them out).

    Raises:
        CheckpointError: not a lossy file (an exact one is named as such), truncated, or
            corrupted.
    """
    path = m.path
    kind = identify(bytes(m.u8(0, min(8, m.size))))
    if kind != "lossy":
        if kind == "exact":
            fail(
                path,
                "is an exact (lossless) comm_codec checkpoint, not a lossy one; restore it with "
                "`comm-codec decompress` or comm_codec.checkpoint.decompress_file",
            )
        fail(path, NOT_OURS)
    return read_container_index(m, LOSSY_MAGIC, VERSION, _check_index, "lossy checkpoint")


def read_index(path) -> dict:
    """Return the checked JSON index of a lossy file (see ``lossy_format.md``).

    Args:
        path: a lossy file.

    Returns:
        The index dict: mode, parameters, source, base, errors achieved, tensors.

    Raises:
        CheckpointError: not a lossy file, truncated, or corrupted.
    """
    return index_file(path, load_index)


def _check_blob(b, end: int) -> bool:
    return is_int(b["offset"], HEADER.size, end) and is_int(b["length"], 0, end) and b["offset"] + b["length"] <= end


def _check_index(index: dict, end: int, path) -> None:
    """Check the whole index (schema, then layout); raise CheckpointError naming the first bad field."""
    if index.get("format") != INDEX_FORMAT or index.get("version") != VERSION:
        fail(path, f"index format {shown(index.get('format'), 40)} version {shown(index.get('version'), 10)}")
    schema.check(index, _INDEX, path)
    size = index["reconstruction"]["size"]
    if size != index["source"]["size"]:
        fail(path, "index: the reconstruction and the source differ in size")
    books = {}
    for book_id, entry in index["books"].items():
        book = Codebook.from_dict(entry)
        if book.id != book_id:
            fail(path, f"index: codebook listed as {book_id} is {book.id}")
        books[book_id] = book
    index["_books"] = books
    if not _check_blob(index["skeleton"], end):
        fail(path, "index: skeleton lies outside the file")
    for name, s in index["streams"].items():
        # A stream holds at most a byte per element of the tensors it serves.
        if name not in STREAMS or (
            s is not None
            and not (
                _check_blob(s, end) and is_int(s["size"], 0, size) and (s["book"] == "0" * 16 or s["book"] in books)
            )
        ):
            fail(path, f"index: stream {name!r} is malformed")
    weights = {}  # name -> elements
    for i, r in enumerate(index["tensors"]):
        problem = _tensor_problem(r, size, end, index["skeleton"]["size"], books, weights)
        if problem:
            fail(path, f"index: tensor {i} ({printable(r['name'])}) is malformed: {problem}")
        if r["role"] == "weight":
            weights[r["name"]] = r["nbytes"] // spec_for(CODABLE[r["dtype"]]).itemsize
    # Rewritten tensors tile the reconstruction without overlap; the skeleton is the rest.
    pos = cut = 0
    spans = sorted((r["offset"], r["nbytes"]) for r in index["tensors"] if r["coding"] != "skeleton")
    for off, nb in spans:
        if off < pos:
            fail(path, "index: rewritten tensors overlap")
        pos, cut = off + nb, cut + nb
    # A zip CRC field is patched into the bytes around the tensors, never into a tensor.
    starts = [off for off, _ in spans]
    for r in index["tensors"]:
        for at in r["crc_at"] if r["coding"] != "skeleton" else ():
            k = bisect.bisect_right(starts, at + 3) - 1
            if k >= 0 and at < spans[k][0] + spans[k][1]:
                fail(path, f"index: tensor {printable(r['name'])} has a CRC field inside a rewritten tensor")
    if index["skeleton"]["size"] != size - cut:
        fail(path, f"index: the skeleton holds {index['skeleton']['size']} bytes, the tensors leave {size - cut}")


def _tensor_problem(r: dict, size: int, end: int, skeleton_size: int, books: dict, weights: dict) -> str | None:
    """What is wrong with one tensor record (None if nothing), given the weights before it.

    Every dtype a decoder will look up is one it knows, every frame holds the record's
    own dtype (or, for a precision cut, the narrower dtype of its high bytes), and a
    moment has as many elements as its weight: a decoder never meets a mismatch.
    """
    if not (r["offset"] + r["nbytes"] <= size and all(is_int(a, 0, size - 4) for a in r["crc_at"])):
        return "it lies outside the reconstruction"
    coded = r["dtype"] in CODABLE
    if not coded and (r["coding"] != "skeleton" or r["role"] != "tensor"):
        return f"dtype {printable(r['dtype'], 64)} cannot be {r['coding']}-coded as a {r['role']}"
    if r["role"] != "tensor" and r["dtype"] not in LOSSY_DTYPES:
        return f"a {r['role']} of dtype {printable(r['dtype'], 64)} (lossy modes rewrite {', '.join(LOSSY_DTYPES)})"
    if coded and r["nbytes"] % spec_for(CODABLE[r["dtype"]]).itemsize:
        return f"{r['nbytes']} bytes is no whole number of {r['dtype']} elements"
    if (r["kept"] is not None) != (r["coding"] in ("residual", "value")):
        return "its kept count does not fit its coding"
    if r["coding"] in ("frame", "precision"):
        f = r["frame"]
        allowed = {r["dtype"]}
        if r["coding"] == "precision":
            if r["dtype"] not in LOSSY_DTYPES:
                return f"a precision cut of dtype {r['dtype']}"
            allowed.add(PACKED.get(r["dtype"], (r["dtype"],))[0])
        if f["dtype"] not in allowed:
            return f"its frame holds {printable(f['dtype'], 64)}, not {' or '.join(sorted(allowed))}"
        if not (_check_blob(f, end) and all(b == "0" * 16 or b in books for b in f["books"])):
            return "its frame lies outside the file or names codebooks the file does not hold"
    elif r["coding"] in ("residual", "value"):
        if not (
            isinstance(r["centroids"], list)
            and len(r["centroids"]) <= 255
            and r["domain"] in ("value", "sqrt")
            and math.isfinite(r["fill"])
            and r["fill"] >= 0
        ):
            return "its quantization is malformed"
        if r["coding"] == "value":
            if r["role"] not in ("exp_avg", "exp_avg_sq"):
                return f"a {r['role']} coded as a moment"
            if r["param"] not in weights:
                return "it names no weight before it"
            n = r["nbytes"] // spec_for(CODABLE[r["dtype"]]).itemsize
            if n != weights[r["param"]]:
                return f"{n} elements, its weight {weights[r['param']]}"
        elif r["role"] != "weight":
            return f"a residual {r['role']}"
    elif not (is_int(r["skeleton_offset"]) and r["skeleton_offset"] + r["nbytes"] <= skeleton_size):
        return "it lies outside the skeleton"
    return None
