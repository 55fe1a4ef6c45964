"""Multi-process tests of comm_codec.fsdp (FSDP2's coded reduce-scatter and all-gather) on gloo.

What "lossless" means here, pinned by the tests: after every coded step each rank's
sharded gradient is, bit for bit, the rank-order float32 sum of every rank's row of
FSDP's reduce-scatter input, divided by the world size for AVG and rounded to the
reduce dtype once. The reference run gets exactly that from an uncoded custom
ReduceScatter of this file (:class:`_RankOrderReduceScatter`, which all-gathers the raw
rows); during warmup both runs use FSDP's own reduce-scatter. The all-gather must give
every rank the owners' bits, so the two runs' sharded parameters stay bit-identical step
after step and the full parameters are identical on every rank.

Worker functions (``_w_*``) run on every rank through tests/dist_utils.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import comm_codec as cc
import comm_codec.fsdp as ccf
from comm_codec.comm import collectives

import dist_utils

pytestmark = pytest.mark.dist

STEPS = 5
WARMUP = 2
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------------------
# Worker-side helpers
# ----------------------------------------------------------------------------------------
class _Net(nn.Module):
    """A small MLP whose shards are awkward.

    37 rows over 2 or 4 ranks shard unevenly; the head's 3 rows leave rank 3 of 4 an
    empty shard (FSDP pads it). (A module whose parameters have no elements at all fails
    in FSDP2's own backward in torch 2.13, before any collective.)
    """

    def __init__(self, d_in=24, d_out=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_in, 37), nn.Linear(37, 64), nn.Linear(64, 48)])
        self.head = nn.Linear(48, d_out)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _shard(net: _Net, mp: MixedPrecisionPolicy | None = None) -> _Net:
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in [*net.layers, net.head]:
        fully_shard(layer, **kw)
    fully_shard(net, **kw)
    return net


_CONFIGS = {
    # name: (parameter dtype, mixed precision policy, gradient divide factor)
    "bf16": (torch.bfloat16, None, None),
    "fp32-mp": (torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), None),
    "bf16-divide3": (torch.bfloat16, None, 3.0),
}


def _model(config: str) -> _Net:
    dtype, mp, factor = _CONFIGS[config]
    torch.manual_seed(0)
    net = _shard(_Net().to(dtype), mp)
    if factor is not None:
        for m in net.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(factor)
    return net


def _batch(rank, step, dtype):
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    return torch.randn(16, 24, generator=g).to(dtype), torch.randn(16, 3, generator=g)


def _train(net, rank, steps=STEPS, before_forward=None, after_step=None):
    """Train a few AdamW steps on rank-specific batches; return the losses."""
    dtype = next(net.parameters()).dtype
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step, dtype)
        if before_forward is not None:
            before_forward(net)
        loss = F.mse_loss(net(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if after_step is not None:
            after_step(net)
    return losses


def _local_bits(net) -> dict:
    """Every sharded parameter's local bytes, by name."""
    return {n: p.to_local().detach().contiguous().view(torch.uint8).clone() for n, p in net.named_parameters()}


def _full_digest(net) -> str:
    """sha256 of every full (all-gathered) parameter."""
    h = hashlib.sha256()
    for _, p in net.named_parameters():
        h.update(p.full_tensor().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _same_everywhere(text: str) -> bool:
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, text)
    return len(set(seen)) == 1


class _RankOrderReduceScatter(ReduceScatter):
    """The lossless definition, uncoded: the raw rows of every rank, summed in rank order.

    The first ``plain_calls`` calls (the other run's warmup) are FSDP's own reduce-scatter.
    """

    def __init__(self, plain_calls: int = 0):
        self.plain_calls = plain_calls
        self.plain = False  # (set per step, to follow the other run's plain steps)
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        factor = getattr(op, "factor", None)
        if self.calls <= self.plain_calls or self.plain:
            if factor is not None:  # gloo has no PREMUL_SUM
                _reduce_scatter_single(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
                output_tensor.mul_(factor)
            else:
                _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
            return None
        world, n = group.size(), output_tensor.numel()
        rows = [torch.empty(world, n, dtype=input_tensor.dtype) for _ in range(world)]
        dist.all_gather(rows, input_tensor.view(world, n).contiguous(), group=group)
        mine = group.rank()
        acc = rows[0][mine].to(torch.float32, copy=True)
        for r in range(1, world):
            acc.add_(rows[r][mine])
        if getattr(op, "op", op) == dist.ReduceOp.AVG:
            acc.div_(world)
        output_tensor.copy_(acc.to(output_tensor.dtype))
        if factor is not None:
            output_tensor.mul_(factor)
        return None


def _w_lossless(rank, world, config, min_piece=None):
    saved = collectives.MIN_PIECE_ELEMS
    if min_piece is not None:  # cut these small shards into several pipelined pieces
        collectives.MIN_PIECE_ELEMS = min_piece
    try:
        return _lossless(rank, world, config)
    finally:
        collectives.MIN_PIECE_ELEMS = saved


def _lossless(rank, world, config):
    dtype = _CONFIGS[config][0]
    # The coded run: books profiled online over WARMUP steps, then everything coded.
    net = _model(config)
    state = ccf.compress(net, warmup_steps=WARMUP, mode="always", min_bytes=0)
    coded_losses = _train(net, rank)
    coded_bits, coded_digest = _local_bits(net), _full_digest(net)
    stats = state.stats()
    # The reference: the same sum without coding, after the same plain warmup calls.
    ref = _model(config)
    reference = _RankOrderReduceScatter(plain_calls=stats["reduce_scatter"]["raw_calls"])
    for m in ref.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(reference)
    _train(ref, rank)
    ref_bits, ref_digest = _local_bits(ref), _full_digest(ref)
    # Plain FSDP2, for the loss curve (on gloo it has no PREMUL_SUM for a divide factor).
    plain_losses = _train(_model(config), rank) if _CONFIGS[config][2] is None else None
    differ = [n for n in coded_bits if not torch.equal(coded_bits[n], ref_bits[n])]
    return {
        "differ": differ,
        "same_full": _same_everywhere(coded_digest),
        "full_equals_ref": coded_digest == ref_digest,
        "coded_losses": coded_losses,
        "plain_losses": plain_losses,
        "dtype": str(dtype),
        "rs_ratio": stats["reduce_scatter"]["ratio"],
        "ag_ratio": stats["all_gather"]["ratio"],
        "rs_calls": stats["reduce_scatter"]["calls"],
        "ag_calls": stats["all_gather"]["calls"],
        "steps": stats["steps"],
        "warming_up": stats["warming_up"],
    }


def _w_never(rank, world):
    net = _model("bf16")
    state = ccf.compress(net, mode="never")
    losses = _train(net, rank)
    bits = _local_bits(net)
    plain = _model("bf16")
    plain_losses = _train(plain, rank)
    plain_bits = _local_bits(plain)
    d = state.stats()
    return {
        "same": all(torch.equal(bits[n], plain_bits[n]) for n in bits),
        "losses": losses == plain_losses,
        "calls": d["calls"],
        "raw_calls": d["raw_calls"],
        "books": d["books"],
        "steps": d["steps"],
    }


def _w_async_unshard(rank, world):
    """Modules unsharded with async_op=True (explicit prefetch) get a Work from the coded all-gather."""
    works = []

    def prefetch(net):
        for layer in net.layers:
            handle = layer.unshard(async_op=True)
            works.append(handle)

    net = _model("bf16")
    ccf.compress(net, mode="always", min_bytes=0)
    losses = _train(net, rank, steps=3, before_forward=prefetch)
    bits = _local_bits(net)
    sync = _model("bf16")
    ccf.compress(sync, mode="always", min_bytes=0)
    sync_losses = _train(sync, rank, steps=3)
    sync_bits = _local_bits(sync)
    # A direct call: a real Work whose wait() finishes the decode.
    state = ccf.FSDPState(mode="always", min_bytes=0)
    state.install([])
    gather = ccf.HuffmanAllGather(state, "direct")
    n = 5000
    shard = (torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 0.02).bfloat16()
    out = torch.empty(world * n, dtype=torch.bfloat16)
    work = gather(out, shard, dist.group.WORLD, async_op=True)
    is_work = isinstance(work, dist.Work)
    work.wait()
    expect = torch.empty_like(out)
    _all_gather_single(expect, shard)
    # overlap=False: a synchronous call is done when it returns.
    state.overlap = False
    sync_out = torch.empty_like(out)
    returned = gather(sync_out, shard, dist.group.WORLD)
    return {
        "sync": returned is None and torch.equal(sync_out.view(torch.int16), expect.view(torch.int16)),
        "same": all(torch.equal(bits[n], sync_bits[n]) for n in bits) and losses == sync_losses,
        "handles": sum(h is not None for h in works),
        "is_work": is_work,
        "direct": torch.equal(out.view(torch.int16), expect.view(torch.int16)),
        "calls": state.stats()["all_gather"]["calls"],
    }


def _w_corrupt_frame(rank, world, collective):
    """Rank 1 receives a frame with a flipped byte: every rank raises CollectiveError, none hangs."""
    state = ccf.FSDPState(mode="always", min_bytes=0)
    state.install([])
    n = 3000
    data = (torch.randn(world * n, generator=torch.Generator().manual_seed(rank)) * 0.02).bfloat16()
    if rank == 0:  # every frame rank 0 sends has a flipped byte
        encode = state.codec.encode

        def corrupted(tensor, kind="gradient"):
            frame = encode(tensor, kind).clone()
            frame[frame.numel() // 2] ^= 0x5A
            return frame

        state.codec.encode = corrupted
    try:
        if collective == "all_gather":
            work = ccf.HuffmanAllGather(state, "layer")(data, data[rank * n : (rank + 1) * n].clone(), dist.group.WORLD)
            work.wait()  # (overlap: a Work even for a synchronous call)
        else:
            ccf.HuffmanReduceScatter(state, "layer")(
                torch.empty(n, dtype=torch.bfloat16), data, dist.group.WORLD, dist.ReduceOp.AVG
            )
    except collectives.CollectiveError as exc:
        return str(exc)
    return "no error"


def _w_frozen_mixed(rank, world):
    """A module with a frozen fp32 parameter beside bf16 ones: FSDP gathers bytes (uint8), sent plainly."""
    torch.manual_seed(0)
    net = _Net().to(torch.bfloat16)
    net.layers[1].register_parameter("scale", nn.Parameter(torch.full((64,), 1.25), requires_grad=False))
    net = _shard(net)
    state = ccf.compress(net, mode="always", min_bytes=0)
    losses = _train(net, rank, steps=3)
    torch.manual_seed(0)
    plain = _Net().to(torch.bfloat16)
    plain.layers[1].register_parameter("scale", nn.Parameter(torch.full((64,), 1.25), requires_grad=False))
    plain = _shard(plain)
    plain_losses = _train(plain, rank, steps=3)
    return {
        "same_full": _same_everywhere(_full_digest(net)),
        "losses": losses,
        "plain": plain_losses,
        "raw_gathers": state.stats()["all_gather"]["raw_calls"],
        "coded": state.stats()["reduce_scatter"]["calls"],
    }


def _errors_of(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _w_bad_models(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard
    from torch.nn.parallel import DistributedDataParallel

    out = {
        "plain": _errors_of(lambda: ccf.compress(nn.Linear(4, 4))),
        "not_module": _errors_of(lambda: ccf.compress("model")),
        "mode": _errors_of(lambda: ccf.compress(_model("bf16"), mode="sometimes")),
    }
    wrapped = nn.Sequential(nn.Linear(4, 4), FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu")))
    out["fsdp1"] = _errors_of(lambda: ccf.compress(wrapped))
    out["ddp"] = _errors_of(lambda: ccf.compress(DistributedDataParallel(nn.Linear(4, 4))))
    # Two parameter groups in one module: a parameter on a mesh of its own process group.
    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"), shard_mesh_dim=0)
    two = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    fully_shard(two, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p is two[1].weight else None)
    out["groups"] = _errors_of(lambda: ccf.compress(two))
    mixed = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    mixed[1].bias.data = mixed[1].bias.data.double()
    block = nn.Sequential(mixed)
    fully_shard(mixed)
    fully_shard(block)
    out["mixed"] = _errors_of(lambda: ccf.compress(block))
    return out


def _w_different_books(rank, world):
    prof = cc.WarmupProfiler(max_books=1)
    prof.observe(torch.randn(1 << 14, generator=torch.Generator().manual_seed(0)).bfloat16(), "gradient")
    built = prof.build()  # (collective: the same on every rank)
    books = cc.CodebookSet.default() if rank == 0 else built
    return _errors_of(lambda: ccf.compress(_model("bf16"), codebooks=books, mode="always"))


# mode="auto" with step times injected through each rank's clock, as in tests/test_ddp.py:
# (plain, coded) seconds before step 6 and from step 6 on. Rank 0 finds coding faster
# throughout; rank 1 finds it faster at first and much slower later: the slowest rank
# decides, and both switch together.
COSTS = {0: ((1.0, 0.5), (1.0, 0.8)), 1: ((1.0, 0.6), (0.5, 1.5))}
AUTO_KW = {"mode": "auto", "warmup_steps": 1, "probe_steps": 1, "recheck_every": 3, "min_bytes": 0}
# Step 0 is warmup; steps 1-3 probe (uncounted coded, plain, coded); the decision at step 4
# codes; steady 4-6; probe 7-9 (the later costs); the decision at step 10 switches to plain.
AUTO_ARMS = [False, True, False, True, True, True, True, True, False, True, False, False]


def _w_auto(rank, world, state_kw):
    """Train with mode="auto" and injected step times; follow the arms with an uncoded reference."""
    net = _model("bf16")
    state = ccf.compress(net, **dict(AUTO_KW, **state_kw))
    now = [0.0]

    def clock():  # read where a step begins: the step that ended cost what this rank's table says
        if state.step:
            phase = COSTS[rank % 2][0 if state.step - 1 < 6 else 1]
            now[0] += phase[1] if state.coding else phase[0]
        return now[0]

    state.switch.clock = clock
    arms, digests, bits, books = [], [], [], []

    def record(net):
        arms.append(state.coding)  # this step's mode, decided where the last backward ended
        books.append(state.stats()["books"])

    _train(
        net,
        rank,
        steps=len(AUTO_ARMS),
        before_forward=record,
        after_step=lambda net: (digests.append(_full_digest(net)), bits.append(_local_bits(net))),
    )
    d = state.stats()
    # The reference: FSDP's own reduce-scatter on the plain steps, the uncoded rank-order
    # sum on the coded ones.
    ref = _model("bf16")
    reference = _RankOrderReduceScatter()
    for m in ref.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(reference)
    ref_bits = []

    def follow(net):
        reference.plain = not arms[len(ref_bits)]

    _train(
        ref, rank, steps=len(AUTO_ARMS), before_forward=follow, after_step=lambda net: ref_bits.append(_local_bits(net))
    )
    differ = [step for step, (a, b) in enumerate(zip(bits, ref_bits)) if any(not torch.equal(a[n], b[n]) for n in a)]
    return {
        "arms": arms,
        "decision": d["decision"],
        "switches": d["switches"],
        "probes": d["probes"],
        "refreshes": d["refreshes"],
        "books": books,
        "digests": digests,
        "differ": differ,
        "calls": d["calls"],
        "raw_calls": d["raw_calls"],
        "steps": d["steps"],
        "keys": sorted(k for k in d if k in ("mode", "coding", "decision", "switches", "probes")),
    }


def _w_refresh(rank, world):
    net = _model("bf16")
    state = ccf.compress(
        net, warmup_steps=1, mode="always", min_bytes=0, drift_every=1, refresh_threshold=1e-9, refresh_steps=1
    )
    _train(net, rank)
    d = state.stats()
    return {
        "refreshes": d["refreshes"],
        "drift": d["drift"],
        "same_books": _same_everywhere(d["books"]),
        "same_full": _same_everywhere(_full_digest(net)),
    }


# ----------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "world,config,min_piece", [(2, "bf16", None), (2, "fp32-mp", 64), (2, "bf16-divide3", None), (4, "bf16", 64)]
)
def test_bit_identical_to_rank_order_reference(world, config, min_piece):
    results = dist_utils.run(_w_lossless, world, config, min_piece, timeout=180)
    for rank, r in enumerate(results):
        assert r["differ"] == [], f"rank {rank}: sharded parameters differ from the reference: {r['differ']}"
        assert r["same_full"] and r["full_equals_ref"]
        assert r["steps"] == STEPS and not r["warming_up"]
        assert r["rs_calls"] > 0 and r["ag_calls"] > 0
        if min_piece is None:  # (64-element pieces are all header)
            assert r["rs_ratio"] > 1.0 and r["ag_ratio"] > 1.0
        if r["plain_losses"] is None:
            continue
        # Coding changes the sum's order only against gloo's own reduction: losses track plain FSDP2.
        assert r["coded_losses"][: WARMUP + 1] == r["plain_losses"][: WARMUP + 1]
        for a, b in zip(r["coded_losses"], r["plain_losses"]):
            assert abs(a - b) <= 2e-2 * abs(b) + 1e-3
    assert len({tuple(r["coded_losses"]) for r in results}) == world  # rank-specific batches


@pytest.mark.slow
def test_mode_never_is_plain_fsdp2():
    for r in dist_utils.run(_w_never, 2):
        assert r["same"] and r["losses"]
        assert r["calls"] == 0 and r["raw_calls"] > 0 and r["books"] is None and r["steps"] == STEPS


@pytest.mark.slow
def test_async_all_gather_returns_work():
    for r in dist_utils.run(_w_async_unshard, 2):
        assert r["same"], "prefetching with async_op=True changed the results"
        assert r["handles"] == 3 * 3
        assert r["is_work"] and r["direct"] and r["sync"] and r["calls"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_corrupt_frame_fails_on_every_rank(collective):
    for message in dist_utils.run(_w_corrupt_frame, 2, collective):
        assert message.startswith("compressed collective failed: rank 1: "), message


@pytest.mark.slow
def test_frozen_parameters_of_another_dtype_travel_plainly():
    for r in dist_utils.run(_w_frozen_mixed, 2):
        assert r["same_full"]
        assert r["raw_gathers"] > 0 and r["coded"] > 0
        for a, b in zip(r["losses"], r["plain"]):
            assert abs(a - b) <= 2e-2 * abs(b) + 1e-3


def test_bad_models_name_the_module():
    for r in dist_utils.run(_w_bad_models, 2):
        assert r["plain"].startswith("TypeError: Linear has no FSDP2 module")
        assert r["not_module"].startswith("TypeError: model must be a torch.nn.Module")
        assert r["mode"].startswith("ConfigError: mode='sometimes'; allowed: 'auto', 'always', 'never'")
        assert r["fsdp1"].startswith("TypeError: module '1' is an FSDP1 FullyShardedDataParallel")
        assert r["ddp"].startswith("TypeError: module '<root>' is a DistributedDataParallel")
        assert r["groups"].startswith("ValueError: module '<root>' holds 2 FSDP parameter groups")
        assert r["mixed"].startswith(
            "ValueError: module '0' has trainable parameters of mixed dtypes (float32, float64)"
        )


def test_different_books_fail_on_every_rank():
    for r in dist_utils.run(_w_different_books, 2):
        assert r.startswith("AgreementError: codebooks differ across ranks"), r


@pytest.mark.parametrize(
    "world,refresh",
    [(2, False), (2, True), pytest.param(4, False, marks=pytest.mark.slow)],
    ids=["world2", "world2-with_refreshes", "world4"],
)
def test_auto_mode_switches_mid_run_on_every_rank_at_the_same_step(world, refresh):
    """The DDP hook's AutoSwitch decides for FSDP2 too: coding wins the first measurement
    and loses the second (the odd ranks' figures); every rank codes and switches at the
    same steps, the full parameters are bit-identical on every rank after every step, and
    the sharded ones equal, step by step, a reference that sums in rank order uncoded on
    the coded steps and uses FSDP's own reduce-scatter on the plain ones (on 2 ranks the
    two sums coincide; on 4, gloo's bf16 reduction rounds differently, so the reference
    checks that each step took the mode it reported). With refreshes, books are also
    swapped every other step, at the decisions' steps too."""
    state_kw = {"drift_every": 1, "refresh_threshold": 1e-12, "refresh_steps": 1} if refresh else {}
    results = dist_utils.run(_w_auto, world, state_kw, timeout=120)
    for r in results:
        assert r["arms"] == AUTO_ARMS
        assert r["differ"] == [], f"steps whose sharded parameters differ from the reference: {r['differ']}"
        assert r["digests"] == results[0]["digests"]
        assert r["switches"] == 1 and r["probes"] == 2 and r["steps"] == len(AUTO_ARMS)
        assert r["decision"] == results[0]["decision"]
        assert r["books"] == results[0]["books"]
        assert r["calls"] > 0 and r["raw_calls"] > 0
        assert r["keys"] == ["coding", "decision", "mode", "probes", "switches"]
    d = results[0]["decision"]
    assert d["coded"] is False and d["step"] == 10
    assert d["plain_ms"] == pytest.approx(1000.0) and d["coded_ms"] == pytest.approx(1500.0)
    assert d["per_rank_ms"] == [pytest.approx([1000.0, 800.0]), pytest.approx([500.0, 1500.0])] * (world // 2)
    assert d["reason"] == (
        "switched: plain reduce-scatter/all-gather is faster here: 1000 vs 1500 ms/step "
        "compressed; re-checking every 3 steps"
    )
    if refresh:
        assert results[0]["refreshes"] >= 3
        assert len(set(results[0]["books"])) >= 3


@pytest.mark.slow
def test_drift_refresh_swaps_books_on_every_rank():
    for r in dist_utils.run(_w_refresh, 2):
        assert r["refreshes"] >= 1 and r["drift"] is not None and r["drift"] > 0
        assert r["same_books"] and r["same_full"]


@pytest.mark.unit
def test_state_validates_options():
    with pytest.raises(cc.ConfigError, match="warmup_steps=-1; allowed: an integer >= 0"):
        ccf.FSDPState(warmup_steps=-1)
    with pytest.raises(ValueError, match="not both"):
        ccf.FSDPState(codebooks=cc.CodebookSet.default(), warmup_steps=3)
    with pytest.raises(ValueError, match="needs drift_every"):
        ccf.FSDPState(refresh_threshold=0.1)
    with pytest.raises(TypeError, match="codebooks must be a CodebookSet"):
        ccf.FSDPState(codebooks=42)


def _w_demo(rank, world):
    from comm_codec.tools.demo import TrainConfig
    from comm_codec.tools.fsdp_demo import train_fsdp

    return train_fsdp(TrainConfig(steps=4, warmup_steps=2))


@pytest.mark.slow
def test_demo_trains_and_reports():
    results = dist_utils.run(_w_demo, 2, timeout=120)
    for s in results:
        assert s["identical"] and s["steps"] == 4 and s["warmup_steps"] == 2
        assert s["reduce_scatter_ratio"] > 1.0 and s["all_gather_ratio"] > 1.0
        assert s["losses"][-1] < s["losses"][0]
    assert results[0]["param_digest"] == results[1]["param_digest"]


@pytest.mark.unit
def test_demo_command_rejects_bad_options(capsys):
    from comm_codec.tools.fsdp_demo import main

    assert main(["--world-size", "1"]) == 2
    assert "--world-size must be >= 2" in capsys.readouterr().err
    assert main(["--steps", "3", "--warmup-steps", "3"]) == 2
    assert "--warmup-steps must be in 1..2" in capsys.readouterr().err


@pytest.mark.cli
@pytest.mark.dist
@pytest.mark.slow
def test_comm_codec_demo_fsdp_runs_and_prints_the_bytes_saved():
    """The README's command, as a user types it: two spawned ranks, FSDP2, a few steps."""
    import re

    from helpers import run_cli

    done = run_cli("demo", "--fsdp", "--steps", "3", "--warmup-steps", "1", timeout=240)
    assert done.returncode == 0, done.stderr
    assert "sharded with FSDP2 over 2 processes" in done.stdout
    saved = re.search(r"^saved\s+(\d+\.\d+) MB$", done.stdout, re.M)
    assert saved is not None and float(saved.group(1)) > 0, done.stdout
    assert re.search(r"^parameters\s+bit-identical full parameters on all 2 ranks", done.stdout, re.M), done.stdout
    # Bad options: one line, status 2, nothing spawned.
    bad = run_cli("demo", "--fsdp", "--world-size", "1", timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "comm-codec demo --fsdp: error: --world-size must be >= 2 (a data-parallel run needs peers), got 1"
    ]


@pytest.mark.unit
def test_codec_threads_default_to_the_ranks_share_of_the_cores(monkeypatch):
    """threads=None must not give every rank all of numba's threads (they share the cores)."""
    from comm_codec.comm.engine import default_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ccf.FSDPState().codec.threads == default_threads(2)
    assert ccf.FSDPState(threads=1).codec.threads == 1


# The user's init_process_group(timeout=...), in seconds, for the stalled-rank test.
STALL_TIMEOUT = 5.0


def _w_stalled_rank(rank, world, sleep_s):
    """Rank 1 stalls once coding runs; rank 0's next step must fail within the user's timeout."""
    import time

    net = _model("bf16")
    ccf.compress(net, mode="always", min_bytes=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(3):
        if step == 2 and rank == 1:
            time.sleep(sleep_s)
        t0 = time.monotonic()
        try:
            x, y = _batch(rank, step, torch.bfloat16)
            F.mse_loss(net(x).float(), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        except Exception as exc:  # what FSDP2 lets through from the coded collective
            return {"step": step, "seconds": time.monotonic() - t0, "message": f"{type(exc).__name__}: {exc}"}
    return {"step": None}


@pytest.mark.slow
def test_a_stalled_rank_fails_the_other_within_the_users_timeout():
    """Every group comm_codec.fsdp makes takes the user's timeout (torch gives new groups 30 minutes)."""
    outcomes = dist_utils.run_outcomes(
        _w_stalled_rank, 2, 3 * STALL_TIMEOUT, timeout=60 + 6 * STALL_TIMEOUT, pg_timeout=STALL_TIMEOUT
    )
    assert outcomes[0]["status"] == "ok", outcomes[0]
    waited = outcomes[0]["value"]
    assert waited["step"] == 2, f"rank 0 did not fail at the stalled step: {waited}"
    assert waited["seconds"] < 2 * STALL_TIMEOUT + 2, waited  # the user's timeout, not the peer's 3x-longer stall


def _w_stats_by_mode(rank, world):
    out = {}
    for mode in ("never", "always"):
        net = _model("bf16")
        state = ccf.compress(net, mode=mode, warmup_steps=0 if mode == "never" else 1, min_bytes=0)
        _train(net, rank, steps=3)
        out[mode] = state.stats()
    return out


def test_stats_count_every_call_plain_and_coded():
    """FSDP2's own collectives count at ratio 1: a never run's bytes_in equals a coded run's."""
    for r in dist_utils.run(_w_stats_by_mode, 2):
        never, coded = r["never"], r["always"]
        assert never["bytes_in"] == coded["bytes_in"] > 0
        assert never["bytes_out"] == never["bytes_in"] and never["ratio"] == 1.0 and never["calls"] == 0
        assert coded["raw_calls"] > 0 and coded["calls"] > 0  # step 0 warms up plainly, and is counted
        assert 1.0 < coded["ratio"] < coded["coded_ratio"]
        for part in ("reduce_scatter", "all_gather"):
            assert never[part]["bytes_in"] == coded[part]["bytes_in"] > 0
