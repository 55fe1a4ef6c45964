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
(FSDP's own collectives) or "auto" (an A/B of real step times, agreed across ranks,
decides; :class:`_AutoSwitch`). ``drift_every`` / ``refresh_threshold`` measure and
refresh the books as the DDP hook does. A step is one backward pass that reduce-scatters.

Threads: FSDP calls the reduce-scatter synchronously, and the all-gather synchronously
or, when a module is unsharded with ``async_op=True``, expecting a ``Work``. Every
collective of a state, coded or plain, runs on one worker thread in call order, on its
own twin of each process group: an all-gather in flight can never interleave differently
with a reduce-scatter on two ranks, and FSDP's own use of its groups never meets ours.
All-gathers return a :class:`torch.distributed.Work` (``overlap=True``, the default)
whose ``wait()`` returns once the decode is done; FSDP waits on it before it copies the
parameters out, so the all-gather it prefetches in backward overlaps the current layer's
compute on CPU, as FSDP's streams overlap them on a GPU. Large shards are coded in up to
four pieces, pipelined (:func:`_coded_all_gather`, :func:`_coded_reduce_scatter`). CUDA
tensors take the same path as in :mod:`comm_codec.collectives` (NCCL; the worker waits
on the caller's stream and synchronizes before the call counts as done) -- not yet run
on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .codebooks import CodebookSet
from .codec import Codec
from .frame import FrameError
from .profiler import WarmupProfiler, check_same_books, coding_cost
from .stats import CommStats

try:  # FSDP2's custom-collective seams: torch >= 2.8 (tested with 2.13)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch
    FSDPModule = None
    AllGather = ReduceScatter = object

__all__ = ["FSDPState", "HuffmanReduceScatter", "HuffmanAllGather", "compress"]

log = logging.getLogger(__name__)

MODES = ("auto", "always", "never")
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
        mode: "auto" (default): code only while a measured A/B of whole steps says it is
            faster; "always"; "never" (FSDP's own collectives, nothing profiled).
        min_bytes: collectives whose per-rank shard is smaller than this run plainly
            (their frames' headers would cost more than coding saves).
        threads: numba threads for the codec (None: numba's setting).
        log_every: log a traffic line every this many steps on rank 0 (0: never).
        drift_every: every this many steps, measure on the step's first coded
            reduce-scatter how much the books lose against optimal codes
            (``stats()["drift"]``); 0 = off.
        refresh_threshold: when the measured loss (largest over ranks) exceeds this
            fraction, profile ``refresh_steps`` more steps (still coding) and swap in
            rebuilt books on every rank at the same step; None = never.
        refresh_steps: steps profiled for a refresh.
        probe_steps: with mode "auto", steps of each arm in one A/B window.
        probe_every: with mode "auto", steps between the end of one window and the next.
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
        "process_group", "warmup_steps", "mode", "min_bytes", "threads", "log_every", "drift_every",
        "refresh_threshold", "refresh_steps", "overlap",
        # internal state
        "codebooks", "codec", "profiler", "step", "switch", "coding", "drift", "refreshes", "modules",
        "_refresh_until", "_measure_drift", "_drift_sample", "_twins", "_saved", "_executor", "_pid",
        "_queued", "_last_end", "_has_book",
        # statistics
        "reduce_stats", "gather_stats",
    )

    def __init__(self, process_group=None, codebooks=None, warmup_steps: int = 0, mode: str = "auto",
                 min_bytes: int = 4096, threads: int | None = None, log_every: int = 50, drift_every: int = 0,
                 refresh_threshold: float | None = None, refresh_steps: int = 3, probe_steps: int = 3,
                 probe_every: int = 200, overlap: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        for name, value, least in (("warmup_steps", warmup_steps, 0), ("min_bytes", min_bytes, 0),
                                   ("log_every", log_every, 0), ("drift_every", drift_every, 0),
                                   ("refresh_steps", refresh_steps, 1), ("probe_steps", probe_steps, 1),
                                   ("probe_every", probe_every, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if codebooks is not None and warmup_steps:
            raise ValueError("give either codebooks (fixed books) or warmup_steps > 0 (books built online), not both")
        if refresh_threshold is not None and not (refresh_threshold > 0 and drift_every):
            raise ValueError("refresh_threshold must be > 0 and needs drift_every > 0 (drift is what triggers a refresh)")
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
        self.drift_every = drift_every
        self.refresh_threshold = refresh_threshold
        self.refresh_steps = refresh_steps
        self.overlap = bool(overlap)
        if mode == "never":
            self.codebooks = None
        else:
            self.codebooks = codebooks if codebooks is not None or warmup_steps else CodebookSet.default()
        self.codec = Codec(self.codebooks, threads=threads) if self.codebooks is not None else None
        self.profiler = WarmupProfiler() if self.warmup_steps else None
        self.step = 0
        self.switch = _AutoSwitch(probe_steps, probe_every) if mode == "auto" else None
        self.coding = self.codec is not None  # the arm of the current step
        self.drift = None
        self.refreshes = 0
        self.modules: list[str] = []
        self._refresh_until = None
        self._measure_drift = False
        self._drift_sample = None
        self._twins: dict[tuple, object] = {}
        self._saved: list = []
        self._executor = None
        self._pid = None
        self._queued = False
        self._last_end = None
        self._has_book: dict[tuple, bool] = {}
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
            seconds, calls, raw_calls, steps, warming_up, books, drift, refreshes, mode,
            coding (the current step's arm), decisions (mode "auto": the A/B results),
            and the same counters per collective under "reduce_scatter" and "all_gather".
        """
        parts = {"reduce_scatter": self.reduce_stats.as_dict(), "all_gather": self.gather_stats.as_dict()}
        d = {k: v + parts["all_gather"][k] for k, v in parts["reduce_scatter"].items()
             if k not in ("ratio", "bytes_saved")}
        d["ratio"] = d["bytes_in"] / d["bytes_out"] if d["bytes_out"] else 1.0
        d["bytes_saved"] = d["bytes_in"] - d["bytes_out"]
        d["steps"] = self.step
        d.update(parts)
        d["warming_up"] = self.warming_up
        d["books"] = self.codebooks.digest if self.codebooks is not None else None
        d["drift"] = self.drift
        d["refreshes"] = self.refreshes
        d["mode"] = self.mode
        d["coding"] = self.coding
        d["decisions"] = list(self.switch.decisions) if self.switch is not None else []
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
        future = self._submit(fn if ready is None else (lambda: _on_cuda_worker(tensor.device, ready, fn)))
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
        world = group.size()
        n = out.numel()
        if inp.numel() != world * n or inp.dtype != out.dtype:
            raise ValueError(f"module {name!r}: reduce-scatter of {inp.numel()} {inp.dtype} elements into "
                             f"{n} {out.dtype}, expected {world} x {n} of one dtype")
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
        if self._measure_drift and self._drift_sample is None:
            fixed, optimal, _ = coding_cost(inp, self.codebooks, "gradient")
            self._drift_sample = fixed / optimal - 1.0 if optimal else 0.0
        _coded_reduce_scatter(out, inp.view(world, n), self.codec, twin, average, self.reduce_stats)
        if factor is not None:
            out.mul_(factor)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, name: str) -> None:
        world = group.size()
        n = inp.numel()
        if out.numel() != world * n or inp.dtype != out.dtype:
            raise ValueError(f"module {name!r}: all-gather of {n} {inp.dtype} elements into {out.numel()} "
                             f"{out.dtype}, expected {world} x {n} of one dtype")
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
        _coded_all_gather(out.view(world, n), inp, self.codec, twin, self.gather_stats)

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
        now = time.perf_counter()
        self._submit(lambda: self._end_of_step(now)).result()

    def _end_of_step(self, now: float) -> None:
        """On the worker, after the step's last collective: books, drift, the next arm, logs."""
        self.step += 1
        elapsed = None if self._last_end is None else now - self._last_end
        self._last_end = now
        if self.mode == "never":
            return
        if self.codec is None:
            if self.step >= self.warmup_steps:
                self._swap_books("online FSDP2 warmup")
                self.coding = True
            return
        if self._measure_drift:
            self._agree_on_drift()
        self._measure_drift = bool(self.drift_every) and self.step % self.drift_every == 0
        if self._refresh_until is not None and self.step >= self._refresh_until:
            self._swap_books("FSDP2 refresh")
            self._refresh_until = None
            self.refreshes += 1
        if self.switch is not None:
            self.coding = self.switch.after_step(elapsed, self._group)
        if self.log_every and self.step % self.log_every == 0 and dist.get_rank(self._group) == 0:
            d = self.stats()
            log.info("comm_codec.fsdp step %d: ratio %.3f (reduce-scatter %.3f, all-gather %.3f), %.1f MB saved, "
                     "coding %s", self.step, d["ratio"], d["reduce_scatter"]["ratio"], d["all_gather"]["ratio"],
                     d["bytes_saved"] / 1e6, self.coding)

    def _swap_books(self, source: str) -> None:
        """Build books from the profiled steps on every rank (collectively) and code with them."""
        if self.profiler is None or not self.profiler.kinds():
            raise RuntimeError("comm_codec.fsdp: warmup ended without observing a gradient or weight shard "
                               "of a float dtype; nothing to build books from")
        books = self.profiler.build(self._group, meta={"source": source, "step": self.step})
        check_same_books(books, self._group)
        self.codebooks, self.codec, self.profiler = books, Codec(books, threads=self.threads), None
        self._has_book.clear()
        log.info("comm_codec.fsdp: coding with books %s from step %d", books.digest[:12], self.step + 1)

    def _agree_on_drift(self) -> None:
        """Publish the drift sampled this step; start a refresh when the worst rank passes the threshold."""
        loss = self._drift_sample if self._drift_sample is not None else 0.0
        self._drift_sample = None
        if self.refresh_threshold is not None:
            t = torch.tensor([loss], dtype=torch.float64, device=_group_device(self._group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            loss = float(t)
            if loss > self.refresh_threshold and self._refresh_until is None:
                log.info("comm_codec.fsdp: books lose %.2f%% (> %.2f%%) at step %d; re-profiling for %d steps",
                         100 * loss, 100 * self.refresh_threshold, self.step, self.refresh_steps)
                self.profiler = WarmupProfiler()
                self._refresh_until = self.step + self.refresh_steps
        self.drift = loss


class _AutoSwitch:
    """Decide from whole-step times, agreed across ranks, whether coding pays.

    The one place mode "auto" decides (meant to be replaced by the DDP hook's switch when
    the two are unified). A probe window runs one settling step (coded: first calls warm
    the codec), then ``probe_steps`` plain and ``probe_steps`` coded steps alternating
    (B, A, B, A, ...), so drifting load hits both arms alike. Each step's time is maxed
    over the ranks (a synchronous step lasts as long as its slowest rank); the arm with the
    lower median runs until the next window, ``probe_every`` steps later.
    """

    __slots__ = ("probe_steps", "probe_every", "coded", "decisions", "_pos", "_left", "_times")

    def __init__(self, probe_steps: int = 3, probe_every: int = 200):
        self.probe_steps = probe_steps
        self.probe_every = probe_every
        self.coded = True  # the arm of the step under way
        self.decisions: list[dict] = []
        self._pos = 0  # position in the probe window (None: between windows)
        self._left = 0
        self._times: list[float] = []

    def after_step(self, elapsed: float | None, group) -> bool:
        """Take the time of the step that just ended; return the arm of the next one.

        Every rank calls this at the same step (a collective at the end of a window).
        """
        if self._pos is None:
            self._left -= 1
            if self._left <= 0:
                self._pos, self._times = 0, []
                self.coded = True
            return self.coded
        if self._pos > 0:
            self._times.append(float("nan") if elapsed is None else elapsed)
        self._pos += 1
        if self._pos <= 2 * self.probe_steps:
            self.coded = self._pos % 2 == 0
            return self.coded
        self._decide(group)
        return self.coded

    def _decide(self, group) -> None:
        times = torch.tensor(self._times, dtype=torch.float64, device=_group_device(group))
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        times = times.cpu().tolist()
        plain = statistics.median(times[0::2])  # positions 1, 3, ... ran plainly
        coded = statistics.median(times[1::2])
        self.coded = coded < plain
        self.decisions.append({"coded_seconds": coded, "plain_seconds": plain, "coding": self.coded})
        self._pos, self._left = None, self.probe_every
        log.info("comm_codec.fsdp auto: coded step %.1f ms, plain %.1f ms (median, slowest rank): %s",
                 1e3 * coded, 1e3 * plain, "coding" if self.coded else "plain collectives")


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


# -- the coded exchanges, pipelined ---------------------------------------------------------------
# comm_codec.collectives' reduce_scatter and all_gather code a tensor in one piece; FSDP
# moves a module's whole shard at once (tens of MB for an embedding), so these cut it into
# up to _PIECES pieces as collectives.all_reduce does: piece k+1 is encoded while piece k is
# on the wire, piece k-1 decoded meanwhile. Same frames, same rank-order sum, same errors
# (raised on every rank as CollectiveError).
_PIECES = 4
_MIN_PIECE = 1 << 18  # elements of a piece, at least


def _piece_bounds(n: int) -> list[tuple[int, int]]:
    count = max(1, min(_PIECES, n // _MIN_PIECE))
    return [(k * n // count, (k + 1) * n // count) for k in range(count)]


class _InFlight:
    """One piece's frames on the wire: an async uneven all_to_all_single (sizes sent first)."""

    __slots__ = ("work", "recv", "splits", "send", "bounds")

    def __init__(self, frames: list[torch.Tensor], group, bounds: tuple[int, int]):
        world = len(frames)
        device = frames[0].device
        send_sizes = torch.tensor([f.numel() for f in frames], dtype=torch.int64, device=device)
        recv_sizes = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_to_all_single(recv_sizes, send_sizes, group=group)
        self.splits = recv_sizes.tolist()
        self.send = torch.cat(frames)  # kept alive until sent
        self.recv = torch.empty(sum(self.splits), dtype=torch.uint8, device=device)
        self.work = dist.all_to_all_single(self.recv, self.send, output_split_sizes=self.splits,
                                           input_split_sizes=send_sizes.tolist(), group=group, async_op=True)
        self.bounds = bounds

    def frames(self) -> list[torch.Tensor]:
        self.work.wait()
        return list(torch.split(self.recv, self.splits))


def _pipeline(bounds, start, finish) -> str | None:
    """Run start(k) for every piece, finish(k-1) while piece k is in flight; the first error."""
    error, flying = None, None
    for k in range(len(bounds) + 1):
        started = start(k) if k < len(bounds) else None
        if flying is not None:
            error = error or finish(flying)
        flying = started
    return error


def _coded_all_gather(rows: torch.Tensor, inp: torch.Tensor, codec: Codec, group, stats: CommStats) -> None:
    """Gather every rank's ``inp`` into ``rows`` (W x n), coded; every rank gets the owners' bits."""
    world, rank = rows.shape[0], dist.get_rank(group)
    empty = torch.empty(0, dtype=torch.uint8, device=inp.device)
    bounds = _piece_bounds(inp.numel())

    def start(k):
        a, b = bounds[k]
        with stats.timer("encode_seconds"):
            frame = codec.encode(inp[a:b], "weight")
        flight = _InFlight([empty if r == rank else frame for r in range(world)], group, (a, b))
        stats.add(bytes_in=(world - 1) * (b - a) * inp.element_size(),
                  bytes_out=(world - 1) * frame.numel() + 16 * world)
        return flight

    def finish(flight):
        a, b = flight.bounds
        frames = flight.frames()
        try:
            with stats.timer("decode_seconds"):
                for r in range(world):
                    if r != rank:
                        codec.decode(frames[r], out=rows[r, a:b])
        except (FrameError, ValueError, TypeError) as exc:
            return f"all-gather frame from rank {r}: {exc}"
        return None

    with stats.timer("comm_seconds"):
        error = _pipeline(bounds, start, finish)
        if rows[rank].data_ptr() != inp.data_ptr():  # FSDP gathers in place: its input is this row
            rows[rank].copy_(inp)
        _agree(error, group, inp.device)
        stats.add(calls=1)


def _coded_reduce_scatter(out: torch.Tensor, rows: torch.Tensor, codec: Codec, group, average: bool,
                          stats: CommStats) -> None:
    """Sum row ``rank`` of every rank's ``rows`` into ``out`` in rank order in float32, coded.

    Divided by W when ``average``, rounded to the dtype once: bit-identical to the same sum
    of the raw rows.
    """
    world, rank = rows.shape[0], dist.get_rank(group)
    empty = torch.empty(0, dtype=torch.uint8, device=out.device)
    bounds = _piece_bounds(out.numel())

    def start(k):
        a, b = bounds[k]
        with stats.timer("encode_seconds"):
            frames = [empty if r == rank else codec.encode(rows[r, a:b], "gradient") for r in range(world)]
        stats.add(bytes_in=(world - 1) * (b - a) * rows.element_size(),
                  bytes_out=sum(f.numel() for f in frames) + 16 * world)
        return _InFlight(frames, group, (a, b))

    def finish(flight):
        a, b = flight.bounds
        frames = flight.frames()
        acc = None
        try:
            with stats.timer("decode_seconds"):
                for r in range(world):
                    part = rows[rank, a:b] if r == rank else codec.decode(frames[r])
                    if part.numel() != b - a or part.dtype != rows.dtype:
                        raise FrameError(f"frame holds {part.numel()} {part.dtype}, expected {b - a} {rows.dtype}")
                    if acc is None:
                        acc = part.to(torch.float32, copy=True)
                    else:
                        acc.add_(part)  # float32: bf16/fp16 parts widen exactly
        except (FrameError, ValueError, TypeError) as exc:
            return f"reduce-scatter frame from rank {r}: {exc}"
        if average:
            acc.div_(world)
        out[a:b].copy_(acc)  # the one rounding, to the gradient dtype
        return None

    with stats.timer("comm_seconds"):
        _agree(_pipeline(bounds, start, finish), group, out.device)
        stats.add(calls=1)


def _agree(error: str | None, group, device) -> None:
    """Raise CollectiveError on every rank if any rank failed (one small all-reduce)."""
    flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, error, group=group)
        raise collectives.CollectiveError("compressed collective failed: " + "; ".join(
            f"rank {r}: {m}" for r, m in enumerate(messages) if m))


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


def _on_cuda_worker(device: torch.device, ready, fn):
    """Run fn on the worker for CUDA tensors: after ``ready``, finished on return.

    The worker thread has its own current stream; it waits for the caller's event and
    synchronizes before returning, since the caller (FSDP) treats a finished call as done.
    """
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        stream.wait_event(ready)
        result = fn()
        stream.synchronize()
    return result
