"""FSDP2 collectives with Huffman-coded frames: gradients reduce-scattered, weights all-gathered.

Usage::

    from torch.distributed.fsdp import fully_shard
    import comm_codec.fsdp
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = comm_codec.fsdp.compress(model, warmup_steps=5)
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

The rest follows :class:`comm_codec.ddp.HuffmanState`: the first ``warmup_steps``
backward passes run FSDP's own collectives while a :class:`WarmupProfiler` observes the
gradients ("gradient") and the all-gathered shards ("weight"); then every rank builds the
books from statistics summed over all ranks (identical by construction, checked by
digest). ``mode`` is "always" (code every collective large enough to pay), "never"
(FSDP's own collectives) or "auto": the DDP hook's :class:`~comm_codec.comm.autoswitch.AutoSwitch`,
which times plain and coded steps alternating, agrees on the slowest rank's medians and
keeps the faster mode, with hysteresis, re-checking every ``recheck_every`` steps; step
s+1 begins where step s's backward pass ends. ``drift_every`` / ``refresh_threshold``
measure and refresh the books with the DDP hook's :class:`~comm_codec.comm.refresh.BookRefresh`.
A step is one backward pass that reduce-scatters.

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
synchronizes before the call counts as done) -- not yet run on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .autoswitch import AutoSwitch, check_mode
from ..core.codebooks import CodebookSet
from ..core.codec import Codec
from .ddp import default_threads
from ..books.profiler import WarmupProfiler, check_same_books
from .refresh import BookRefresh
from .stats import CommStats, state_stats

try:  # FSDP2's custom-collective seams: torch >= 2.8 (tested with 2.13)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch
    FSDPModule = None
    AllGather = ReduceScatter = object

__all__ = ["FSDPState", "HuffmanReduceScatter", "HuffmanAllGather", "compress"]

log = logging.getLogger(__name__)

_CODED = (torch.float32, torch.bfloat16, torch.float16)
_RedOp = dist.ReduceOp.RedOpType
# FSDP's own collectives (torch 2.13 names them *_single; older ones *_tensor).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FSDPState:
    """Books, warmup, mode and statistics shared by the coded collectives of one model.

    Made by :func:`compress`; the arguments below are its keyword arguments.

    Args:
        process_group: the group books are built and checked over (None: the world). It
            must hold every rank of every FSDP module's groups.
        codebooks: a :class:`CodebookSet`, a path to a saved one, or None: the shipped
            defaults, or books built online when ``warmup_steps`` > 0.
        warmup_steps: backward passes run with FSDP's own collectives while the books are
            profiled; 0 codes from the start (with ``codebooks`` or the defaults).
        mode: "auto" (default): code only where it measures faster, as the DDP hook's
            mode "auto"; "always"; "never" (FSDP's own collectives, nothing profiled).
        min_bytes: collectives whose per-rank shard is smaller than this run plainly
            (their frames' headers would cost more than coding saves).
        threads: numba threads for the codec (None: the rank's share of the cores, as
            :func:`comm_codec.ddp.default_threads`, with the ranks on this node taken
            from ``LOCAL_WORLD_SIZE`` (torchrun sets it) or else the group's size).
        log_every: log a traffic line every this many steps on rank 0 (0: never).
        drift_every: every this many steps, measure on the step's first coded
            reduce-scatter how much the books lose against optimal codes
            (``stats()["drift"]``); 0 = off.
        refresh_threshold: when the measured loss (largest over ranks) exceeds this
            fraction, profile ``refresh_steps`` more steps (still coding) and swap in
            rebuilt books on every rank at the same step; None = never.
        refresh_steps: steps profiled for a refresh.
        recheck_every: in auto mode, steps between two measurements of both modes.
        probe_steps: in auto mode, steps timed per mode in a measurement.
        hysteresis: in auto mode, the fraction by which the other mode must be faster
            for the state to switch to it.
        probe_every: the former name of ``recheck_every`` (kept as an alias).
        overlap: return a ``Work`` from every all-gather, also those FSDP issues with
            ``async_op=False``. FSDP waits on it before it copies the gathered
            parameters out (torch 2.13), so the all-gather FSDP prefetches in backward runs
            on the worker while the current layer computes, as it runs on its own stream
            on a GPU. False: such calls return when done.

    Raises:
        ValueError: a bad mode, negative counts, both codebooks and warmup given, a
            refresh threshold without drift measurement.
        TypeError: codebooks of the wrong type.
    """

    __slots__ = (
        # what users tune
        "process_group", "warmup_steps", "mode", "min_bytes", "threads", "log_every", "overlap",
        # internal state
        "codebooks", "codec", "profiler", "step", "switch", "refresh", "coding", "modules", "_drift_sample",
        "_twins", "_saved", "_executor", "_pid", "_queued", "_has_book", "_workspace",
        # statistics
        "reduce_stats", "gather_stats",
    )

    def __init__(self, process_group=None, codebooks=None, warmup_steps: int = 0, mode: str = "auto",
                 min_bytes: int = 4096, threads: int | None = None, log_every: int = 50, drift_every: int = 0,
                 refresh_threshold: float | None = None, refresh_steps: int = 3, recheck_every: int = 200,
                 probe_steps: int = 4, hysteresis: float = 0.05, probe_every: int | None = None,
                 overlap: bool = True):
        check_mode(mode)
        for name, value in (("warmup_steps", warmup_steps), ("min_bytes", min_bytes), ("log_every", log_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if codebooks is not None and warmup_steps:
            raise ValueError("give either codebooks (fixed books) or warmup_steps > 0 (books built online), not both")
        self.refresh = BookRefresh(drift_every, refresh_threshold, refresh_steps)
        self.switch = AutoSwitch(mode, probe_steps=probe_steps,
                                 recheck_every=recheck_every if probe_every is None else probe_every,
                                 hysteresis=hysteresis, plain_name="plain reduce-scatter/all-gather")
        if isinstance(codebooks, (str, os.PathLike)):
            codebooks = CodebookSet.load(codebooks)
        if codebooks is not None and not isinstance(codebooks, CodebookSet):
            raise TypeError(f"codebooks must be a CodebookSet, a path or None, got {type(codebooks).__name__}")
        self.process_group = process_group
        self.warmup_steps = warmup_steps if mode != "never" else 0
        self.mode = mode
        self.min_bytes = min_bytes
        self.threads = threads
        self.log_every = log_every
        self.overlap = bool(overlap)
        if mode == "never":
            self.codebooks = None
        else:
            self.codebooks = codebooks if codebooks is not None or warmup_steps else CodebookSet.default()
        self.codec = Codec(self.codebooks, threads=self._codec_threads()) if self.codebooks is not None else None
        self.profiler = WarmupProfiler() if self.warmup_steps else None
        self.step = 0
        self.coding = False  # whether the current step codes (decided at its start)
        self.modules: list[str] = []
        self._drift_sample = None
        self._twins: dict[tuple, object] = {}
        self._saved: list = []
        self._executor = None
        self._pid = None
        self._queued = False
        self._has_book: dict[tuple, bool] = {}
        self._workspace = collectives.Workspace()  # the worker's scratch buffers
        self.reduce_stats = CommStats()
        self.gather_stats = CommStats()

    # -- public -------------------------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        """True while the books are still being profiled."""
        return self.codec is None and self.mode != "never"

    def stats(self) -> dict:
        """Return traffic statistics: the DDP hook's keys, summed over both collectives.

        Returns:
            A dict with bytes_in, bytes_out, ratio, bytes_saved, encode/decode/comm
            seconds, calls, raw_calls, steps, warming_up, books, drift, refreshes; the
            DDP hook's decision keys: mode, coding (whether the current step codes),
            decision, switches, probes (:meth:`AutoSwitch.stats`); and the traffic
            counters per collective under "reduce_scatter" and "all_gather".
        """
        parts = {"reduce_scatter": self.reduce_stats.as_dict(), "all_gather": self.gather_stats.as_dict()}
        d = {k: v + parts["all_gather"][k] for k, v in parts["reduce_scatter"].items()
             if k not in ("ratio", "bytes_saved")}
        d["ratio"] = d["bytes_in"] / d["bytes_out"] if d["bytes_out"] else 1.0
        d["bytes_saved"] = d["bytes_in"] - d["bytes_out"]
        d["steps"] = self.step
        d.update(parts)
        d.update(state_stats(warming_up=self.warming_up, codebooks=self.codebooks, refresh=self.refresh,
                             switch=self.switch, coding=self.coding))
        return d

    def reset_stats(self) -> None:
        """Zero the traffic counters (the step count and the books stay)."""
        self.reduce_stats.reset()
        self.gather_stats.reset()

    def detach(self) -> None:
        """Put back on every module the collectives it had before :func:`compress`."""
        for _, group, reduce_scatter, all_gather in self._saved:
            group._reduce_scatter_comm = reduce_scatter
            group._all_gather_comm = all_gather

    def attach(self) -> None:
        """Install this state's coded collectives again after :meth:`detach`."""
        for name, group, _, _ in self._saved:
            group._reduce_scatter_comm = HuffmanReduceScatter(self, name)
            group._all_gather_comm = HuffmanAllGather(self, name)

    # -- installing -----------------------------------------------------------------------
    def _install(self, modules: list[tuple[str, nn.Module]]) -> None:
        """Make the twin groups (collectively) and set the coded collectives on every module."""
        pgs = []
        for _, module in modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                pgs += [group._reduce_scatter_process_group, group._all_gather_process_group]
        mine = sorted({tuple(dist.get_process_group_ranks(pg)) for pg in pgs}
                      | {tuple(dist.get_process_group_ranks(self.process_group or dist.group.WORLD))})
        # Creating a group is collective over the world: every rank creates the union of
        # the groups any rank uses (HSDP: each rank sees only its own shard group), sorted.
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        for ranks in sorted({tuple(r) for ranks in seen for r in ranks}):
            group = dist.new_group(ranks=list(ranks))
            if dist.get_rank() in ranks:
                self._twins[ranks] = group
        for name, module in modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                self._saved.append((name, group, group._reduce_scatter_comm, group._all_gather_comm))
            try:
                module.set_custom_reduce_scatter(HuffmanReduceScatter(self, name))
                module.set_custom_all_gather(HuffmanAllGather(self, name))
            except ValueError as exc:
                raise ValueError(f"module {name!r}: FSDP refused a custom collective: {exc}") from exc
            self.modules.append(name)
        if self.codec is not None:
            check_same_books(self.codebooks, self._group)
            self._begin_step()  # step 0 codes from the start (books given, no warmup)
        log.info("comm_codec.fsdp: %d FSDP modules, mode=%s, warmup_steps=%d, books=%s", len(modules), self.mode,
                 self.warmup_steps, "online" if self.codebooks is None else self.codebooks.digest[:12])

    @property
    def _group(self):
        return self._twins[tuple(dist.get_process_group_ranks(self.process_group or dist.group.WORLD))]

    def _twin(self, group):
        ranks = tuple(dist.get_process_group_ranks(group))
        twin = self._twins.get(ranks)
        if twin is None:
            raise RuntimeError(f"comm_codec.fsdp: FSDP called a collective on ranks {list(ranks)}, a group "
                               "compress() did not see; call compress() after every fully_shard()")
        return twin

    # -- running collectives on the worker --------------------------------------------------------
    def _submit(self, fn) -> concurrent.futures.Future:
        if self._executor is None or self._pid != os.getpid():
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="comm_codec_fsdp")
            self._pid = os.getpid()
        return self._executor.submit(fn)

    def _call(self, fn, tensor: torch.Tensor, async_op: bool):
        """Run a collective on the worker; return a Work when async, else wait for it."""
        ready = None
        if tensor.is_cuda:
            # The input may still be being written on the caller's (FSDP's) stream.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        future = self._submit(fn if ready is None else (lambda: collectives.on_cuda_worker(tensor.device, ready, fn)))
        if async_op:
            return _FutureWork(future)
        future.result()
        return None

    def _codes(self, tensor: torch.Tensor, shard_numel: int, kind: str) -> bool:
        """Whether this collective is coded: books ready, this step's arm, a dtype and size that pay."""
        if not self.coding or self.codec is None or tensor.dtype not in _CODED:
            return False
        if tensor.device.type not in ("cpu", "cuda") or shard_numel * tensor.element_size() < self.min_bytes:
            return False
        key = (kind, tensor.dtype)
        if key not in self._has_book:
            try:
                self.codebooks.group(kind, tensor.dtype, 0)
                self._has_book[key] = True
            except ValueError:  # books profiled on other dtypes: this one travels plainly
                self._has_book[key] = False
        return self._has_book[key]

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group, op, name: str) -> None:
        world, n = group.size(), out.numel()
        _check_sizes(name, "reduce-scatter", inp, out, world, n)
        if n == 0:
            return  # nothing to reduce (and gloo rejects zero-element collectives)
        average, factor = _division(op, name)
        twin = self._twin(group)
        if self.profiler is not None:
            self.profiler.observe(inp, "gradient")
        if not self._codes(inp, n, "gradient"):
            _plain_reduce_scatter(out, inp, twin, op, factor)
            self.reduce_stats.add(raw_calls=1)
            return
        if self._drift_sample is None and self.refresh.due(self.step):  # the step's first coded one
            self._drift_sample = self.refresh.measure(inp, self.codebooks)
        collectives.warm_kernels(self.codec, inp)
        collectives.reduce_scatter(out, list(inp.view(world, n)), self.codec, twin, average=average, kind="gradient",
                                   stats=self.reduce_stats, workspace=self._workspace)
        if factor is not None:
            out.mul_(factor)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, name: str) -> None:
        world, n = group.size(), inp.numel()
        _check_sizes(name, "all-gather", inp, out, world, n)
        if n == 0:
            return
        twin = self._twin(group)
        if self.profiler is not None and inp.dtype in _CODED:
            # (FSDP gathers a module whose parameters mix dtypes as uint8 bytes: sent plainly)
            self.profiler.observe(inp, "weight")
        if not self._codes(inp, n, "weight"):
            _all_gather_single(out, inp, group=twin)
            self.gather_stats.add(raw_calls=1)
            return
        collectives.warm_kernels(self.codec, inp)
        collectives.all_gather(list(out.view(world, n)), inp, self.codec, twin, kind="weight", stats=self.gather_stats,
                               workspace=self._workspace)

    # -- steps ------------------------------------------------------------------------------------
    def _arm_step_end(self) -> None:
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
        self._submit(self._end_of_step).result()

    def _end_of_step(self) -> None:
        """On the worker, after the step's last collective: books, drift, the next step's mode, logs.

        Every rank runs the same collectives here, at the same step: the books at the end
        of warmup, the drift agreement, the refreshed books, the auto decision.
        """
        self.step += 1
        if self.mode == "never":
            return
        if self.codec is None:
            if self.step < self.warmup_steps:
                return
            self._swap_books(self._warmup_books())
        elif self.coding and self.refresh.due(self.step - 1):
            # The step's first coded reduce-scatter sampled the drift (0 if none was coded);
            # a refresh window opened now profiles the next refresh_steps steps.
            sample, self._drift_sample = self._drift_sample, None
            if self.refresh.agree(sample or 0.0, self.step, self._group, _group_device(self._group)):
                self.profiler = WarmupProfiler()
        if self.refresh.swap_due(self.step):
            self._swap_books(self.refresh.rebuild(self.profiler, self._group, self.step, "FSDP2 refresh"))
        self._begin_step()
        if self.log_every and self.step % self.log_every == 0 and dist.get_rank(self._group) == 0:
            d = self.stats()
            log.info("comm_codec.fsdp step %d: ratio %.3f (reduce-scatter %.3f, all-gather %.3f), %.1f MB saved, "
                     "coding %s", self.step, d["ratio"], d["reduce_scatter"]["ratio"], d["all_gather"]["ratio"],
                     d["bytes_saved"] / 1e6, self.coding)

    def _begin_step(self) -> None:
        """Decide whether step ``self.step`` codes (collective when a measurement ends)."""
        self._drift_sample = None
        self.coding = self.switch.begin_step(self.step, self._group, _group_device(self._group))

    def _codec_threads(self) -> int:
        """The user's thread count, or the rank's share of the node's cores (coding runs
        beside FSDP's compute on the same cores: more threads oversubscribe them)."""
        if self.threads is not None:
            return self.threads
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        if not local and dist.is_available() and dist.is_initialized():
            local = dist.get_world_size(self.process_group)
        return default_threads(local or 1)

    def _warmup_books(self) -> CodebookSet:
        """Build books from the warmup's statistics on every rank (collectively)."""
        if self.profiler is None or not self.profiler.kinds():
            raise RuntimeError("comm_codec.fsdp: warmup ended without observing a gradient or weight shard "
                               "of a float dtype; nothing to build books from")
        return self.profiler.build(self._group, meta={"source": "online FSDP2 warmup", "step": self.step})

    def _swap_books(self, books: CodebookSet) -> None:
        """Check that every rank built the same books (collectively) and code with them from the next step."""
        check_same_books(books, self._group)
        self.codebooks, self.codec, self.profiler = books, Codec(books, threads=self._codec_threads()), None
        self._has_book.clear()
        log.info("comm_codec.fsdp: coding with books %s from step %d", books.digest[:12], self.step + 1)


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

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
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
        self.state._arm_step_end()
        state, name = self.state, self.name
        return state._call(lambda: state._reduce_scatter(output_tensor, input_tensor, group, op, name),
                           input_tensor, async_op)


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
        return state._call(lambda: state._all_gather(output_tensor, input_tensor, group, name), input_tensor,
                           async_op or state.overlap)


class _FutureWork(dist.Work):
    """A ``Work`` over the worker's future: ``wait()`` returns when the collective is done."""

    def __init__(self, future: concurrent.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.result()  # raises what the collective raised
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self):
        return self._future.exception() if self._future.done() else None


def compress(model: nn.Module, *, process_group=None, **state_kwargs) -> FSDPState:
    """Code the reduce-scatter and all-gather of every FSDP2 module of a model.

    Call it on every rank after ``fully_shard`` has been applied (to the layers and the
    root) and before training. It is collective: the ranks create twin process groups.

    Args:
        model: the model, with ``fully_shard`` applied.
        process_group: the group books are built and checked over (None: the world).
        **state_kwargs: :class:`FSDPState`'s options (warmup_steps, mode, codebooks,
            min_bytes, threads, log_every, drift_every, refresh_threshold, ...).

    Returns:
        The :class:`FSDPState`; ``state.stats()`` reports the traffic.

    Raises:
        TypeError: not a module, no FSDP2 module in it, an FSDP1 or DDP wrapper inside.
        ValueError: a module FSDP2 cannot give one custom collective (several parameter
            groups), trainable parameters of mixed dtypes in one module, bad options.
        RuntimeError: torch.distributed is not initialized, or ranks hold different books.
    """
    if FSDPModule is None:
        raise RuntimeError(f"comm_codec.fsdp needs torch >= 2.8 (FSDP2 custom collectives); this is {torch.__version__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialized: call init_process_group before compress()")
    modules = _fsdp_modules(model)
    state = FSDPState(process_group, **state_kwargs)
    state._install(modules)
    return state


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
            raise TypeError(f"module {label!r} is an FSDP1 FullyShardedDataParallel; comm_codec.fsdp codes FSDP2 "
                            "(torch.distributed.fsdp.fully_shard) collectives only: shard it with fully_shard")
        if isinstance(module, DistributedDataParallel):
            raise TypeError(f"module {label!r} is a DistributedDataParallel; for DDP use "
                            "ddp_model.register_comm_hook(comm_codec.ddp.HuffmanState(...), huffman_hook)")
        if isinstance(module, FSDPModule):
            found.append((label, module))
    if not found:
        raise TypeError(f"{type(model).__name__} has no FSDP2 module: apply torch.distributed.fsdp.fully_shard "
                        "to its layers and to the model itself, then call compress()")
    for label, module in found:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(f"module {label!r} holds {len(groups)} FSDP parameter groups (shard_placement_fn "
                             "with several meshes); FSDP2 takes one custom collective per module: apply "
                             "fully_shard to the parameters of each mesh in a module of their own")
        for group in groups:
            dtypes = {fp.sharded_param.dtype for fp in group.fsdp_params if fp.sharded_param.requires_grad}
            if len(dtypes) > 1:
                names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
                raise ValueError(f"module {label!r} has trainable parameters of mixed dtypes ({names}); FSDP2 "
                                 "reduce-scatters one dtype per module: cast them to one dtype, or shard the odd "
                                 "ones in a module of their own")
    return found


def _check_sizes(name: str, what: str, inp: torch.Tensor, out: torch.Tensor, world: int, n: int) -> None:
    """Refuse buffers FSDP could not have meant: W x n elements on one side, n on the other."""
    full = inp if what == "reduce-scatter" else out
    if full.numel() != world * n or inp.dtype != out.dtype:
        raise ValueError(f"module {name!r}: {what} of {inp.numel()} {inp.dtype} elements into {out.numel()} "
                         f"{out.dtype}, expected {world} x {n} of one dtype")


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
    raise ValueError(f"module {name!r}: FSDP asked for a {kind} reduce-scatter; comm_codec reduces sums only "
                     "(AVG, SUM, PREMUL_SUM)")


def _plain_reduce_scatter(out, inp, group, op, factor) -> None:
    """FSDP's own reduce-scatter; gloo has no PREMUL_SUM, so there the factor follows the sum."""
    if factor is not None and "gloo" in str(dist.get_backend(group)).lower():
        _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group)
        out.mul_(factor)
    else:
        _reduce_scatter_single(out, inp, op=op, group=group)


def _group_device(group) -> torch.device:
    """Where a small agreement tensor must live: NCCL moves CUDA tensors only."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
