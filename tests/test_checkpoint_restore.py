"""Restoring a file checkpoint: who writes the output, and in what order.

Workers decode segments; the thread that hands them to the digest writes them, in
source order, so that no worker waits on the output file's inode lock, and it counts as
one of the threads asked for.
"""

from __future__ import annotations

import threading

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from comm_codec import checkpoint as ck
from comm_codec.checkpoint import exact, files
from comm_codec.checkpoint.container import zstd_bounded

import crafted

pytestmark = pytest.mark.unit


def _weights(n: int, dtype) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).to(dtype)


def test_restored_segments_are_written_in_order_by_one_thread(tmp_path, monkeypatch):
    """At 2 threads every segment is written by the caller's thread, at offsets that follow
    each other, while one worker decodes; the output is byte-exact."""
    monkeypatch.setattr(exact, "PIECE_BYTES", 64 << 10)
    sd = {
        f"w{i}": _weights(1_000_000 + 999 * i, dtype)
        for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16))
    }
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


def test_zstd_bytes_decode_within_their_bound_whatever_their_frames_declare():
    """A zstd segment decodes to its bytes whether its frame declares its size (one call) or
    not (streamed), across several frames; one that declares or holds more than the bound,
    declares less than it holds, or has bytes after its last frame is refused without the
    bound being exceeded; a truncated one comes out short (its caller checks the length)."""
    data = bytes(range(256)) * 40
    sized = zstandard.ZstdCompressor(level=3).compress(data)
    assert zstandard.frame_content_size(sized) == len(data)
    streamed = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(data)
    assert zstandard.frame_content_size(streamed) < 0  # not declared
    for blob, want in ((sized, data), (streamed, data), (sized + sized, data * 2), (sized + streamed, data * 2)):
        assert zstd_bounded(blob, len(want), "f.cckp", "segment") == want
        assert zstd_bounded(blob, len(want) + 100, "f.cckp", "segment") == want
        with pytest.raises(ck.CheckpointError, match="more than the"):
            zstd_bounded(blob, len(want) - 1, "f.cckp", "segment")
    assert len(zstd_bounded(sized[:-3], len(data), "f.cckp", "segment")) < len(data)
    for bad in (
        sized + b"junk",
        crafted.zstd_with_claimed_size(data, 1 << 40),
        crafted.zstd_with_claimed_size(data, 100),
    ):
        with pytest.raises(ck.CheckpointError, match="f.cckp: segment"):
            zstd_bounded(bad, len(data), "f.cckp", "segment")


def test_a_digest_helped_by_other_threads_hashes_every_buffer_once_in_order():
    """Threads that help the digest's own thread (DigestStream.help) hash the buffers in the
    order they were handed over, each once, whoever gets it; each buffer's callback runs
    once, after it is hashed; close() returns once all are hashed. The lagging hasher
    makes the helpers take most of them."""
    import hashlib

    hashed, called = [], []
    lock = threading.Lock()

    class _Recording:  # a hasher that records the order, and lags
        def __init__(self, name):
            self.h = hashlib.sha256()

        def update(self, data):
            with lock:
                hashed.append(bytes(data[:4]))
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkey = pytest.MonkeyPatch()
    monkey.setattr(files, "new_hasher", _Recording)
    try:
        h = files.DigestStream(background=True, name="sha256")
        blocks = [i.to_bytes(4, "little") * 1000 for i in range(400)]
        stop = threading.Event()

        def helper():
            while not stop.is_set():
                h.help()

        helpers = [threading.Thread(target=helper) for _ in range(3)]
        for t in helpers:
            t.start()
        for i, b in enumerate(blocks):
            h.update(b, lambda i=i: called.append((i, len(hashed))))
        digest = h.hexdigest()
        stop.set()
        for t in helpers:
            t.join()
    finally:
        monkey.undo()
    assert hashed == [b[:4] for b in blocks]
    assert digest == hashlib.sha256(b"".join(blocks)).hexdigest()
    assert sorted(i for i, _ in called) == list(range(len(blocks)))
    assert all(n > i for i, n in called)  # each callback after its buffer was hashed
    assert not h.help()  # closed: nothing left, and no thread to help


def test_a_digest_without_a_thread_hashes_at_once_and_help_does_nothing():
    h = files.DigestStream(background=False, name="sha256")
    seen = []
    h.update(b"abc", lambda: seen.append(1))
    assert seen == [1] and not h.help()
    import hashlib

    assert h.hexdigest() == hashlib.sha256(b"abc").hexdigest()


def test_ordered_map_does_idle_work_while_the_next_result_is_not_ready():
    """The consumer's idle work runs while it waits for a result (until it says there is no
    more), and results still come in job order."""
    from comm_codec.checkpoint.pipeline import Budget, ordered_map

    gate, calls = threading.Event(), []

    def fn(job):
        if job == 0:
            assert gate.wait(30), "the idle work never ran"
        return 2 * job

    def idle():
        calls.append(1)
        if len(calls) == 3:
            gate.set()  # the first result is held back until idle work has run three times
        return len(calls) < 6

    assert list(ordered_map(fn, range(5), 2, Budget(100), lambda job: 1, inline=False, idle=idle)) == [
        (j, 2 * j) for j in range(5)
    ]
    assert 3 <= len(calls) <= 6
