"""Multi-process tests of comm_codec.collectives on real gloo groups (2 and 3 ranks).

Every rank builds every rank's input from a seed, so each can compute the expected
result on its own: for reductions, the documented semantics -- the float32 sum in rank
order (divided by W for an average), rounded to the tensor's dtype once; for gathers
and point-to-point, the sender's bits. Results are compared bit for bit (NaN payloads
and -0.0 included). Worker functions (``_w_*``) run on every rank via dist_utils.
"""

import hashlib

import pytest
import torch
import torch.distributed as dist

import comm_codec as cc
from comm_codec.collectives import CollectiveError
from comm_codec.comm import collectives
from comm_codec.comm.stats import CommStats

import dist_utils
from helpers import slow_but

pytestmark = pytest.mark.dist

WORLDS = [2, pytest.param(3, marks=pytest.mark.slow)]  # the quick tier runs 2 ranks
WORLD_IDS = ["world2", "world3"]
FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALL_DTYPES = dict(FLOATS, fp8_e4m3=torch.float8_e4m3fn, fp8_e5m2=torch.float8_e5m2, int8=torch.int8, uint8=torch.uint8)


# ----------------------------------------------------------------------------------------
# Helpers (run inside the ranks)
# ----------------------------------------------------------------------------------------
def _sizes(world):
    # The last size spans several pipelined pieces (collectives.MAX_PIECES / MIN_PIECE_ELEMS).
    return [0, 1, world - 1, 1000, 100003, 3 * world * (1 << 18) + 5]


def _float_input(rank, n, dtype, salt=0):
    """Gradient-like values of many scales, with +0/-0 runs, subnormals, Inf and NaN."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * n + salt)
    scale = 10.0 ** torch.randint(-6, 1, (n,), generator=g).float()
    x = torch.randn(n, generator=g) * scale
    u = torch.rand(n, generator=g)
    x[u < 0.30] = 0.0
    x[(u >= 0.30) & (u < 0.33)] = -0.0
    tiny = torch.finfo(dtype).smallest_normal
    x[(u >= 0.33) & (u < 0.34)] = tiny / 4  # subnormal in dtype
    x = x.to(dtype)
    if n > 50:
        # A few non-finite values, where at most one rank has one (the sum stays defined).
        x[rank::997][:1] = float("inf") if rank % 2 == 0 else float("-inf")
        x[10 + rank] = float("nan")
    return x


def _random_bits(rank, n, dtype, salt=0):
    """Uniformly random bit patterns of dtype (every NaN, Inf and -0.0 included)."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * n + salt)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _rank_order(parts, dtype, average):
    acc = None
    for p in parts:
        acc = p.float().clone() if acc is None else acc.add_(p.float())
    if average:
        acc.div_(len(parts))
    return acc.to(dtype)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _assert_bits(got, expected, what):
    assert got.dtype == expected.dtype and got.numel() == expected.numel(), (what, got.dtype, expected.dtype)
    a, b = _bits(got.reshape(-1)), _bits(expected.reshape(-1))
    if not torch.equal(a, b):
        width = got.element_size()
        bad = (a != b).nonzero().reshape(-1)
        i = int(bad[0]) // width
        raise AssertionError(
            f"{what}: {bad.numel()} bytes differ; first in element {i}: got "
            f"{got.reshape(-1)[i].item()!r}, expected {expected.reshape(-1)[i].item()!r}"
        )


def _digest(t):
    return hashlib.sha256(_bits(t).numpy().tobytes()).hexdigest()


def _shard_sizes(n, world):
    return [(r + 1) * n // world - r * n // world for r in range(world)]


# ----------------------------------------------------------------------------------------
# all_reduce
# ----------------------------------------------------------------------------------------
def _w_all_reduce(rank, world, dtype_name, average):
    dtype = FLOATS[dtype_name]
    codec = cc.Codec()
    out = []
    for n in _sizes(world):
        x = _float_input(rank, n, dtype)
        expected = _rank_order([_float_input(r, n, dtype) for r in range(world)], dtype, average)
        stats = CommStats()
        result = collectives.all_reduce(x, codec, average=average, stats=stats)
        assert result is x, "all_reduce must work in place and return its argument"
        _assert_bits(x, expected, f"rank {rank}: all_reduce {dtype_name} n={n} average={average}")
        out.append({"n": n, "digest": _digest(x), "stats": stats.as_dict()})
    return out


@pytest.mark.parametrize(
    "average,dtype_name,world",
    slow_but(
        {"sum-bf16-world2", "average-fp32-world2"},
        [(False, "sum"), (True, "average")],
        [(d, d) for d in FLOATS],
        [(w, f"world{w}") for w in (2, 3)],
    ),
)
@pytest.mark.slow
def test_all_reduce_bit_exact_rank_order(world, dtype_name, average):
    results = dist_utils.run(_w_all_reduce, world, dtype_name, average)
    itemsize = FLOATS[dtype_name].itemsize
    for i, n in enumerate(_sizes(world)):
        assert len({r[i]["digest"] for r in results}) == 1, f"n={n}: ranks disagree"
        for rank, r in enumerate(results):
            s = r[i]["stats"]
            assert s["calls"] == 1
            # What a plain all-reduce would send from this rank: the other ranks' shards
            # in phase 1, this rank's reduced shard to every other rank in phase 2 — per
            # pipelined piece (large buffers go in pieces, each sharded over the ranks).
            expected = 0
            for a, b in collectives.pieces(n, world):
                shards = _shard_sizes(b - a, world)
                expected += (b - a - shards[rank] + (world - 1) * shards[rank]) * itemsize
            assert s["bytes_in"] == expected
            assert s["bytes_out"] > 0
            if n >= 1000:
                assert s["encode_seconds"] > 0 and s["decode_seconds"] > 0


def _w_all_reduce_compresses(rank, world):
    """Gradient-like bf16 data really shrinks on the wire (ratio > 1)."""
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(200_000, generator=g) * 1e-3).to(torch.bfloat16)
    stats = CommStats()
    collectives.all_reduce(x, average=True, stats=stats)
    return stats.as_dict()


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_all_reduce_stats_show_compression(world):
    for s in dist_utils.run(_w_all_reduce_compresses, world):
        assert s["ratio"] > 1.1, s
        assert s["ratio"] == pytest.approx(s["bytes_in"] / s["bytes_out"])
        assert s["comm_seconds"] >= s["encode_seconds"] > 0


def _w_all_reduce_cast(rank, world):
    """cast=bf16 on fp32 input: each contribution rounded to bf16, rank-order float32
    sum, rounded to bf16 once, widened back to fp32 on every rank."""
    n = 5000
    x = _float_input(rank, n, torch.float32, salt=5)
    parts = [_float_input(r, n, torch.float32, salt=5).to(torch.bfloat16) for r in range(world)]
    expected = _rank_order(parts, torch.bfloat16, True).float()
    collectives.all_reduce(x, average=True, cast=torch.bfloat16)
    _assert_bits(x, expected, f"rank {rank}: all_reduce cast=bf16")
    return _digest(x)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_all_reduce_cast_bf16_semantics(world):
    assert len(set(dist_utils.run(_w_all_reduce_cast, world))) == 1


def _w_all_reduce_subgroups(rank, world):
    """A group of the last two ranks, and a group of one (no communication at all)."""
    pair = dist.new_group([world - 2, world - 1])
    solo = dist.new_group([0])
    out = {}
    if rank >= world - 2:
        x = _float_input(rank, 777, torch.bfloat16)
        expected = _rank_order(
            [_float_input(r, 777, torch.bfloat16) for r in (world - 2, world - 1)], torch.bfloat16, True
        )
        collectives.all_reduce(x, group=pair, average=True)
        _assert_bits(x, expected, f"rank {rank}: sub-group all_reduce")
        out["pair"] = _digest(x)
    if rank == 0:
        x = _float_input(0, 100, torch.float32)
        before = x.clone()
        stats = CommStats()
        collectives.all_reduce(x, group=solo, average=True, stats=stats)
        _assert_bits(x, before, "one-rank group: the average of one tensor is itself")
    return out


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_all_reduce_on_sub_groups(world):
    results = dist_utils.run(_w_all_reduce_subgroups, world)
    assert results[-1]["pair"] == results[-2]["pair"]


# ----------------------------------------------------------------------------------------
# all_gather, reduce_scatter
# ----------------------------------------------------------------------------------------
def _w_all_gather(rank, world):
    stats = CommStats()
    calls = 0
    for name, dtype in ALL_DTYPES.items():
        for n in (0, 1, 1000, 70001):  # 70001: several 16 Ki-element chunks
            x = _random_bits(rank, n, dtype, salt=3)
            outputs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            result = collectives.all_gather(outputs, x, stats=stats)
            calls += 1
            assert result is outputs
            for r in range(world):
                _assert_bits(
                    outputs[r], _random_bits(r, n, dtype, salt=3), f"rank {rank}: all_gather {name} n={n}, slot {r}"
                )
        # Realistic floats too (coded, not just raw-stored random bits), 2-D outputs.
        if dtype.is_floating_point and dtype.itemsize >= 2:
            x = _float_input(rank, 4096, dtype).view(64, 64)
            outputs = [torch.empty(64, 64, dtype=dtype) for _ in range(world)]
            collectives.all_gather(outputs, x, stats=stats)
            calls += 1
            for r in range(world):
                _assert_bits(outputs[r], _float_input(r, 4096, dtype), f"rank {rank}: all_gather {name} 2-D")
    s = stats.as_dict()
    assert s["calls"] == calls
    return s


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.slow
def test_all_gather_bit_exact_every_dtype(world):
    for s in dist_utils.run(_w_all_gather, world):
        assert s["bytes_in"] > 0 and s["bytes_out"] > 0


def _w_reduce_scatter(rank, world, dtype_name, average):
    dtype = FLOATS[dtype_name]
    stats = CommStats()
    for n in (0, 1, 1000, 30001):
        inputs = [_float_input(rank, n, dtype, salt=100 + j) for j in range(world)]
        output = torch.empty(n, dtype=dtype)
        result = collectives.reduce_scatter(output, inputs, average=average, stats=stats)
        assert result is output
        expected = _rank_order([_float_input(r, n, dtype, salt=100 + rank) for r in range(world)], dtype, average)
        _assert_bits(output, expected, f"rank {rank}: reduce_scatter {dtype_name} n={n} average={average}")
    return stats.as_dict()


@pytest.mark.parametrize(
    "average,dtype_name,world",
    slow_but(
        {"average-bf16-world2"},
        [(False, "sum"), (True, "average")],
        [(d, d) for d in FLOATS],
        [(w, f"world{w}") for w in (2, 3)],
    ),
)
def test_reduce_scatter_bit_exact_rank_order(world, dtype_name, average):
    for s in dist_utils.run(_w_reduce_scatter, world, dtype_name, average):
        assert s["calls"] == 4 and s["bytes_in"] > 0


def _w_pipelined(rank, world):
    """Slots cut into several pieces (a small MIN_PIECE_ELEMS): the same bits as one piece, in place."""
    saved = collectives.MIN_PIECE_ELEMS
    collectives.MIN_PIECE_ELEMS = 1000  # 5003 elements: 4 uneven pieces
    try:
        n, out = 5003, {}
        workspace = collectives.Workspace()
        for name, dtype in FLOATS.items():
            for cast in (None, torch.bfloat16) if dtype == torch.float32 else (None,):
                inputs = [_float_input(rank, n, dtype, salt=200 + j) for j in range(world)]
                before = [x.clone() for x in inputs]
                output = torch.empty(n, dtype=dtype)
                collectives.reduce_scatter(
                    output, inputs, average=True, kind="gradient", cast=cast, workspace=workspace
                )
                theirs = [_float_input(r, n, dtype, salt=200 + rank) for r in range(world)]
                if cast is not None:
                    theirs = [t.to(cast) for t in theirs]
                expected = _rank_order(theirs, cast or dtype, True).to(dtype)
                _assert_bits(output, expected, f"rank {rank}: pipelined reduce_scatter {name} cast={cast}")
                assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(inputs, before)), "inputs were modified"
            # all_gather in place, as FSDP2 calls it: the input is this rank's row of the output.
            rows = torch.empty(world, n, dtype=dtype)
            rows[rank] = _float_input(rank, n, dtype, salt=300)
            stats = CommStats()
            collectives.all_gather(list(rows), rows[rank], kind="weight", stats=stats, workspace=workspace)
            for r in range(world):
                _assert_bits(rows[r], _float_input(r, n, dtype, salt=300), f"rank {rank}: pipelined all_gather {name}")
            out[name] = stats.as_dict()
        # A group of one: nothing goes on the wire (gloo rejects zero-element collectives).
        alone = [dist.new_group([r]) for r in range(world)][rank]
        x = _float_input(rank, n, torch.bfloat16)
        single = torch.empty(n, dtype=torch.bfloat16)
        collectives.reduce_scatter(single, [x], group=alone, average=True)
        _assert_bits(single, _rank_order([x], torch.bfloat16, True), f"rank {rank}: reduce_scatter over a group of one")
        gathered = [torch.empty(n, dtype=torch.bfloat16)]
        collectives.all_gather(gathered, x, group=alone)
        _assert_bits(gathered[0], x, f"rank {rank}: all_gather over a group of one")
        return out
    finally:
        collectives.MIN_PIECE_ELEMS = saved


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_reduce_scatter_and_all_gather_pipeline_pieces_bit_exactly(world):
    for r in dist_utils.run(_w_pipelined, world):
        for name, s in r.items():  # (the all-gathers': every piece of this rank's slot to every peer)
            assert s["calls"] == 1
            assert s["bytes_in"] == (world - 1) * 5003 * FLOATS[name].itemsize
            assert 0 < s["bytes_out"] < s["bytes_in"]


def _w_peer_frames(rank, world):
    """Frames from a peer that do not hold what the receiver expects are refused, never allocated."""
    out = {}
    saved = collectives.MIN_PIECE_ELEMS
    collectives.MIN_PIECE_ELEMS = 1000
    try:
        # (1) Piece 1 of 4 of a reduce-scatter arrives corrupted on rank 1 (rank 0 flips a
        #     byte of the second frame it encodes): every rank raises, at the same stage,
        #     and the group stays in step.
        honest, flipper = cc.Codec(), cc.Codec()
        encoded = [0]

        def flip_second(tensor, kind="gradient"):
            encoded[0] += 1
            frame = honest.encode(tensor, kind)
            return _flip_payload_byte(frame) if encoded[0] == 2 else frame

        flipper.encode = flip_second
        inputs = [_float_input(rank, 5003, torch.bfloat16, salt=j) for j in range(world)]
        out["piece"] = _catch(
            lambda: collectives.reduce_scatter(
                torch.empty(5003, dtype=torch.bfloat16), inputs, flipper if rank == 0 else honest
            )
        )

        # (2) Rank 0 sends a frame of 16 Mi zeros (a few hundred bytes) where 1000 elements
        #     are expected: decoding it would allocate 32 MB; the header check refuses it.
        codec, liar = cc.Codec(), cc.Codec()
        liar.encode = lambda tensor, kind="activation": codec.encode(torch.zeros(1 << 24, dtype=tensor.dtype), kind)
        x = _float_input(rank, 1000, torch.bfloat16)
        outputs = [torch.empty(1000, dtype=torch.bfloat16) for _ in range(world)]
        out["zeros"] = _catch(lambda: collectives.all_gather(outputs, x, liar if rank == 0 else codec))
        out["zeros_frame"] = codec.encode(torch.zeros(1 << 24, dtype=torch.bfloat16), "activation").numel()
    finally:
        collectives.MIN_PIECE_ELEMS = saved
    # (3) recv: a size announcement larger than any frame of the receiver's tensor.
    if rank == 0:
        dist.send(torch.tensor([1 << 39], dtype=torch.int64), 1)
    elif rank == 1:
        try:
            collectives.recv(torch.empty(100), 0)
        except cc.FrameError as exc:
            out["recv"] = str(exc)
    t = torch.full((1000,), float(rank + 1), dtype=torch.bfloat16)
    collectives.all_reduce(t)
    out["after"] = t[0].item()
    return out


def test_frames_from_peers_are_checked_against_the_expected_size():
    results = dist_utils.run(_w_peer_frames, 2, timeout=45)
    for r in results:
        assert r["piece"] is not None and r["piece"].startswith(
            "compressed collective failed: rank 1: shard 1 from rank 0: "
        ), r["piece"]
        assert r["zeros"] == (
            "compressed collective failed: rank 1: frame from rank 0: frame holds 16777216 elements, expected 1000"
        ), r["zeros"]
        assert r["zeros_frame"] < (1 << 25) // 1000  # what the peer sent: a thousandth of what it claims
        assert r["after"] == 3.0
    assert results[0]["piece"] == results[1]["piece"]
    assert results[1]["recv"].startswith(
        "peer 0 announced a frame of 549755813888 bytes; a frame of 100 torch.float32 elements takes 1.."
    )


# ----------------------------------------------------------------------------------------
# send / recv
# ----------------------------------------------------------------------------------------
def _w_send_recv(rank, world):
    """Ring: rank 0 sends to 1 first, every other rank receives first, so nobody waits
    on a send that no one receives."""
    dst, src = (rank + 1) % world, (rank - 1) % world
    stats = CommStats()
    checked = 0
    for name, dtype in ALL_DTYPES.items():
        for n in (0, 1, 5000):
            make = _float_input if dtype in FLOATS.values() else _random_bits
            x = make(rank, n, dtype)
            out = torch.empty(n, dtype=dtype)
            if rank == 0:
                collectives.send(x, dst, stats=stats)
                collectives.recv(out, src, stats=stats)
            else:
                collectives.recv(out, src, stats=stats)
                collectives.send(x, dst, stats=stats)
            _assert_bits(out, make(src, n, dtype), f"rank {rank}: recv {name} n={n} from {src}")
            checked += 1
    return stats.as_dict(), checked


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_send_recv_bit_exact(world):
    for s, checked in dist_utils.run(_w_send_recv, world):
        assert s["calls"] == checked  # send counts a call; recv only decodes
        assert s["bytes_in"] > 0 and s["decode_seconds"] > 0


def _w_recv_mismatch(rank, world):
    """The receiver's tensor does not match what was sent: recv must say so (FrameError)."""
    out = {}
    for label, send_t, recv_t in (
        ("numel", torch.randn(100), torch.empty(99)),
        ("dtype", torch.randn(100), torch.empty(100, dtype=torch.bfloat16)),
    ):
        if rank == 0:
            collectives.send(send_t, 1)
        elif rank == 1:
            try:
                collectives.recv(recv_t, 0)
                out[label] = None
            except cc.FrameError as exc:
                out[label] = str(exc)
        dist.barrier()
    return out


def test_recv_rejects_wrong_numel_and_dtype():
    """recv's docstring: FrameError when "its size or dtype does not match tensor"."""
    results = dist_utils.run(_w_recv_mismatch, 2)
    assert results[1]["numel"] is not None and "frame holds 100 elements, expected 99" in results[1]["numel"]
    assert results[1]["dtype"] is not None, "a float32 frame was silently converted into a bfloat16 tensor"


def _w_send_recv_subgroup(rank, world):
    """send/recv take ranks *in the group* (their docstrings): in the group of ranks
    [1, 2], group rank 0 (global 1) sends to group rank 1 (global 2)."""
    group = dist.new_group([1, 2])
    try:
        if rank == 1:
            collectives.send(torch.arange(10, dtype=torch.float32), 1, group=group)
        elif rank == 2:
            out = torch.empty(10)
            collectives.recv(out, 0, group=group)
            return out.tolist()
    except ValueError as exc:  # returned, not raised: the group stays usable for other tests
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.slow
def test_send_recv_ranks_are_group_ranks():
    results = dist_utils.run(_w_send_recv_subgroup, 3, timeout=30)
    assert results[1] is None, f"send to group rank 1 failed: {results[1]}"
    assert results[2] == [float(i) for i in range(10)], f"recv from group rank 0 failed: {results[2]}"


# ----------------------------------------------------------------------------------------
# row_parallel_all_reduce
# ----------------------------------------------------------------------------------------
def _w_row_parallel(rank, world):
    """A row-parallel linear: rank r holds columns r of the weight and of the input."""
    torch.manual_seed(0)
    weight = torch.randn(16, 24) * 0.1  # out x in, the same on every rank
    x = torch.randn(4, 24)
    upstream = torch.randn(4, 16)
    lo, hi = rank * 24 // world, (rank + 1) * 24 // world
    stats = CommStats()

    # (1) The op alone: forward = rank-order sum of the partials, backward = identity.
    partial = (x[:, lo:hi] @ weight[:, lo:hi].T).detach().requires_grad_()
    y = collectives.row_parallel_all_reduce(partial, stats=stats)
    assert y.requires_grad and y.shape == partial.shape
    (y * upstream).sum().backward()
    _assert_bits(partial.grad, upstream, f"rank {rank}: gradient through the all-reduce")
    partials = [
        (x[:, a:b] @ weight[:, a:b].T) for a, b in ((r * 24 // world, (r + 1) * 24 // world) for r in range(world))
    ]
    _assert_bits(y.detach(), _rank_order(partials, torch.float32, False), f"rank {rank}: forward sum")
    assert not torch.equal(partial.detach(), y.detach())  # it did communicate

    # (2) In a layer, against the single-process reference.
    xr = x[:, lo:hi].clone().requires_grad_()
    wr = weight[:, lo:hi].clone().requires_grad_()
    y2 = collectives.row_parallel_all_reduce(xr @ wr.T, stats=stats)
    (y2 * upstream).sum().backward()
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y_ref = x_ref @ w_ref.T
    (y_ref * upstream).sum().backward()
    torch.testing.assert_close(y2.detach(), y_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xr.grad, x_ref.grad[:, lo:hi], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wr.grad, w_ref.grad[:, lo:hi], rtol=1e-5, atol=1e-6)
    return {"y": _digest(y2.detach()), "stats": stats.as_dict()}


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.slow
def test_row_parallel_all_reduce_forward_sum_backward_identity(world):
    results = dist_utils.run(_w_row_parallel, world)
    assert len({r["y"] for r in results}) == 1
    for r in results:
        assert r["stats"]["calls"] == 2 and r["stats"]["bytes_in"] > 0


# ----------------------------------------------------------------------------------------
# Errors: raised on every rank, and the group stays usable
# ----------------------------------------------------------------------------------------
def _flip_payload_byte(frame):
    params = cc.get_frame_parameters(frame)
    assert params.frame_bytes > params.header_bytes, "no payload to corrupt"
    frame = frame.clone()
    frame[params.header_bytes] ^= 0xA5
    return frame


def _catch(fn):
    try:
        fn()
    except CollectiveError as exc:
        return str(exc)
    return None


def _w_errors(rank, world):
    out = {}
    n = 30000
    codec = cc.Codec()

    # (1) Phase 1: rank 0's shards for its peers are corrupted after encoding.
    flipper = cc.Codec()
    flipper.encode = lambda tensor, kind="gradient": (
        _flip_payload_byte(codec.encode(tensor, kind)) if kind == "gradient" else codec.encode(tensor, kind)
    )
    out["phase1"] = _catch(
        lambda: collectives.all_reduce(_float_input(rank, n, torch.bfloat16), flipper if rank == 0 else codec)
    )

    # (2) Phase 2: rank 0's reduced shard is corrupted after encoding.
    bad = cc.Codec()
    real_encode = bad.encode

    def bad_encode(tensor, kind="gradient"):
        frame = real_encode(tensor, kind)
        return _flip_payload_byte(frame) if kind == "reduced_gradient" else frame

    bad.encode = bad_encode
    mine = bad if rank == 0 else codec
    out["phase2"] = _catch(lambda: collectives.all_reduce(_float_input(rank, n, torch.float32), mine))

    # (3) all_gather: rank 0's frame is corrupted.
    bad.encode = lambda tensor, kind="activation": _flip_payload_byte(real_encode(tensor, kind))
    outputs = [torch.empty(n, dtype=torch.float16) for _ in range(world)]
    out["gather"] = _catch(lambda: collectives.all_gather(outputs, _float_input(rank, n, torch.float16), mine))

    # (4) Misuse is refused before any communication, on every rank alike.
    try:
        collectives.reduce_scatter(torch.empty(4), [torch.empty(4)] * (world + 1))
        out["misuse"] = None
    except ValueError as exc:
        out["misuse"] = str(exc)

    # (5) The group is still in step.
    t = torch.full((1000,), float(rank + 1), dtype=torch.bfloat16)
    collectives.all_reduce(t, codec)
    out["after"] = t[0].item()
    return out


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_corrupt_frames_raise_collective_error_on_every_rank(world):
    results = dist_utils.run(_w_errors, world, timeout=45)
    for rank, r in enumerate(results):
        assert r["phase1"] is not None, f"rank {rank}: corrupt phase-1 shard went unnoticed"
        assert "compressed collective failed: rank 1: shard 1 from rank 0: " in r["phase1"]
        assert "checksum" in r["phase1"]
        assert r["phase2"] is not None, f"rank {rank}: corrupt reduced shard went unnoticed"
        for other in range(1, world):
            assert f"rank {other}: reduced shard from rank 0: " in r["phase2"], r["phase2"]
        assert "rank 0:" not in r["phase2"].replace("from rank 0", "")
        assert r["gather"] is not None and "rank 1: frame from rank 0: " in r["gather"], r["gather"]
        assert r["misuse"] == f"input_list needs one tensor per rank ({world}), got {world + 1}"
        assert r["after"] == sum(range(1, world + 1))
    for key in ("phase1", "phase2", "gather"):
        assert len({r[key] for r in results}) == 1, f"{key}: ranks report different errors"


@pytest.mark.unit
def test_engine_precompiles_the_coded_dtype_before_a_coded_call():
    """Owners load the kernels of the dtype that is coded (the cast's, if any) before timing a call."""
    from comm_codec.comm.engine import CodingEngine

    asked = []

    class Recording(cc.Codec):
        def precompile(self, dtypes=None):
            asked.append(list(dtypes))
            return {}

    engine = CodingEngine(cast="bf16")
    engine.codec = Recording(threads=1)
    engine.precompile_for(torch.zeros(8, dtype=torch.float32))
    engine.precompile_for(torch.zeros(8, dtype=torch.float16))
    assert asked == [[torch.bfloat16], [torch.float16]]


def _w_peer_announces(rank, world, claim):
    """Rank 2 answers a stage's size exchange with ``claim`` bytes to rank 0 (and nothing to rank 1)."""
    import time

    if rank == 2:
        header = torch.zeros(world, 3, dtype=torch.int64)
        header[0, 0] = claim
        dist.all_to_all_single(torch.empty(world, 3, dtype=torch.int64), header)
        time.sleep(1)
        return None
    t0 = time.monotonic()
    try:
        collectives.all_reduce(_float_input(rank, 4000, torch.bfloat16))
    except Exception as exc:  # the type is part of what is checked
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    return {"type": None}


@pytest.mark.slow
@pytest.mark.parametrize("claim", [1 << 40, -5], ids=["huge", "negative"])
def test_a_peer_announcing_an_impossible_size_fails_every_honest_rank_in_time(claim):
    """Sizes in a stage's exchange are claims: nothing is allocated for one the receiver cannot
    expect, and every honest rank raises CollectiveError within the group's timeout."""
    outcomes = dist_utils.run_outcomes(_w_peer_announces, 3, claim, timeout=90, pg_timeout=5.0)
    for rank in (0, 1):
        assert outcomes[rank]["status"] == "ok", outcomes[rank]
        got = outcomes[rank]["value"]
        assert got["type"] == "CollectiveError", (rank, got)
        assert got["seconds"] < 20, (rank, got)
    assert f"rank 2 announced frames of {claim} and 0 bytes" in outcomes[0]["value"]["message"]


@pytest.mark.unit
@pytest.mark.slow
def test_a_first_coded_call_that_waits_for_kernels_says_so(monkeypatch, caplog):
    """A compile still running when the first coded call comes: silent for 2 s, then a WARNING
    that names the dtypes and how long it has run, then one when they are ready."""
    import logging
    import time

    from comm_codec.comm import engine as engine_module

    def slow_precompile(codec, dtypes):  # what an empty numba cache costs, shortened
        time.sleep(3.0)
        return {}

    monkeypatch.setattr(engine_module, "precompile_kernels", slow_precompile)
    engine = engine_module.CodingEngine(mode="always")
    engine.start_precompile([torch.bfloat16, torch.int64])  # int64 is never coded
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="comm_codec.comm.engine"):
        engine.precompile_for(torch.zeros(8, dtype=torch.bfloat16))
    assert time.monotonic() - started >= 2.5
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2, messages
    assert "waits for the codec's kernels (bfloat16), compiling for 2 s so far" in messages[0]
    assert "comm-codec precompile" in messages[0] and "ready after 3 s" in messages[1]
    caplog.clear()
    engine.precompile_for(torch.zeros(8, dtype=torch.bfloat16))  # once ready, no more waiting or words
    assert not caplog.records
