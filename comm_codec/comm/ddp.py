"""DDP communication hook: gradients cross the wire Huffman-coded with fixed codebooks.

Usage, like PyTorch's own hooks::

    from comm_codec.ddp import HuffmanState, huffman_hook
    state = HuffmanState(process_group=None, warmup_steps=5)
    ddp_model.register_comm_hook(state, huffman_hook)
    ...
    state.stats()   # {"bytes_in": ..., "bytes_out": ..., "ratio": ..., "decision": ..., ...}

During the first ``warmup_steps`` backward passes the hook all-reduces plainly (exactly
as DDP's default hook: divide by the world size, then sum) while a
:class:`~comm_codec.books.profiler.WarmupProfiler` observes the gradient buckets and their
averages. Then every rank builds the books from the statistics summed over all ranks —
identical by construction, and checked by digest — and the hook can code: the two-phase
compressed all-reduce of :mod:`comm_codec.collectives`, whose result is the rank-order
sum of the raw gradients divided by the world size, bit-identical on every rank. With
``warmup_steps=0`` the hook codes from the first step with the given books (or the
shipped defaults).

Whether it codes is ``mode``'s business: ``"always"`` codes every step after warmup,
``"never"`` is DDP's default hook, and ``"auto"`` (the default) lets a
:class:`~comm_codec.comm.autoswitch.AutoSwitch` time plain and coded steps on this run and
code only where that is faster, agreed across ranks and re-checked every
``recheck_every`` steps. A plain step is exactly the default hook, issued on the
calling thread; a coded bucket runs on one worker thread per state, in bucket order,
so it overlaps with the rest of the backward pass as DDP's own all-reduce does (the
numba kernels and gloo release the GIL).

At the first step every rank sends its settings to every other (one small all-gather):
ranks configured differently raise the same ValueError, instead of waiting on each
other in collectives that do not match. The hook's own process group inherits the
timeout of the group it twins, so a stalled peer raises within the user's timeout.
"""

# No "from __future__ import annotations": DDP's register_comm_hook compares the hook's
# annotations with its own types, so they must be real objects.
import concurrent.futures
import logging
import os
import socket

import numba
import torch
import torch.distributed as dist

from . import collectives
from .autoswitch import AutoSwitch, check_mode
from ..core.codebooks import CodebookSet
from ..core.codec import Codec
from ..books.profiler import WarmupProfiler, check_same_books
from .refresh import BookRefresh
from .stats import CommStats, state_stats

__all__ = ["HuffmanState", "huffman_hook", "default_threads"]

log = logging.getLogger(__name__)

_CASTS = {None: None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_CODED = (torch.float32, torch.bfloat16, torch.float16)


def default_threads(local_world_size: int) -> int:
    """Return the codec threads a rank gets by default: its share of the cores torch uses.

    The codec runs while torch computes (buckets coded during backward) and on the same
    cores, so more codec threads than the rank's share oversubscribes them: with two
    ranks on two cores, two numba threads per rank made encodes ~1.5x slower than one.
    The share is the cores this process may run on divided by the ranks on this node,
    capped by torch's own thread count and numba's, and at least 1.

    Args:
        local_world_size: the ranks of the group that run on this node.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    share = cores // max(1, local_world_size)
    return max(1, min(share, torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


class HuffmanState:
    """State of :func:`huffman_hook`: books, warmup, the coding decision, statistics.

    Args:
        process_group: the group to all-reduce over (None: the default group).
        codebooks: a :class:`CodebookSet`, a path to a saved one, or None: the shipped
            defaults, or books built online when ``warmup_steps`` > 0.
        warmup_steps: backward passes to profile (plain all-reduce) before building books
            and compressing; 0 compresses from the start. Requires ``codebooks=None``.
        cast: None (lossless) or "bf16": cast fp32 buckets to bf16 before coding, like
            PyTorch's bf16_compress_hook. **Lossy**: gradients are rounded to bf16.
        min_bucket_bytes: buckets smaller than this are all-reduced plainly (their
            frames' headers would cost more than coding saves).
        threads: numba threads for the codec (None: :func:`default_threads` of the
            ranks on this node, chosen at the first step).
        log_every: log a traffic line every this many steps on rank 0 (0: never).
        writer: optional TensorBoard ``SummaryWriter``; scalars go under comm_codec/.
        drift_every: every this many steps, measure on bucket 0 how much the fixed books
            lose against optimal codes built for that bucket (``stats()["drift"]``, a
            fraction); 0 = off. Costs one histogram pass over one bucket.
        refresh_threshold: when the measured loss (largest over ranks) exceeds this
            fraction, profile ``refresh_steps`` more steps (still compressing) and swap
            in rebuilt books on every rank at the same step; None = never.
        refresh_steps: steps profiled for a refresh.
        mode: "auto" (default: code only where it measures faster), "always" (code
            every step after warmup) or "never" (DDP's default hook).
        recheck_every: in auto mode, steps between two measurements of both modes.
        probe_steps: in auto mode, steps timed per mode in a measurement.
        hysteresis: in auto mode, the fraction by which the other mode must be faster
            for the hook to switch to it.

    Raises:
        ValueError: a negative warmup, both codebooks and warmup given, an unknown cast
            or mode, negative sizes, or a refresh threshold without drift measurement.
        TypeError: codebooks of the wrong type.
    """

    __slots__ = (
        # what users tune
        "process_group", "warmup_steps", "cast", "min_bucket_bytes", "threads", "log_every", "writer", "mode",
        # internal state
        "codebooks", "codec", "profiler", "step", "verified", "switch", "refresh", "_executor", "_pid",
        "_comm_group", "_checked", "_coding", "_workspace", "_node_threads",
        # statistics
        "_stats",
    )

    def __init__(self, process_group=None, codebooks=None, warmup_steps: int = 0, cast=None,
                 min_bucket_bytes: int = 4096, threads: int | None = None, log_every: int = 50, writer=None,
                 drift_every: int = 0, refresh_threshold: float | None = None, refresh_steps: int = 3,
                 mode: str = "auto", recheck_every: int = 200, probe_steps: int = 4, hysteresis: float = 0.05):
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if codebooks is not None and warmup_steps:
            raise ValueError("give either codebooks (fixed books) or warmup_steps > 0 (books built online), not both")
        if cast not in _CASTS:
            raise ValueError(f"cast must be None or 'bf16', got {cast!r}")
        if not isinstance(min_bucket_bytes, int) or min_bucket_bytes < 0:
            raise ValueError(f"min_bucket_bytes must be an integer >= 0, got {min_bucket_bytes!r}")
        if not isinstance(log_every, int) or log_every < 0:
            raise ValueError(f"log_every must be an integer >= 0, got {log_every!r}")
        refresh = BookRefresh(drift_every, refresh_threshold, refresh_steps)
        if threads is not None and not (isinstance(threads, int) and 1 <= threads <= numba.config.NUMBA_NUM_THREADS):
            raise ValueError(f"threads must be None or an integer in 1..{numba.config.NUMBA_NUM_THREADS} "
                             f"(NUMBA_NUM_THREADS), got {threads!r}")
        check_mode(mode)
        switch = AutoSwitch(mode, probe_steps=probe_steps, recheck_every=recheck_every, hysteresis=hysteresis)
        if isinstance(codebooks, (str, os.PathLike)):
            codebooks = CodebookSet.load(codebooks)
        if codebooks is not None and not isinstance(codebooks, CodebookSet):
            raise TypeError(f"codebooks must be a CodebookSet, a path or None, got {type(codebooks).__name__}")
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.cast = cast
        self.min_bucket_bytes = min_bucket_bytes
        self.threads = threads
        self.log_every = log_every
        self.writer = writer
        self.mode = mode
        self.switch = switch
        self.refresh = refresh
        self.codebooks = codebooks if codebooks is not None or warmup_steps else CodebookSet.default()
        self.codec = Codec(self.codebooks, threads=threads) if self.codebooks is not None else None
        self.profiler = WarmupProfiler() if warmup_steps and mode != "never" else None
        self.step = 0
        self.verified = False
        self._init_runtime()
        if dist.is_available() and dist.is_initialized():
            self._group()
        log.info("HuffmanState: mode=%s, warmup_steps=%d, cast=%s, books=%s", mode, warmup_steps, cast,
                 "online" if self.codebooks is None else self.codebooks.digest[:12])

    def _init_runtime(self) -> None:
        self._executor = None
        self._pid = None
        self._comm_group = None
        self._checked = False
        self._coding = False
        self._workspace = collectives.Workspace()
        self._node_threads = None  # default_threads() of this node, found at the first step
        self._stats = CommStats()

    # -- public -------------------------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        """True while the hook still profiles instead of compressing."""
        return self.step < self.warmup_steps and self.mode != "never"

    def stats(self) -> dict:
        """Return traffic statistics and the coding decision.

        Keys: bytes_in, bytes_out, ratio, bytes_saved, encode_seconds, decode_seconds,
        comm_seconds, calls, raw_calls, steps (traffic, see :class:`CommStats`);
        warming_up, books, drift, refreshes; mode, coding (whether the last step was
        coded), decision (None before the first measurement; else a dict: coded,
        step, plain_ms, coded_ms, per_rank_ms, reason), switches (changes of decision
        since the first), probes (measurements started).
        """
        d = self._stats.as_dict()
        d.update(state_stats(warming_up=self.warming_up, codebooks=self.codebooks, refresh=self.refresh,
                             switch=self.switch, coding=self._coding))
        return d

    def reset_stats(self) -> None:
        """Zero the traffic counters (the step count stays)."""
        steps = self._stats.steps
        self._stats.reset()
        self._stats.add(steps=steps)

    # -- pickling: without the process group, executor or writer --------------------------------
    def __getstate__(self):
        return {
            "warmup_steps": self.warmup_steps, "cast": self.cast, "min_bucket_bytes": self.min_bucket_bytes,
            "threads": self.threads, "log_every": self.log_every, "step": self.step,
            "drift_every": self.refresh.drift_every, "refresh_threshold": self.refresh.refresh_threshold,
            "refresh_steps": self.refresh.refresh_steps, "refreshes": self.refresh.refreshes, "mode": self.mode,
            "switch": self.switch, "coding": self._coding,
            "codebooks": self.codebooks.to_dict() if self.codebooks is not None else None,
            # Warmup statistics travel too: a state saved at the end of warmup builds
            # its books from them at the first compressed step after resuming.
            "profiler": self.profiler,
            "stats": self._stats.__getstate__(),
        }

    def __setstate__(self, state):
        self.process_group = None
        self.writer = None
        self.warmup_steps = state["warmup_steps"]
        self.cast = state["cast"]
        self.min_bucket_bytes = state["min_bucket_bytes"]
        self.threads = state["threads"]
        self.log_every = state["log_every"]
        self.step = state["step"]
        self.refresh = BookRefresh(state["drift_every"], state["refresh_threshold"], state["refresh_steps"])
        self.refresh.refreshes = state["refreshes"]  # (no window open: a resumed run measures anew)
        self.mode = state.get("mode", "always")  # states pickled before modes existed always coded
        self.switch = state.get("switch") or AutoSwitch(self.mode)
        books = state["codebooks"]
        self.codebooks = CodebookSet.from_dict(books, "<pickled HuffmanState>") if books is not None else None
        self.codec = Codec(self.codebooks, threads=self.threads) if self.codebooks is not None else None
        self.profiler = state.get("profiler")
        if self.profiler is None and self.codebooks is None:
            self.profiler = WarmupProfiler()
        self.verified = False
        self._init_runtime()
        self._coding = state.get("coding", False)
        self._stats.__setstate__(state["stats"])

    # -- the step -----------------------------------------------------------------------
    def _begin_step(self, device=None) -> bool:
        """Start a step on the calling thread, at its first bucket; return whether to code it.

        Every rank runs the same collectives here, in the same order, while no worker
        job is in flight (DDP waited for the last step's): the settings check (first
        step), the refreshed books (when a refresh window ends), the auto decision (when
        a measurement ends).
        """
        group = self._group()
        if not self._checked:
            self._check_settings(group)
        self._maybe_swap_books()
        if self.mode == "never":
            self._coding = False
        elif self.warming_up:
            self._coding = False
        else:
            self._coding = self.switch.begin_step(self.step, group, device)
        return self._coding

    def _check_settings(self, group) -> None:
        """Raise the same ValueError on every rank if the ranks' shared settings differ."""
        mine = self._shared_settings()
        seen = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, (mine, socket.gethostname()), group=group)
        first = seen[0][0]
        for rank, (theirs, _) in enumerate(seen):
            for name in first:
                if theirs.get(name) != first.get(name):
                    raise ValueError(
                        f"HuffmanState differs across ranks: {name} is {first.get(name)!r} on rank 0 but "
                        f"{theirs.get(name)!r} on rank {rank}; give every rank the same settings")
        host = socket.gethostname()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or sum(h == host for _, h in seen)
        self._node_threads = default_threads(local)
        if self.codec is not None:
            self.codec.threads = self._codec_threads()
        self._checked = True

    def _codec_threads(self) -> int | None:
        return self.threads if self.threads is not None else self._node_threads

    def _shared_settings(self) -> dict:
        """The settings that change which collectives a rank issues (and the step it is at)."""
        sw, rf = self.switch, self.refresh
        return {"mode": self.mode, "warmup_steps": self.warmup_steps, "cast": self.cast,
                "min_bucket_bytes": self.min_bucket_bytes, "drift_every": rf.drift_every,
                "refresh_threshold": rf.refresh_threshold, "refresh_steps": rf.refresh_steps,
                "probe_steps": sw.probe_steps, "recheck_every": sw.recheck_every, "hysteresis": sw.hysteresis,
                "step": self.step, "books": "online" if self.codebooks is None else "fixed"}

    def _end_of_step(self) -> None:
        self.step += 1
        self._stats.add(steps=1)
        if self.log_every and self.step % self.log_every == 0 and dist.get_rank(self.process_group) == 0:
            d = self._stats.as_dict()
            log.info("comm_codec step %d: ratio %.3f, %.1f MB saved, encode %.2fs decode %.2fs, %s",
                     self.step, d["ratio"], d["bytes_saved"] / 1e6, d["encode_seconds"], d["decode_seconds"],
                     "coding" if self._coding else "plain")
        if self.writer is not None:
            d = self._stats.as_dict()
            for key in ("ratio", "bytes_in", "bytes_out", "encode_seconds", "decode_seconds"):
                self.writer.add_scalar(f"comm_codec/{key}", d[key], self.step)
            self.writer.add_scalar("comm_codec/coding", float(self._coding), self.step)

    # -- internal -----------------------------------------------------------------------
    def _observe(self, tensor: torch.Tensor, kind: str) -> None:
        """Profile a bucket as it will be coded: cast first when the cast applies."""
        cast = _CASTS[self.cast]
        if cast is not None and tensor.dtype == torch.float32:
            tensor = tensor.to(cast)
        self.profiler.observe(tensor, kind)

    @property
    def _profiling(self) -> bool:
        return self.profiler is not None and (self.warming_up or self.refresh.refreshing)

    def _group(self):
        """The group the worker thread talks on: a twin of process_group, its own.

        DDP itself issues collectives on the autograd thread (e.g. the map of unused
        parameters with find_unused_parameters=True); ours run on a worker thread, and two
        threads' collectives on one group may be ordered differently on each rank.
        Creating a group is collective: all ranks do it at the same point (here, or at
        their first hook call). The twin gets the original's timeout (torch gives new
        groups 30 minutes), so a stalled peer fails a coded step as soon as it would
        fail a plain one.
        """
        if self._comm_group is None:
            base = self.process_group or dist.group.WORLD
            ranks = dist.get_process_group_ranks(base)
            self._comm_group = dist.new_group(ranks=ranks, timeout=_group_timeout(base))
        return self._comm_group

    def _submit(self, fn):
        if self._executor is None or self._pid != os.getpid():
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="comm_codec")
            self._pid = os.getpid()
        return self._executor.submit(fn)

    def _ensure_books(self) -> None:
        """Build books after warmup (collectively) and check all ranks hold the same."""
        if self.codebooks is None:
            if self.profiler is None or not self.profiler.kinds():
                raise RuntimeError("warmup ended without observing any gradient bucket")
            self.codebooks = self.profiler.build(self._group(), meta={"source": "online DDP warmup",
                                                                      "steps": self.warmup_steps})
            self.codec = Codec(self.codebooks, threads=self._codec_threads())
            self.profiler = None
        if not self.verified:
            check_same_books(self.codebooks, self._group())
            self.verified = True
            log.info("comm_codec: compressing gradients with books %s", self.codebooks.digest[:12])

    def _measure_drift(self, tensor: torch.Tensor) -> None:
        """Sample how much the fixed books lose on this bucket; profile anew if the ranks agree to refresh."""
        loss = self.refresh.measure(tensor, self.codebooks)
        if self.refresh.agree(loss, self.step, self._group(), tensor.device):  # NCCL: on the bucket's GPU
            self.profiler = WarmupProfiler()

    def _maybe_swap_books(self) -> None:
        """At the end of a refresh window, build new books collectively and swap them in."""
        if self.refresh.swap_due(self.step):
            self.codebooks = self.refresh.rebuild(self.profiler, self._group(), self.step, "DDP refresh")
            self.codec = Codec(self.codebooks, threads=self._codec_threads())
            self.profiler = None


def _group_timeout(group):
    """The timeout of ``group``'s backend for its default device, or None if unknown."""
    try:
        return group._get_backend(group._device_types[0]).options._timeout
    except (AttributeError, IndexError, RuntimeError, ValueError):  # no such backend options: torch's default
        return None


def _plain_all_reduce(state, bucket) -> torch.futures.Future:
    """DDP's default hook: divide, then sum (so warmup results equal the default's)."""
    group = state.process_group
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    state._stats.add(raw_calls=1)
    return fut.then(lambda f: f.value()[0])


def huffman_hook(state: "HuffmanState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket with Huffman-coded frames; the DDP comm-hook contract.

    Args:
        state: a :class:`HuffmanState`.
        bucket: the gradient bucket DDP hands the hook.

    Returns:
        A future holding the averaged bucket (written in place in ``bucket.buffer()``).

    Raises:
        ValueError: at the first step, on every rank, when ranks are configured
            differently. (Through the future, on every rank)
            :class:`comm_codec.collectives.CollectiveError` when a frame fails to decode
            on any rank; RuntimeError when ranks hold different books.
    """
    tensor = bucket.buffer()
    is_last = bucket.is_last()
    index = bucket.index()
    if index == 0:  # DDP hands buckets over in index order: 0 starts a step
        state._begin_step(tensor.device if tensor.is_cuda else None)
    if not state._coding:
        profiling = state._profiling
        if profiling:
            state._observe(tensor, "gradient")
        fut = _plain_all_reduce(state, bucket)

        def after(f, last=is_last):
            result = f.value()
            if profiling:
                state._observe(result, "reduced_gradient")
            if last:
                state._end_of_step()
            return result

        return fut.then(after)

    # Every coded collective is issued from the one worker thread, in bucket order:
    # collectives issued from two threads could interleave differently on each rank.
    group = state._group()
    ready = None
    if tensor.is_cuda:
        # The bucket may still be being written on this thread's stream; the worker's
        # stream waits for it on the device (no host sync here).
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))

    def work():
        if ready is not None:
            return collectives.on_cuda_worker(tensor.device, ready, run)
        return run()

    def run():
        small = tensor.numel() * tensor.element_size() < state.min_bucket_bytes
        if tensor.dtype not in _CODED or tensor.device.type not in ("cpu", "cuda") or small:
            tensor.div_(dist.get_world_size(group))
            dist.all_reduce(tensor, group=group)
            state._stats.add(raw_calls=1)
        else:
            state._ensure_books()
            if index == 0 and state.refresh.due(state.step):
                state._measure_drift(tensor)
            refreshing = state.refresh.refreshing
            if refreshing:
                state._observe(tensor, "gradient")
            cast = _CASTS[state.cast] if tensor.dtype == torch.float32 else None
            collectives.warm_kernels(state.codec, tensor, cast)
            collectives.all_reduce(tensor, state.codec, group, average=True, cast=cast, stats=state._stats,
                                   workspace=state._workspace)
            if refreshing:
                state._observe(tensor, "reduced_gradient")
        if is_last:
            state._end_of_step()
        return tensor

    # The worker's outcome, tensor or exception, is passed on as a value and raised in a
    # .then callback: DDP then reports the exception itself, not a failed cast to Tensor.
    outcome = torch.futures.Future()

    def done(cf):
        exc = cf.exception()
        outcome.set_result(exc if exc is not None else cf.result())

    def unwrap(f):
        value = f.value()
        if isinstance(value, BaseException):
            raise value
        return value

    state._submit(work).add_done_callback(done)
    return outcome.then(unwrap)
