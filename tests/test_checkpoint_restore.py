"""Restoring a file checkpoint: who writes the output, and in what order.

Workers decode segments; the thread that hands them to the digest writes them, in
source order, so that no worker waits on the output file's inode lock, and it counts as
one of the threads asked for.
"""

from __future__ import annotations

import threading

import torch
from safetensors.torch import save_file

from comm_codec import checkpoint as ck
from comm_codec.checkpoint import exact, files


def _weights(n: int, dtype) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(dtype)


def test_restored_segments_are_written_in_order_by_one_thread(tmp_path, monkeypatch):
    """At 2 threads every segment is written by the caller's thread, at offsets that follow
    each other, while one worker decodes; the output is byte-exact."""
    monkeypatch.setattr(exact, "PIECE_BYTES", 64 << 10)
    sd = {f"w{i}": _weights(1_000_000 + 999 * i, dtype) for i, dtype in
          enumerate((torch.bfloat16, torch.float32, torch.float16))}
    src, packed, out = tmp_path / "m.safetensors", tmp_path / "m.cckp", tmp_path / "r.safetensors"
    save_file(sd, src)
    ck.compress_file(src, packed, threads=2, progress=False)
    writes = []
    pwrite = files.AtomicFile.pwrite

    def record(self, data, offset):
        writes.append((threading.get_ident(), offset, memoryview(data).nbytes))
        pwrite(self, data, offset)

    decoders = set()
    decode_segment = exact._decode_segment

    def decode(*args):
        decoders.add(threading.get_ident())
        return decode_segment(*args)

    monkeypatch.setattr(files.AtomicFile, "pwrite", record)
    monkeypatch.setattr(exact, "_decode_segment", decode)
    ck.decompress_file(packed, out, threads=2, progress=False)
    assert out.read_bytes() == src.read_bytes()
    assert len(writes) > 10 and {w[0] for w in writes} == {threading.get_ident()}
    # The writer is one of the two threads: one worker decodes beside it.
    assert len(decoders) == 1 and threading.get_ident() not in decoders
    ends = [0] + [off + n for _, off, n in writes]
    assert [off for _, off, _ in writes] == ends[:-1] and ends[-1] == src.stat().st_size
