"""Plain-Python reference implementations the tests hold the codec core against.

Written from the documented format (module docstrings of ``comm_codec.core.streams``,
``comm_codec.core.huffman``, ``comm_codec.core.frame`` and ``comm_codec.kernels``), not from
the code: slow, obvious, on Python ints and lists of bits. Nothing here imports the
package except :func:`frame_books`, which only reads code lengths out of a book.

(a) Byte streams: rotate the sign bit to the LSB, then bytes big end first.
(b) Canonical Huffman: codes assigned by (length, symbol) with the escape as symbol 256,
    each code written MSB first; bits packed LSB first into bytes; an escaped symbol is
    the escape code followed by the symbol's 8 bits, least significant first (the order
    in which the kernels' LSB-first packer emits ``symbol << escape_length``).
(c) Entropy and unlimited optimal Huffman lengths.
(d) A whole-frame decoder: header, book ids, chunk table, CRC, masks, raw and coded
    (4-lane) streams, reference exponents, checksums, and split exponents (version 3:
    the exponent's code derived from the stream's book, the bits under it in a plane).
"""

from __future__ import annotations

import math
import struct
import zlib

import torch

# -- (a) byte streams -------------------------------------------------------------------
# dtype: (bytes per element, sign rotated to the LSB?, exponent position in stream 0 or None,
#         frame dtype code). From the table in comm_codec/streams.py's docstring.
# SPLIT_BITS: the low bits of stream 0 that a frame with split exponents stores raw (frame_format.md).
LAYOUT = {
    torch.bfloat16: (2, True, 0, 1),  # [e8] [m7 s]
    torch.float16: (2, True, 3, 2),  # [e5 m_hi3] [m_lo7 s]
    torch.float32: (4, True, 0, 3),  # [e8] [m_hi8] [m_mid8] [m_lo7 s]
    torch.float8_e4m3fn: (1, True, 4, 4),  # [e4 m3 s]
    torch.float8_e5m2: (1, True, 3, 5),  # [e5 m2 s]
    torch.int8: (1, False, None, 6),  # [b]
    torch.uint8: (1, False, None, 7),  # [b]
}
DTYPE_BY_CODE = {v[3]: k for k, v in LAYOUT.items()}
SPLIT_BITS = {torch.float16: 3, torch.float8_e4m3fn: 3, torch.float8_e5m2: 3}
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def element_bits(tensor: torch.Tensor) -> list[int]:
    """Return each element's bit pattern as an unsigned Python int, in flat order."""
    width = LAYOUT[tensor.dtype][0]
    ints = tensor.reshape(-1).contiguous().view(_INT_OF_WIDTH[width]).tolist()
    return [x & ((1 << (8 * width)) - 1) for x in ints]


def tensor_from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Return a 1-D tensor of dtype whose elements have the given unsigned bit patterns."""
    width = LAYOUT[dtype][0]
    top = 1 << (8 * width)
    if width == 1:
        signed = list(bits)
    else:
        signed = [b - top if b >= top // 2 else b for b in bits]
    return torch.tensor(signed, dtype=_INT_OF_WIDTH[width]).view(dtype)


def rotl1(x: int, width_bits: int) -> int:
    return ((x << 1) | (x >> (width_bits - 1))) & ((1 << width_bits) - 1)


def rotr1(x: int, width_bits: int) -> int:
    return ((x >> 1) | ((x & 1) << (width_bits - 1))) & ((1 << width_bits) - 1)


def split(tensor: torch.Tensor) -> list[list[int]]:
    """Split a tensor into its byte streams: stream s = byte s of the rotated bits, big end first."""
    width, rotate, _, _ = LAYOUT[tensor.dtype]
    out = [[] for _ in range(width)]
    for x in element_bits(tensor):
        r = rotl1(x, 8 * width) if rotate else x
        for s in range(width):
            out[s].append((r >> (8 * (width - 1 - s))) & 0xFF)
    return out


def join(streams: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Join byte streams back into a 1-D tensor (inverse of :func:`split`)."""
    width, rotate, _, _ = LAYOUT[dtype]
    n = len(streams[0]) if streams else 0
    bits = []
    for i in range(n):
        r = 0
        for s in range(width):
            r = (r << 8) | streams[s][i]
        bits.append(rotr1(r, 8 * width) if rotate else r)
    return tensor_from_bits(bits, dtype)


# -- (b) canonical Huffman on lists of bits ---------------------------------------------
ESCAPE = 256


def canonical_codes(lengths, escape_length: int) -> dict[int, tuple[int, int]]:
    """Return {symbol: (code, length)} for a book; the escape is symbol 256.

    Symbols are sorted by (length, symbol); the first gets code 0, each next one the
    previous code plus one, shifted left by the growth in length.
    """
    entries = sorted((int(ln), s) for s, ln in enumerate(lengths) if int(ln) > 0)
    if escape_length:
        entries = sorted(entries + [(int(escape_length), ESCAPE)])
    codes = {}
    code = 0
    prev_len = entries[0][0]
    for ln, sym in entries:
        code <<= ln - prev_len
        prev_len = ln
        codes[sym] = (code, ln)
        code += 1
    return codes


def kraft_sum_times(lengths, escape_length: int, scale_bits: int = 12) -> int:
    """Return sum(2^-l) over all codes (escape included), times 2^scale_bits, exactly."""
    total = sum(1 << (scale_bits - int(ln)) for ln in lengths if int(ln) > 0)
    if escape_length:
        total += 1 << (scale_bits - int(escape_length))
    return total


def encode_bits(symbols, lengths, escape_length: int) -> list[int]:
    """Return the bit sequence (0/1 list, first bit first) that codes symbols."""
    codes = canonical_codes(lengths, escape_length)
    bits: list[int] = []
    for sym in symbols:
        if sym in codes:
            code, ln = codes[sym]
            bits.extend((code >> (ln - 1 - k)) & 1 for k in range(ln))
        else:
            code, ln = codes[ESCAPE]
            bits.extend((code >> (ln - 1 - k)) & 1 for k in range(ln))
            bits.extend((sym >> k) & 1 for k in range(8))
    return bits


def decode_bits(bits: list[int], count: int, lengths, escape_length: int) -> tuple[list[int], int]:
    """Decode count symbols from a bit list; return (symbols, bits used).

    Raises:
        ValueError: the bits run out or hold a pattern that is no code.
    """
    by_code = {(ln, code): sym for sym, (code, ln) in canonical_codes(lengths, escape_length).items()}
    max_len = max(ln for ln, _ in by_code)
    out: list[int] = []
    pos = 0
    for _ in range(count):
        code, ln = 0, 0
        while True:
            if pos >= len(bits) or ln >= max_len:
                raise ValueError(f"no code at bit {pos}")
            code = (code << 1) | bits[pos]
            pos += 1
            ln += 1
            if (ln, code) in by_code:
                break
        sym = by_code[(ln, code)]
        if sym == ESCAPE:
            if pos + 8 > len(bits):
                raise ValueError("escape runs past the end of the bits")
            sym = sum(bits[pos + k] << k for k in range(8))
            pos += 8
        out.append(sym)
    return out, pos


def bits_to_bytes(bits: list[int]) -> bytes:
    """Pack bits LSB first: bit k goes to byte k // 8, bit position k % 8."""
    data = bytearray((len(bits) + 7) // 8)
    for k, b in enumerate(bits):
        data[k // 8] |= b << (k % 8)
    return bytes(data)


def bytes_to_bits(data: bytes) -> list[int]:
    """Unpack bytes into bits LSB first (inverse of :func:`bits_to_bytes`)."""
    return [(byte >> k) & 1 for byte in data for k in range(8)]


# -- (c) entropy and optimal lengths ----------------------------------------------------
def entropy(counts) -> float:
    """Return the Shannon entropy in bits per symbol."""
    total = float(sum(counts))
    return -sum(c / total * math.log2(c / total) for c in counts if c > 0)


def huffman_lengths(weights) -> list[int]:
    """Return unlimited optimal Huffman code lengths for weights (0 for weight 0).

    The textbook algorithm on a plain list: repeatedly merge the two lightest nodes.
    """
    nodes = [(float(w), [s]) for s, w in enumerate(weights) if w > 0]
    lengths = [0] * len(weights)
    if len(nodes) == 1:
        lengths[nodes[0][1][0]] = 1
        return lengths
    while len(nodes) > 1:
        nodes.sort(key=lambda node: node[0])
        (wa, a), (wb, b) = nodes[0], nodes[1]
        for s in a + b:
            lengths[s] += 1
        nodes = nodes[2:] + [(wa + wb, a + b)]
    return lengths


def package_merge(weights, limit: int) -> list[int]:
    """Length-limited optimal code lengths by textbook package-merge, with each item
    carrying its multiset of leaves. Items sort by (weight, leaf before package,
    position); leaves are ranked by (weight, index) first."""
    n = len(weights)
    if n == 1:
        return [1]
    order = sorted(range(n), key=lambda i: (weights[i], i))
    leaves = [(weights[i], 0, rank, {i: 1}) for rank, i in enumerate(order)]
    current = list(leaves)
    for _ in range(limit - 1):
        packages = []
        for k in range(len(current) // 2):
            a, b = current[2 * k], current[2 * k + 1]
            merged = dict(a[3])
            for leaf, times in b[3].items():
                merged[leaf] = merged.get(leaf, 0) + times
            packages.append((a[0] + b[0], 1, k, merged))
        current = sorted(leaves + packages, key=lambda item: item[:3])
    lengths = [0] * n
    for item in current[: 2 * n - 2]:
        for leaf, times in item[3].items():
            lengths[leaf] += times
    return lengths


def exponent_lengths(lengths, escape_length: int, shift: int) -> list[int]:
    """The split exponents' code (frame_format.md): exponent e weighs the sum of
    2**(20 - l) over its 2**shift byte symbols (l = escape + 8 for an escaped one), and
    its length is package-merge's at 12 over those weights, ranked by (weight, e)."""
    weights = []
    for e in range(256 >> shift):
        w = 0
        for m in range(1 << shift):
            ln = int(lengths[(e << shift) | m])
            w += 1 << (20 - (ln if ln else int(escape_length) + 8))
        weights.append(w)
    return package_merge(weights, 12)


def expected_bits(counts, lengths, escape_length: int = 0) -> float:
    """Return mean bits per symbol of a book (length 0 = escape + 8 raw bits)."""
    total = float(sum(counts))
    cost = 0.0
    for c, ln in zip(counts, lengths):
        if c:
            cost += c * (int(ln) if int(ln) else int(escape_length) + 8)
    return cost / total


# -- (d) whole frames -------------------------------------------------------------------
MAGIC = b"CCFR"
HEADER = struct.Struct("<4sBBBBQII")  # magic, version, dtype, nstreams, flags, numel, chunk_elems, nchunks
CHUNK_MASK, CHUNK_ZERO, CHUNK_RAW0 = 0x01, 0x02, 0x10
LANES = 4
# The payload checksum constants are not in the format docs; taken from kernels/layout.py.
_HASH_SEED = 0xCBF29CE484222325
_HASH_MUL = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def payload_hash(data: bytes, chunk_index: int) -> int:
    """The chunk checksum: xor-multiply over little-endian 64-bit words, folded to 32 bits."""
    # Four multiply-xor chains over the words k = j mod 4, then chained together.
    lanes = [_HASH_SEED ^ chunk_index ^ j for j in range(4)]
    for i, k in enumerate(range(0, len(data), 8)):
        lanes[i % 4] = ((lanes[i % 4] ^ int.from_bytes(data[k : k + 8], "little")) * _HASH_MUL) & _M64
    h = lanes[0]
    for j in range(1, 4):
        h = ((h ^ lanes[j]) * _HASH_MUL) & _M64
    return (h >> 32) ^ (h & 0xFFFFFFFF)


def frame_books(codebook_set) -> dict[str, list[tuple[list[int], int]]]:
    """Return {id: [(lengths, escape_length), ...]} for every coded book or group of a set."""
    return {
        group.id: [([int(x) for x in book.lengths], int(book.escape_length)) for book in group]
        for _, group in codebook_set.groups()
        if not group.raw
    }


class NaiveFrame:
    """What :func:`parse_frame` reads: header fields, book ids, chunk table entries."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def parse_frame(data: bytes) -> NaiveFrame:
    """Parse and check a frame's header, book ids, table and CRC (asserts on anything odd)."""
    magic, version, code, ns, flags, numel, chunk_elems, nchunks = HEADER.unpack_from(data, 0)
    assert magic == MAGIC and version in (1, 2, 3), (magic, version)
    assert flags & ~3 == 0 and (version == 3) == bool(flags & 2), (version, flags)
    dtype = DTYPE_BY_CODE[code]
    assert ns == LAYOUT[dtype][0]
    assert nchunks == (-(-numel // chunk_elems) if numel else 0)
    pos = HEADER.size
    ids = [f"{x:016x}" for x in struct.unpack_from(f"<{ns}Q", data, pos)]
    pos += 8 * ns
    entry_size = pad8(8 + 4 * ns)
    table = []
    for _ in range(nchunks):
        cflags, ref, chosen, checksum = struct.unpack_from("<BBHI", data, pos)
        sizes = list(struct.unpack_from(f"<{ns}I", data, pos + 8))
        assert version != 1 or chosen == 0
        assert data[pos + 8 + 4 * ns : pos + entry_size] == bytes(entry_size - 8 - 4 * ns)
        table.append((cflags, ref, checksum, sizes, [(chosen >> (4 * s)) & 15 for s in range(ns)]))
        pos += entry_size
    crc, zero = struct.unpack_from("<II", data, pos)
    assert crc == zlib.crc32(data[:pos]) and zero == 0
    pos += 8
    if version == 2:
        assert any(any(t[4]) for t in table), "version 2 only when some chunk names a book"
    if version == 3:
        assert dtype in SPLIT_BITS, "split exponents only where bits lie under the exponent"
    return NaiveFrame(
        dtype=dtype,
        numel=numel,
        chunk_elems=chunk_elems,
        nchunks=nchunks,
        flags=flags,
        ids=ids,
        table=table,
        header_bytes=pos,
    )


def decode_lanes(segment: bytes, count: int, lengths, escape_length: int) -> list[int]:
    """Decode a coded stream segment: 4 u32 lane byte lengths, then the lanes, each padded to 8.

    Lane k holds symbols [k*count//4, (k+1)*count//4). Checks that every lane is exactly as
    long as its symbols need and that all padding is zero (what the encoder must write).
    """
    lane_bytes = struct.unpack_from("<4I", segment, 0)
    pos = 4 * LANES
    symbols: list[int] = []
    for k in range(LANES):
        n_k = (k + 1) * count // LANES - k * count // LANES
        lane = segment[pos : pos + lane_bytes[k]]
        assert len(lane) == lane_bytes[k]
        bits = bytes_to_bits(lane)
        syms, used = decode_bits(bits, n_k, lengths, escape_length)
        assert (used + 7) // 8 == lane_bytes[k], ("lane longer than its symbols", k, used, lane_bytes[k])
        assert not any(bits[used:]), "nonzero bits after a lane's last code"
        padded = pad8(lane_bytes[k])
        assert segment[pos + lane_bytes[k] : pos + padded] == bytes(padded - lane_bytes[k])
        symbols.extend(syms)
        pos += padded
    assert pos == len(segment), (pos, len(segment))
    return symbols


def decode_frame(data: bytes, books: dict[str, list[tuple[list[int], int]]]) -> torch.Tensor:
    """Decode a whole frame into a 1-D tensor, checking every documented invariant.

    That includes the encoder's book choice: each coded chunk's book must be one that
    codes its symbols in the fewest bits, the lowest such index.
    """
    data = bytes(data)
    fr = parse_frame(data)
    width, rotate, exp_shift, _ = LAYOUT[fr.dtype]
    split = SPLIT_BITS[fr.dtype] if fr.flags & 2 else 0
    pos = fr.header_bytes
    bits_out: list[int] = []
    for c, (cflags, ref, checksum, sizes, chosen) in enumerate(fr.table):
        count = min(fr.chunk_elems, fr.numel - c * fr.chunk_elems)
        start = pos
        if cflags & CHUNK_ZERO:
            assert sizes == [0] * width and not cflags & CHUNK_MASK and not any(chosen)
            bits_out.extend([0] * count)
            if fr.flags & 1:
                assert checksum == payload_hash(b"", c)
            continue
        present = list(range(count))
        if cflags & CHUNK_MASK:
            mbytes = (count + 7) // 8
            mask = bytes_to_bits(data[pos : pos + mbytes])
            assert not any(mask[count:])
            present = [i for i in range(count) if mask[i]]
            assert data[pos + mbytes : pos + pad8(mbytes)] == bytes(pad8(mbytes) - mbytes)
            pos += pad8(mbytes)
        streams = []
        for s in range(width):
            seg = data[pos : pos + sizes[s]]
            assert len(seg) == sizes[s]
            if cflags & (CHUNK_RAW0 << s):
                assert sizes[s] == len(present) and chosen[s] == 0
                streams.append(list(seg))
            elif s == 0 and split:
                # The exponents' code derived from each book; then the plane: split bits
                # a symbol, LSB first, ceil(n / 8) groups of `split` bytes, unused bits 0.
                group = [(exponent_lengths(ln, e, split), 0) for ln, e in books[fr.ids[s]]]
                n = len(present)
                plane_size = split * ((n + 7) // 8)
                exps = decode_lanes(seg[: sizes[s] - plane_size], n, *group[chosen[s]])
                costs = [len(encode_bits(exps, ln, e)) for ln, e in group]
                assert costs.index(min(costs)) == chosen[s], ("not the cheapest book", c, s, costs)
                plane = bytes_to_bits(seg[sizes[s] - plane_size :])
                assert not any(plane[split * n :]), "nonzero bits after the plane's last symbol"
                low = [sum(plane[split * j + b] << b for b in range(split)) for j in range(n)]
                streams.append([(x << split) | m for x, m in zip(exps, low)])
            else:
                group = books[fr.ids[s]]
                lengths, esc = group[chosen[s]]
                syms = decode_lanes(seg, len(present), lengths, esc)
                costs = [len(encode_bits(syms, ln, e)) for ln, e in group]
                assert costs.index(min(costs)) == chosen[s], ("not the cheapest book", c, s, costs)
                streams.append(syms)
            assert data[pos + sizes[s] : pos + pad8(sizes[s])] == bytes(pad8(sizes[s]) - sizes[s])
            pos += pad8(sizes[s])
        if exp_shift is not None:
            streams[0] = [(b + (ref << exp_shift)) & 0xFF for b in streams[0]]
        chunk = [0] * count
        for j, i in enumerate(present):
            r = 0
            for s in range(width):
                r = (r << 8) | streams[s][j]
            chunk[i] = rotr1(r, 8 * width) if rotate else r
        if cflags & CHUNK_MASK:
            assert all(chunk[i] != 0 for i in present)
        if fr.flags & 1:
            assert checksum == payload_hash(data[start:pos], c), f"chunk {c} checksum"
        else:
            assert checksum == 0
        bits_out.extend(chunk)
    assert pos == len(data), (pos, len(data))
    return tensor_from_bits(bits_out, fr.dtype)
