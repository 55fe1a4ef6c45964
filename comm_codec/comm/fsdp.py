"""FSDP2 collectives with Huffman-coded frames: gradients reduce-scattered, weights all-gathered.

Usage::

    from torch.distributed.fsdp import fully_shard
    import comm_codec.fsdp
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = comm_codec.fsdp.register(model, warmup_steps=5)
    ...                         # train as usual
    state.stats()               # bytes_in, bytes_out, ratio, ...; per collective under
                                # "reduce_scatter" and "all_gather"

torch 2.13 lets a user replace the two collectives of an FSDP2 module
(``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``, interfaces in
``torch.distributed.fsdp._fully_shard._fsdp_api``). :func:`compress` installs on every
FSDP2 module of a model:

* :class:`HuffmanReduceScatter` -- phase 1 of :mod:`comm_codec.collectives`' two-phase
  all-reduce. FSDP hands it one flat buffer of W equal rows (row r: rank r's shard of
  every gradient of the module, padded by FSDP to equal sizes) and a reduce op: AVG (the
  default for fp32 and bf16), SUM (fp16, which FSDP divides before and after itself) or
  PREMUL_SUM (``set_gradient_divide_factor``). Each rank receives the other ranks' coded
  row, sums all W rows **in rank order in float32**, divides by W for AVG and rounds to
  the gradient dtype once: exactly an uncoded rank-order sum, whatever the books. With
  PREMUL_SUM the factor is applied to the rounded sum (a second rounding for bf16/fp16).
* :class:`HuffmanAllGather` -- every rank's shard of the parameters (the ``param_dtype``
  copy under a MixedPrecisionPolicy), coded with "weight" books; every rank decodes the
  owners' exact bits.

Books, warmup, mode, drift and refresh, threads, statistics and every cross-rank check
are the :class:`~comm_codec.comm.engine.CodingEngine`'s, which :class:`FSDPState` is, as
the DDP hook's :class:`~comm_codec.ddp.HuffmanState` is: the first ``warmup_steps``
backward passes run FSDP's own collectives while the profiler observes the gradients
("gradient") and the all-gathered shards ("weight"); ``mode`` "auto" times whole steps
(step s+1 begins where step s's backward pass ends). A step is one backward pass that
reduce-scatters.

Threads: FSDP calls the reduce-scatter synchronously, and the all-gather synchronously
or, when a module is unsharded with ``async_op=True``, expecting a ``Work``. Every
collective of a state, coded or plain, runs on one worker thread in call order, on its
own twin of each process group: an all-gather in flight can never interleave differently
with a reduce-scatter on two ranks, and FSDP's own use of its groups never meets ours.
All-gathers return a :class:`torch.distributed.Work` (``overlap=True``, the default)
whose ``wait()`` returns once the decode is done; FSDP waits on it before it copies the
parameters out, so the all-gather it prefetches in backward overlaps the current layer's
compute on CPU, as FSDP's streams overlap them on a GPU. The coded exchanges are
:func:`comm_codec.collectives.reduce_scatter` and :func:`~comm_codec.collectives.all_gather`
on FSDP's buffers in place: large shards go in up to four pipelined pieces, with the
all-reduce's stages, workspace and error flags. CUDA tensors take the same path as in
:mod:`comm_codec.collectives` (NCCL; the worker waits on the caller's stream and
synchronizes before the call counts as done).
"""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import AgreementError
from . import agreement, collectives
from .engine import CodingEngine

try:  # FSDP2's custom-collective seams: torch >= 2.8 (tested with 2.13)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch
    FSDPModule = None
    AllGather = ReduceScatter = object

__all__ = ["FSDPState", "HuffmanReduceScatter", "HuffmanAllGather", "compress", "register"]

log = logging.getLogger(__name__)

_RedOp = dist.ReduceOp.RedOpType
# FSDP's own collectives (torch 2.13 names them *_single; older ones *_tensor).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FSDPState(CodingEngine):
    """The coding engine configured for FSDP2's reduce-scatter and all-gather of one model.

    Made by :func:`compress`; its keyword arguments are these.

    Args:
        process_group: the group books are built and checked over (None: the world). It
            must hold every rank of every FSDP module's groups.
        overlap: return a ``Work`` from every all-gather, also those FSDP issues with
            ``async_op=False``. FSDP waits on it before it copies the gathered
            parameters out, so the all-gather FSDP prefetches in backward runs on the
            worker while the current layer computes, as it runs on its own stream on a
            GPU. False: such calls return when done.
        config: a :class:`~comm_codec.comm.config.CommConfig` holding every setting
            (keywords given beside it replace its fields).
        writer: optional TensorBoard ``SummaryWriter`` (scalars under comm_codec/).
        **options: the :class:`~comm_codec.comm.config.CommConfig` settings, the same for
            every adapter (``codebooks``, ``warmup_steps``, ``mode``, ``min_bytes``:
            per-rank shard bytes below which a collective runs plainly, ...); ``cast``
            is refused (weights must arrive exact).

    Raises:
        ConfigError: a bad setting, or a cast; the message names the key, the value and
            what is allowed.
        CodebookError: ``codebooks`` names a missing or malformed file.
        TypeError: codebooks of the wrong type, or an unknown option.
    """

    __slots__ = ("overlap", "modules", "_twins", "_saved", "_queued")

    def __init__(self, process_group=None, overlap: bool = True, *, config=None, writer=None, **options):
        super().__init__(
            process_group,
            config,
            writer=writer,
            name="comm_codec.fsdp",
            plain_name="plain reduce-scatter/all-gather",
            collectives=("reduce_scatter", "all_gather"),
            allow_cast=False,
            **options,
        )
        self.overlap = bool(overlap)
        self.modules: list[str] = []
        self._twins: dict[tuple, object] = {}
        self._saved: list = []
        self._queued = False

    # -- public -------------------------------------------------------------------------
    def detach(self) -> None:
        """Put back on every module the collectives it had before :func:`register` (:meth:`reattach` undoes it)."""
        for _, group, reduce_scatter, all_gather in self._saved:
            group._reduce_scatter_comm = reduce_scatter
            group._all_gather_comm = all_gather

    def reattach(self) -> None:
        """Install this state's coded collectives again after :meth:`detach`."""
        for name, group, _, _ in self._saved:
            group._reduce_scatter_comm = HuffmanReduceScatter(self, name)
            group._all_gather_comm = HuffmanAllGather(self, name)

    attach = reattach  # the earlier name

    def install(self, modules: list[tuple[str, nn.Module]]) -> None:
        """Make the twin groups and set the coded collectives on every module (collective).

        Args:
            modules: (name, FSDP2 module) pairs, as :func:`compress` finds them.
        """
        pgs = []
        for _, module in modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                pgs += [group._reduce_scatter_process_group, group._all_gather_process_group]
        mine = sorted(
            {tuple(dist.get_process_group_ranks(pg)) for pg in pgs}
            | {tuple(dist.get_process_group_ranks(self.process_group or dist.group.WORLD))}
        )
        # Creating a group is collective over the world: every rank creates the union of
        # the groups any rank uses (HSDP: each rank sees only its own shard group), sorted.
        world = dist.group.WORLD
        seen = agreement.gather_texts(json.dumps(mine), world, agreement.collective_device(world))
        union = set()
        for rank, text in enumerate(seen):
            try:
                union |= {
                    tuple(int(r) for r in ranks)
                    for ranks in agreement.peer_json(
                        text, f"comm_codec.fsdp: rank {rank} sent a group list that is not JSON"
                    )
                }
            except (ValueError, TypeError):
                raise AgreementError(f"comm_codec.fsdp: rank {rank} sent a group list that is not JSON") from None
        for ranks in sorted(union):
            group = agreement.twin_group(world, ranks)
            if dist.get_rank() in ranks:
                self._twins[ranks] = group
        self.use_group(self._twins[tuple(dist.get_process_group_ranks(self.process_group or world))])
        for name, module in modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                self._saved.append((name, group, group._reduce_scatter_comm, group._all_gather_comm))
            try:
                module.set_custom_reduce_scatter(HuffmanReduceScatter(self, name))
                module.set_custom_all_gather(HuffmanAllGather(self, name))
            except ValueError as exc:
                raise ValueError(f"module {name!r}: FSDP refused a custom collective: {exc}") from exc
            self.modules.append(name)
        self.begin_step()  # the settings check; step 0 codes from the start where books are given
        log.info(
            "comm_codec.fsdp: %d FSDP modules, mode=%s, warmup_steps=%d, books=%s",
            len(modules),
            self.mode,
            self.warmup_steps,
            "online" if self.codebooks is None else self.codebooks.digest[:12],
        )

    # -- running collectives on the worker --------------------------------------------------------
    def twin(self, group):
        """Return the state's own group over the ranks of FSDP's ``group``."""
        ranks = tuple(dist.get_process_group_ranks(group))
        twin = self._twins.get(ranks)
        if twin is None:
            raise RuntimeError(
                f"comm_codec.fsdp: FSDP called a collective on ranks {list(ranks)}, a group "
                "register() did not see; call register() after every fully_shard()"
            )
        return twin

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group, op, name: str) -> None:
        """On the worker: FSDP's reduce-scatter of ``inp`` (W rows) into ``out``, coded where it pays."""
        world, n = group.size(), out.numel()
        _check_sizes(name, "reduce-scatter", inp, out, world, n)
        if n == 0:
            return  # nothing to reduce (and gloo rejects zero-element collectives)
        average, factor = _division(op, name)
        twin = self.twin(group)

        def coded(stats):
            collectives.reduce_scatter(
                out,
                list(inp.view(world, n)),
                self.codec,
                twin,
                average=average,
                kind="gradient",
                stats=stats,
                workspace=self.workspace,
            )
            if factor is not None:
                out.mul_(factor)

        self.dispatch(
            "reduce_scatter",
            inp,
            twin,
            numel_per_rank=n,
            kind="gradient",
            coded=coded,
            plain=lambda: _plain_reduce_scatter(out, inp, twin, op, factor),
        )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, name: str) -> None:
        """On the worker: FSDP's all-gather of every rank's ``inp`` into ``out``, coded where it pays."""
        world, n = group.size(), inp.numel()
        _check_sizes(name, "all-gather", inp, out, world, n)
        if n == 0:
            return
        twin = self.twin(group)
        # (FSDP gathers a module whose parameters mix dtypes as uint8 bytes: sent plainly)
        self.dispatch(
            "all_gather",
            inp,
            twin,
            numel_per_rank=n,
            kind="weight",
            coded=lambda stats: collectives.all_gather(
                list(out.view(world, n)), inp, self.codec, twin, kind="weight", stats=stats, workspace=self.workspace
            ),
            plain=lambda: _all_gather_single(out, inp, group=twin),
        )

    # -- steps ------------------------------------------------------------------------------------
    def arm_step_end(self) -> None:
        """Have the end of this backward pass counted as a step (once per backward)."""
        if self._queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._step_done)
        except RuntimeError:  # a reduce-scatter outside a backward pass: no step to count
            return
        self._queued = True

    def _step_done(self) -> None:
        self._queued = False
        self.step_on_worker(end=True, begin=True)  # after the step's last collective


class _Coded:
    """What both coded collectives hold: the state and the module's name; plain buffers.

    Args:
        state: the :class:`FSDPState` (books, mode, statistics, worker thread).
        name: the module's name, for error messages.
    """

    def __init__(self, state: FSDPState, name: str = "<module>"):
        self.state = state
        self.name = name

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Allocate a buffer for FSDP (plain memory: the coded path needs no special pool)."""
        return torch.empty(*size, dtype=dtype, device=device)


class HuffmanReduceScatter(_Coded, ReduceScatter):
    """FSDP2's gradient reduce-scatter with Huffman-coded shards (lossless, rank-order sum).

    Args:
        state: the :class:`FSDPState`.
        name: the module's name, for error messages.
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        """Reduce row r of ``input_tensor`` over the group into rank r's ``output_tensor``.

        Args:
            output_tensor: this rank's reduced shard (``input_tensor.numel() / W`` elements).
            input_tensor: W equal rows, row r destined for rank r.
            group: FSDP's process group (the collective runs on the state's twin of it).
            op: AVG, SUM or PREMUL_SUM, as FSDP passes it.
            async_op: return a ``Work`` instead of waiting.

        Returns:
            A ``torch.distributed.Work`` when ``async_op``, else None (done).

        Raises:
            CollectiveError: on every rank, if a frame failed to decode on any rank.
            ValueError: an op that is not a sum, or mismatched sizes (naming the module).
        """
        self.state.arm_step_end()
        state, name = self.state, self.name
        return state.call(
            lambda: state.reduce_scatter(output_tensor, input_tensor, group, op, name), input_tensor, async_op
        )


class HuffmanAllGather(_Coded, AllGather):
    """FSDP2's parameter all-gather with Huffman-coded shards (every rank gets the owners' bits).

    Args:
        state: the :class:`FSDPState`.
        name: the module's name, for error messages.
    """

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        """Gather every rank's ``input_tensor`` into ``output_tensor`` (W rows, rank order).

        Args:
            output_tensor: W x n elements; row r receives rank r's shard.
            input_tensor: this rank's n elements (FSDP passes its row of the output).
            group: FSDP's process group.
            async_op: return a ``Work`` whose ``wait()`` completes the decode.

        Returns:
            A ``torch.distributed.Work`` when ``async_op`` or the state's ``overlap``,
            else None (done).

        Raises:
            CollectiveError: on every rank, if a frame failed to decode on any rank.
        """
        state, name = self.state, self.name
        return state.call(
            lambda: state.all_gather(output_tensor, input_tensor, group, name), input_tensor, async_op or state.overlap
        )


def register(
    model: nn.Module, *, process_group=None, config=None, overlap: bool = True, writer=None, **options
) -> FSDPState:
    """Code the reduce-scatter and all-gather of every FSDP2 module of a model; return the state.

    Call it on every rank after ``fully_shard`` has been applied (to the layers and the
    root) and before training. It is collective: the ranks create twin process groups.

    Args:
        model: the model, with ``fully_shard`` applied.
        process_group: the group books are built and checked over (None: the world).
        config: a :class:`~comm_codec.comm.config.CommConfig` (keywords beside it replace
            its fields).
        overlap: see :class:`FSDPState` (FSDP2 only).
        writer: optional TensorBoard ``SummaryWriter``.
        **options: :class:`~comm_codec.comm.config.CommConfig` settings (warmup_steps,
            mode, codebooks, min_bytes, threads, log_every, drift_every, ...), the same
            as ``HuffmanState``'s.

    Returns:
        The :class:`FSDPState`; ``state.stats()`` reports the traffic, ``state.detach()``
        puts FSDP's own collectives back.

    Raises:
        TypeError: not a module, no FSDP2 module in it, an FSDP1 or DDP wrapper inside,
            an unknown option.
        ValueError: a module FSDP2 cannot give one custom collective (several parameter
            groups), trainable parameters of mixed dtypes in one module.
        ConfigError, CodebookError: bad settings.
        AgreementError: ranks hold different books or settings.
        RuntimeError: torch.distributed is not initialized.
    """
    if FSDPModule is None:
        raise RuntimeError(
            f"comm_codec.fsdp needs torch >= 2.8 (FSDP2 custom collectives); this is {torch.__version__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call init_process_group before register()")
    modules = _fsdp_modules(model)
    state = FSDPState(process_group, overlap, config=config, writer=writer, **options)
    state.start_precompile({p.dtype for p in model.parameters()})
    state.install(modules)
    return state


compress = register  # the design's first name for it


def _fsdp_modules(model) -> list[tuple[str, nn.Module]]:
    """Return (name, module) for every FSDP2 module of the model; reject what cannot be coded."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module with fully_shard applied, got {type(model).__name__}")
    found = []
    for name, module in model.named_modules():
        label = name or "<root>"
        if isinstance(module, FullyShardedDataParallel):
            raise TypeError(
                f"module {label!r} is an FSDP1 FullyShardedDataParallel; comm_codec.fsdp codes FSDP2 "
                "(torch.distributed.fsdp.fully_shard) collectives only: shard it with fully_shard"
            )
        if isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"module {label!r} is a DistributedDataParallel; for DDP use "
                "ddp_model.register_comm_hook(comm_codec.ddp.HuffmanState(...), huffman_hook)"
            )
        if isinstance(module, FSDPModule):
            found.append((label, module))
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no FSDP2 module: apply torch.distributed.fsdp.fully_shard "
            "to its layers and to the model itself, then call compress()"
        )
    for label, module in found:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(
                f"module {label!r} holds {len(groups)} FSDP parameter groups (shard_placement_fn "
                "with several meshes); FSDP2 takes one custom collective per module: apply "
                "fully_shard to the parameters of each mesh in a module of their own"
            )
        for group in groups:
            dtypes = {fp.sharded_param.dtype for fp in group.fsdp_params if fp.sharded_param.requires_grad}
            if len(dtypes) > 1:
                names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
                raise ValueError(
                    f"module {label!r} has trainable parameters of mixed dtypes ({names}); FSDP2 "
                    "reduce-scatters one dtype per module: cast them to one dtype, or shard the odd "
                    "ones in a module of their own"
                )
    return found


def _check_sizes(name: str, what: str, inp: torch.Tensor, out: torch.Tensor, world: int, n: int) -> None:
    """Refuse buffers FSDP could not have meant: W x n elements on one side, n on the other."""
    full = inp if what == "reduce-scatter" else out
    if full.numel() != world * n or inp.dtype != out.dtype:
        raise ValueError(
            f"module {name!r}: {what} of {inp.numel()} {inp.dtype} elements into {out.numel()} "
            f"{out.dtype}, expected {world} x {n} of one dtype"
        )


def _division(op, name: str) -> tuple[bool, float | None]:
    """Return (average over the group?, factor to multiply the sum by) for FSDP's op."""
    kind = getattr(op, "op", op)  # PREMUL_SUM comes as a ReduceOp wrapping the type and factor
    if kind == _RedOp.AVG:
        return True, None
    if kind == _RedOp.SUM:
        return False, None
    if kind == _RedOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = float(factor)
        if not isinstance(factor, float):
            raise ValueError(f"module {name!r}: PREMUL_SUM without a scalar factor ({factor!r})")
        return False, factor
    raise ValueError(
        f"module {name!r}: FSDP asked for a {kind} reduce-scatter; comm_codec reduces sums only (AVG, SUM, PREMUL_SUM)"
    )


def _plain_reduce_scatter(out, inp, group, op, factor) -> None:
    """FSDP's own reduce-scatter; gloo has no PREMUL_SUM, so there the factor follows the sum."""
    if factor is not None and "gloo" in str(dist.get_backend(group)).lower():
        _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group)
        out.mul_(factor)
    else:
        _reduce_scatter_single(out, inp, op=op, group=group)
