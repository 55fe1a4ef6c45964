"""A book's canonical codes as the kernels' lookup tables, in one compiled pass.

A checkpoint restore builds the tables of every book tuple its tensors name, from books
parsed out of the file (tens of tuples on an optimizer-state file), so building them is
on its path: one compiled pass takes a few microseconds a book.

The tables are :meth:`comm_codec.core.huffman.Codebook.tables`'s: ``enc_code`` holds each
symbol's code bit-reversed for LSB-first packing (an escaped symbol's being the escape
code followed by its 8 bits), ``enc_len`` the bits written, and ``dec`` maps the next
``DEC_BITS`` input bits to ``symbol | length << 8`` (``escape_flag`` instead of the symbol
for the escape), 0 where no code starts.
"""

from __future__ import annotations

import numpy as np

from .jit import entry, inline
from .layout import DEC_BITS

__all__ = ["canonical_tables"]


@entry
def canonical_tables(lengths, escape_length, escape_flag, enc_code, enc_len, dec):
    """Fill enc_code (uint32[256]), enc_len (uint8[256]) and dec (uint16[DEC_ENTRIES]) for a coded book.

    Codes are assigned in canonical order, by (length, symbol) with the escape as symbol
    256; each is the Kraft sum of the codes before it, scaled to its length.

    Args:
        lengths: uint8[256], each symbol's code length, 0 for an escaped symbol; every
            length is at most ``DEC_BITS`` and the lengths satisfy Kraft's
            inequality (:class:`~comm_codec.core.huffman.Codebook` checks both).
        escape_length: the escape code's length, 0 for a book without one.
        escape_flag: what ``dec`` holds in place of the symbol for the escape.
        enc_code, enc_len, dec: zeroed outputs.

    Returns:
        Nothing; the outputs are filled. A slot of ``dec`` no code starts at stays 0.
    """
    rev = np.zeros(257, np.int64)  # each symbol's code (the escape's at 256), bit-reversed
    before = 0  # Kraft sum of the codes assigned so far, in units of 2**-DEC_BITS
    for length in range(1, DEC_BITS + 1):
        for sym in range(257):
            if _length(lengths, escape_length, sym) != length:
                continue
            code = before >> (DEC_BITS - length)
            before += 1 << (DEC_BITS - length)
            r = 0
            for i in range(length):
                r = (r << 1) | ((code >> i) & 1)
            rev[sym] = r
    for sym in range(257):
        length = _length(lengths, escape_length, sym)
        if length == 0:
            continue
        slot = (escape_flag if sym == 256 else sym) | (length << 8)
        for k in range(1 << (DEC_BITS - length)):  # every slot whose low bits are the code
            dec[rev[sym] | (k << length)] = slot
        if sym < 256:
            enc_code[sym] = rev[sym]
            enc_len[sym] = length
    if escape_length:
        for sym in range(256):
            if lengths[sym] == 0:
                enc_code[sym] = rev[256] | (sym << escape_length)
                enc_len[sym] = escape_length + 8


@inline
def _length(lengths, escape_length, sym):
    """Code length of symbol sym (256: the escape), as int64."""
    return np.int64(escape_length) if sym == 256 else np.int64(lengths[sym])
