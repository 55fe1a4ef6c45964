"""OpenZL (Meta's format-aware compressor, PyPI ``openzl``) as a comparator: its float graph.

The graph, for a buffer of one float type (the strongest of the float graphs its Python
API builds, measured on bf16 weights and gradients: exponent by FSE rather than by
Huffman or its automatic order-0 ``Entropy`` choice, 1.515x against 1.508x on N(0, 0.02)
bf16)::

    ConvertSerialToNumLE16/32 -> BFloat16Deconstruct | Float16Deconstruct | Float32Deconstruct
        exponent bytes     -> Fse        (order-0 FSE: tANS, fractional bits per symbol)
        sign + fraction    -> Entropy    (order-0: Huffman, FSE or stored, as it measures;
                              fp32's 3-byte one: the generic Compress graph)

A buffer of another type goes to OpenZL's generic ``Compress`` graph. A whole checkpoint
file is coded as its dtype's elements, like zipnn does: the numeric conversion needs a
whole number of elements, so the last ``len % width`` bytes are kept beside OpenZL's
frame (one byte says how many). OpenZL compresses on the calling thread only.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["OpenZL", "GRAPH"]

# What the bench's notes and the docs say the graph is.
GRAPH = "LE numeric -> {BFloat16,Float16,Float32}Deconstruct -> exponent: Fse, sign+fraction: Entropy (fp32: Compress)"

_WIDTH = {"bf16": 2, "fp16": 2, "fp32": 4}


class OpenZL:
    """Compress and decompress bytes with OpenZL's float graph for one dtype (or its generic graph).

    Args:
        dtype: "bf16", "fp16", "fp32", or anything else for the generic graph.

    Raises:
        ImportError: openzl is not installed.
    """

    def __init__(self, dtype: str | None):
        import openzl.ext as zl

        self.zl = zl
        self.version = importlib.metadata.version("openzl")
        self.dtype = dtype if dtype in _WIDTH else None
        self.width = _WIDTH.get(self.dtype, 1)
        self._float = self._compressor(self.dtype) if self.dtype else None
        self._generic = self._compressor(None)
        self._dctx = zl.DCtx()

    def _compressor(self, dtype):
        zl = self.zl
        c = zl.Compressor()
        c.set_parameter(zl.CParam.FormatVersion, zl.MAX_FORMAT_VERSION)
        if dtype is None:
            start = zl.graphs.Compress()(c)
        else:
            convert = zl.nodes.ConvertSerialToNumLE32 if dtype == "fp32" else zl.nodes.ConvertSerialToNumLE16
            split = {
                "bf16": zl.nodes.BFloat16Deconstruct,
                "fp16": zl.nodes.Float16Deconstruct,
                "fp32": zl.nodes.Float32Deconstruct,
            }[dtype]
            # Entropy takes 1- and 2-byte elements; fp32's 3-byte sign+fraction goes to the generic graph.
            rest = zl.graphs.Compress()(c) if dtype == "fp32" else zl.graphs.Entropy()(c)
            start = convert()(c, split()(c, rest, zl.graphs.Fse()(c)))
        c.select_starting_graph(start)
        cctx = zl.CCtx()
        # Sticky: a context forgets its compressor and parameters after each frame otherwise.
        cctx.set_parameter(zl.CParam.StickyParameters, 1)
        cctx.ref_compressor(c)
        cctx.set_parameter(zl.CParam.FormatVersion, zl.MAX_FORMAT_VERSION)
        return c, cctx

    def compress(self, data) -> bytes:
        """Return ``data`` (bytes-like) compressed: a tail-length byte, the tail, OpenZL's frame."""
        data = bytes(data)
        tail = len(data) % self.width
        # Kept in a name until compress returns: openzl's Input refers to the bytes, it
        # does not hold them (a temporary freed early was read after its release).
        body = data[: len(data) - tail] if tail else data
        _, cctx = self._float if self._float is not None and len(body) else self._generic
        frame = cctx.compress([self.zl.Input(self.zl.Type.Serial, body)])
        return bytes([tail]) + data[len(data) - tail :] + frame

    def decompress(self, blob) -> bytes:
        """Return the bytes that :meth:`compress` made ``blob`` of."""
        blob = bytes(blob)
        tail = blob[0]
        out = self._dctx.decompress(blob[1 + tail :])
        return out[0].content.as_bytes() + blob[1 : 1 + tail]
