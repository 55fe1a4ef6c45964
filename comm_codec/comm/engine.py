"""The coding engine: what every coded-communication adapter shares, written once.

The DDP hook (:class:`comm_codec.ddp.HuffmanState`), the FSDP2 collectives
(:class:`comm_codec.fsdp.FSDPState`) and the DeepSpeed plugin differ only in *where*
they meet the framework: a gradient bucket, FSDP's reduce-scatter and all-gather
buffers, DeepSpeed's reduction methods. Everything else is this engine's:

* **Settings**, validated once, with one keyword set (:data:`OPTIONS`) for every adapter.
* **Books**: given, the shipped defaults, or built online after ``warmup_steps`` steps
  from statistics summed over the ranks; checked to be the same on every rank; measured
  for drift and refreshed (:class:`~comm_codec.comm.refresh.BookRefresh`).
* **The step**: :meth:`begin_step` is where every rank runs the engine's own small
  collectives, at the same point, while nothing else of the engine is on the wire --
  the settings check (first step), the books at the end of warmup, the drift agreement,
  the refreshed books, the auto decision (:class:`~comm_codec.comm.autoswitch.AutoSwitch`);
  it returns whether the step codes. :meth:`end_step` counts it and logs.
* **The worker**: one thread per engine runs the coded collectives in call order
  (:meth:`submit`), on the engine's twin of the process group
  (:func:`~comm_codec.comm.agreement.twin_group`, with the user's timeout): two
  threads' collectives on one group could be ordered differently on each rank.
* **Threads**: the codec gets the rank's share of the node's cores (:func:`default_threads`).
* **Statistics**: one :class:`~comm_codec.comm.stats.CommStats` per collective the
  adapter runs, summed in :meth:`stats` under the same keys for every adapter.

Cross-rank agreement itself is :mod:`comm_codec.comm.agreement`'s.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import time

import numba
import torch
import torch.distributed as dist

from ..books.profiler import WarmupProfiler
from ..core.codebooks import CodebookSet
from ..core.codec import Codec
from ..core.errors import AgreementError, CollectiveError, ConfigError
from ..core.precompile import precompile as precompile_kernels
from ..core.streams import ACCUMULABLE_DTYPES
from . import agreement
from .autoswitch import AutoSwitch
from .collectives import Workspace, on_cuda_worker, plain_wire_bytes
from .config import CommConfig, make_config
from .refresh import BookRefresh
from .stats import LOGGED, CommStats, TrafficStats, traffic_line

__all__ = ["CASTS", "CODED_DTYPES", "OPTIONS", "CodingEngine", "FutureWork", "default_threads"]

log = logging.getLogger(__name__)

# The dtypes the coded collectives sum in float32 (and so code); others travel plainly.
CODED_DTYPES = ACCUMULABLE_DTYPES
# cast= values: None is lossless; "bf16" rounds fp32 tensors to bf16 before coding (lossy).
CASTS = {None: None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
# The keyword arguments every adapter takes (HuffmanState, comm_codec.fsdp.register, the
# DeepSpeed section): the fields of CommConfig.
OPTIONS = CommConfig.fields()


def default_threads(local_world_size: int) -> int:
    """Return the codec threads a rank gets by default: its share of the cores torch uses.

    The codec runs while torch computes (buckets are coded during backward) and on the
    same cores, so more codec threads than the rank's share oversubscribe them. The
    share is the cores this process may run on divided by the ranks on this node,
    capped by torch's own thread count and numba's, and at least 1.

    Args:
        local_world_size: the ranks of the group that run on this node.

    Returns:
        The thread count.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    share = cores // max(1, local_world_size)
    return max(1, min(share, torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


class CodingEngine:
    """Books, warmup, the coding decision, the worker thread and statistics of one adapter.

    Args:
        process_group: the group the engine agrees and codes over (None: the world).
        config: the settings (:class:`~comm_codec.comm.config.CommConfig`); None: made
            from ``options``.
        writer: optional TensorBoard ``SummaryWriter``; scalars go under comm_codec/.
        name: the adapter's name in messages and logs.
        plain_name: what the auto decision calls the plain collectives.
        collectives: the names of the collectives the adapter runs (one statistics
            record each; with several, :meth:`stats` also reports each under its name).
        allow_cast: whether ``cast`` may be set.
        logger: where the engine's lines go (default: this module's; DeepSpeed's for its plugin).
        **options: :class:`~comm_codec.comm.config.CommConfig` fields (replacing
            ``config``'s).

    Raises:
        ConfigError: a bad setting (see :class:`~comm_codec.comm.config.CommConfig`), or
            a cast where ``allow_cast`` is False.
        CodebookError: a codebook path that is missing or not a codebook set.
        TypeError: an unknown option, codebooks of the wrong type.
    """

    __slots__ = (
        # what users tune
        "config",
        "process_group",
        "warmup_steps",
        "writer",
        # what the adapter is
        "name",
        "collectives",
        "log",
        # books and the decision
        "codebooks",
        "codec",
        "profiler",
        "switch",
        "refresh",
        "step",
        "coding",
        "verified",
        # the run (never pickled)
        "workspace",
        "_group",
        "_executor",
        "_pid",
        "_checked",
        "_node_threads",
        "_drift_sample",
        "_drift_pending",
        "_has_book",
        "_precompiling",
        "_torch_threads",
        # statistics
        "_stats",
    )

    def __init__(
        self,
        process_group=None,
        config: CommConfig | None = None,
        *,
        writer=None,
        name: str = "comm_codec",
        plain_name: str = "plain all-reduce",
        collectives: tuple[str, ...] = ("all_reduce",),
        allow_cast: bool = True,
        logger=None,
        **options,
    ):
        config = make_config(config, options, name)
        self.log = logger if logger is not None else log
        if config.cast is not None and not allow_cast:
            raise ConfigError(
                "cast",
                config.cast,
                f"None here: {name}'s collectives move weights and gradients that must arrive exactly",
            )
        self.config = config
        self.process_group = process_group
        self.warmup_steps = config.warmup_steps if config.mode != "never" else 0
        self.writer = writer
        self.name = name
        self.collectives = tuple(collectives)
        self.switch = AutoSwitch(
            config.mode,
            probe_steps=config.probe_steps,
            recheck_every=config.recheck_every,
            hysteresis=config.hysteresis,
            plain_name=plain_name,
        )
        self.refresh = BookRefresh(config.drift_every, config.refresh_threshold, config.refresh_steps)
        if config.mode == "never":
            self.codebooks = None
        else:
            self.codebooks = (
                config.codebooks if config.codebooks is not None or config.warmup_steps else CodebookSet.default()
            )
        self.profiler = WarmupProfiler() if self.warmup_steps else None
        self.step = 0
        self.coding = False
        self.verified = False
        self._stats = {c: CommStats() for c in self.collectives}
        self._init_run()
        self.codec = Codec(self.codebooks, threads=self.codec_threads()) if self.codebooks is not None else None
        self.log.info(
            "%s: mode=%s, warmup_steps=%d, cast=%s, books=%s",
            name,
            config.mode,
            self.warmup_steps,
            config.cast,
            "online" if self.codebooks is None else self.codebooks.digest[:12],
        )

    # the settings, read from the config
    @property
    def mode(self) -> str:
        """The configured mode ("auto", "always", "never")."""
        return self.config.mode

    @property
    def cast(self):
        """The configured cast (None or "bf16")."""
        return self.config.cast

    @property
    def min_bytes(self) -> int:
        """The per-rank input size below which a collective runs plainly."""
        return self.config.min_bytes

    @property
    def threads(self) -> int | None:
        """The configured codec threads (None: the rank's share of the node)."""
        return self.config.threads

    @property
    def log_every(self) -> int:
        """Steps between two traffic lines (0: never)."""
        return self.config.log_every

    def _init_run(self) -> None:
        self.workspace = Workspace()  # the worker's scratch buffers, reused from call to call
        self._group = None
        self._executor = None
        self._pid = None
        self._checked = False
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)  # torchrun's; else counted at the first step
        self._node_threads = default_threads(local) if local > 0 else None
        self._drift_sample = None
        self._drift_pending = False
        self._has_book = {}
        self._precompiling = None  # (start time, dtype names, future) of the background precompile
        self._torch_threads = torch.get_num_threads()

    # -- what adapters and users read ------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        """True while the books are still being profiled (steps before ``warmup_steps``)."""
        return self.mode != "never" and self.codebooks is None and self.step < self.warmup_steps

    @property
    def profiling(self) -> bool:
        """True while the profiler observes what is sent (warmup, or an open refresh window)."""
        return self.profiler is not None and (self.warming_up or self.refresh.refreshing)

    def count_plain(
        self, collective: str, tensor: torch.Tensor, group, *, record: str | None = None, dst: int | None = None
    ) -> None:
        """Count a plain call on ``tensor`` over ``group``: its wire bytes go into bytes_in and bytes_out alike.

        Args:
            collective: "all_reduce", "reduce_scatter" (``tensor``: the W-row input),
                "all_gather" (this rank's shard) or "reduce".
            tensor: the collective's input.
            group: the group it runs on.
            record: the statistics record to count it in (default: ``collective``'s).
            dst: the destination rank of a "reduce".
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        wire = plain_wire_bytes(collective, tensor.numel(), tensor.element_size(), world, rank, dst)
        self._stats[record or collective].add_plain(wire)

    def stats_for(self, collective: str) -> CommStats:
        """Return the live traffic counters of one of the adapter's collectives (by name), which its calls add to."""
        return self._stats[collective]

    def stats(self) -> TrafficStats:
        """Return traffic statistics and the coding decision: one typed record, the same fields for every adapter.

        Returns:
            A :class:`~comm_codec.comm.stats.TrafficStats`: bytes_in and bytes_out (what
            plain collectives would have sent over the whole run, and what was sent:
            plain calls count at ratio 1), ratio, bytes_saved; coded_bytes_in,
            coded_bytes_out, coded_ratio (the coded calls alone), plain_bytes; calls
            (coded) and raw_calls (plain); encode_seconds, decode_seconds, codec_seconds,
            comm_seconds; steps; warming_up, books, drift, refreshes; mode, coding (whether
            the current step codes), decision, switches, probes; and ``collectives``, one
            record per collective (with several, each also reads under its name, e.g.
            ``stats()["reduce_scatter"]``). ``stats()["bytes_in"]`` and ``as_dict()`` work.
        """
        parts = {name: s.record() for name, s in self._stats.items()}
        total = CommStats.sum(parts.values())
        books = self.codebooks.digest if self.codebooks is not None else None
        return TrafficStats(
            **total.as_dict(),
            steps=self.step,
            warming_up=self.warming_up,
            books=books,
            drift=self.refresh.drift,
            refreshes=self.refresh.refreshes,
            coding=self.coding,
            **self.switch.stats(),
            collectives=parts,
        )

    def reset_stats(self) -> None:
        """Zero the traffic counters (the step count, the books and the decision stay)."""
        for s in self._stats.values():
            s.reset()

    # -- the step ---------------------------------------------------------------------------
    def group(self):
        """Return the engine's twin of ``process_group`` (made, collectively, at the first call)."""
        if self._group is None:
            self._group = agreement.twin_group(self.process_group)
        return self._group

    def use_group(self, group) -> None:
        """Agree and code over ``group`` (an adapter's own twin of ``process_group``) instead of a new twin."""
        self._group = group

    def begin_step(self, like: torch.Tensor | None = None) -> bool:
        """Start a step on every rank; return whether it codes (collective).

        Call it at the same point of every step on every rank, while none of the
        engine's collectives is in flight: the engine's own agreements run here.

        Args:
            like: a tensor of the step (a CUDA one makes the agreements use its device).

        Returns:
            Whether this step's collectives code.

        Raises:
            AgreementError: on every rank alike: at the first step if the ranks'
                settings differ; whenever they hold different books or disagree at a
                decision.
        """
        group = self.group()
        device = agreement.collective_device(group, like)
        if not self._checked:
            self._check_settings(group, device)
            if like is not None:
                self.start_precompile([like.dtype])
        if self.mode == "never":
            self.coding = False
            return False
        if self.codebooks is None and self.step >= self.warmup_steps:
            self.swap_books(self._warmup_books(group, device), group, device)
        if self.codebooks is not None and not self.verified:
            agreement.check_same_books(self.codebooks, group, device)
            self.verified = True
            self.log.info("%s: coding with books %s", self.name, self.codebooks.digest[:12])
        if self._drift_pending:
            # The last step sampled the drift on its first coded tensor (0 where none was).
            sample, self._drift_sample, self._drift_pending = self._drift_sample, None, False
            if self.refresh.agree(sample or 0.0, self.step, group, device):
                self.profiler = WarmupProfiler()
        if self.refresh.swap_due(self.step):
            source = f"{self.name} refresh"
            self.swap_books(self.refresh.rebuild(self.profiler, group, self.step, source, device), group, device)
        decided = self.switch.decision
        self.coding = False if self.warming_up else self.switch.begin_step(self.step, group, device)
        if self.switch.decision is not decided and agreement.rank_of(self.process_group) == 0:
            self.log.info("%s: auto mode at step %d: %s", self.name, self.step, self.switch.decision["reason"])
        self._drift_pending = self.coding and self.refresh.due(self.step)
        return self.coding

    def end_step(self) -> None:
        """Count a finished step; log the traffic line and the TensorBoard scalars when due."""
        self.step += 1
        log_now = bool(self.log_every) and self.step % self.log_every == 0
        if not log_now and self.writer is None:
            return
        d = self.stats()
        if log_now and agreement.rank_of(self.process_group) == 0:
            self.log.info(
                "%s step %d (%s): %s", self.name, self.step, "coding" if self.coding else "plain", traffic_line(d)
            )
        if self.writer is not None:
            for key in LOGGED:
                self.writer.add_scalar(f"comm_codec/{key}", d[key], self.step)
            self.writer.add_scalar("comm_codec/coding", float(self.coding), self.step)

    def dispatch(
        self,
        collective: str,
        tensor: torch.Tensor,
        group,
        *,
        numel_per_rank: int,
        kind: str,
        coded,
        plain,
        reduced_kind: str | None = None,
        record: str | None = None,
        dst: int | None = None,
        allowed: bool = True,
    ) -> None:
        """Run one collective call: observe, decide, code or send plainly, count.

        Every adapter's collectives go through here, so what the profiler observes and
        what is counted does not depend on the adapter.

        Args:
            collective: "all_reduce", "reduce_scatter", "all_gather" or "reduce" (how
                :meth:`count_plain` counts a plain call).
            tensor: the collective's input (the W-row input of a reduce-scatter).
            group: the group it runs on.
            numel_per_rank: the elements each rank contributes (``min_bytes`` applies to them).
            kind: the books' kind of ``tensor``.
            coded: called with the statistics record when the call codes; runs the coded collective.
            plain: called without arguments otherwise; runs the framework's own collective.
            reduced_kind: the kind of ``tensor`` after the call, observed then (an
                all-reduce's result), or None.
            record: the statistics record (default: ``collective``'s).
            dst: the destination rank of a "reduce".
            allowed: False sends plainly whatever the step decided (a kind or device the
                adapter does not code).
        """
        observed = tensor.dtype in CODED_DTYPES
        if observed:
            self.observe(tensor, kind)
        if allowed and self.codes(tensor, numel_per_rank, kind):
            if kind == "gradient":
                self.sample_drift(tensor, kind)
            self.precompile_for(tensor)
            coded(self.stats_for(record or collective))
        else:
            plain()
            self.count_plain(collective, tensor, group, record=record, dst=dst)
        if observed and reduced_kind is not None:
            self.observe(tensor, reduced_kind)

    def keep_torch_threads(self) -> None:
        """Put back torch's thread count as it was when the engine was made, if the codec changed it.

        numba's OpenMP layer may reset the OpenMP thread count torch's intra-op pool
        shares: left alone, that oversubscribes the ranks' cores and changes the summation
        order, hence the bits, of the model's own matmuls. Adapters whose framework code
        runs between coded calls (DeepSpeed) call it after each.
        """
        if torch.get_num_threads() != self._torch_threads:
            torch.set_num_threads(self._torch_threads)

    def codes(self, tensor: torch.Tensor, numel_per_rank: int, kind: str) -> bool:
        """Whether a collective on ``tensor`` codes now: a coded step, a dtype, size and book that pay.

        Args:
            tensor: the collective's input.
            numel_per_rank: the elements each rank contributes (``min_bytes`` applies to them).
            kind: the books' kind ("gradient", "weight", ...).
        """
        if not self.coding or self.codec is None or not self.codable(tensor, numel_per_rank):
            return False
        dtype = self.cast_dtype(tensor) or tensor.dtype
        key = (kind, dtype)
        if key not in self._has_book:
            try:
                self.codebooks.group(kind, dtype, 0)
                self._has_book[key] = True
            except ValueError:  # books profiled on other dtypes: this one travels plainly
                self._has_book[key] = False
        return self._has_book[key]

    def codable(self, tensor: torch.Tensor, numel_per_rank: int) -> bool:
        """Whether the coded collectives can take ``tensor`` at all: dtype, device and size."""
        return (
            tensor.dtype in CODED_DTYPES
            and tensor.device.type in ("cpu", "cuda")
            and numel_per_rank * tensor.element_size() >= self.min_bytes
        )

    def cast_dtype(self, tensor: torch.Tensor):
        """The dtype ``tensor`` is coded in when it is not its own (``cast`` on fp32), else None."""
        cast = CASTS[self.cast]
        return cast if cast is not None and tensor.dtype == torch.float32 else None

    def observe(self, tensor: torch.Tensor, kind: str) -> None:
        """Profile a tensor as it will be coded (cast first where the cast applies), when profiling."""
        if not self.profiling:
            return
        cast = self.cast_dtype(tensor)
        self.profiler.observe(tensor.to(cast) if cast is not None else tensor, kind)

    def sample_drift(self, tensor: torch.Tensor, kind: str = "gradient") -> None:
        """Measure the books' loss on the step's first coded tensor, when the step samples drift."""
        if self._drift_pending and self._drift_sample is None:
            self._drift_sample = self.refresh.measure(tensor, self.codebooks, kind)

    def start_precompile(self, dtypes) -> None:
        """Start loading (or, with an empty cache, compiling) the kernels these dtypes are coded with, in the background.

        Adapters call it where they first see the model (FSDP2's ``compress``, the
        DeepSpeed plugin's install, the DDP hook's first bucket), so that the compile runs
        during warmup instead of stalling the first coded step. Once per engine; dtypes
        that are never coded are left out.

        Args:
            dtypes: the torch dtypes of the tensors the adapter will code.
        """
        if self._precompiling is not None or self.mode == "never":
            return
        cast = CASTS[self.cast]
        coded = sorted(
            {cast if cast is not None and d == torch.float32 else d for d in dtypes if d in CODED_DTYPES}, key=str
        )
        if not coded:
            return
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="comm_codec_precompile")
        # Books do not change the kernels; one thread, since training runs beside it.
        future = pool.submit(precompile_kernels, Codec(threads=1), coded)
        pool.shutdown(wait=False)
        self._precompiling = (time.monotonic(), ", ".join(str(d).replace("torch.", "") for d in coded), future)

    def precompile_for(self, tensor: torch.Tensor) -> None:
        """Load the codec's kernels for the dtype ``tensor`` is coded in, before it is timed.

        Waits for the background precompile if it still runs: silently for 2 s, then with
        a WARNING that says what it waits for and since when.
        """
        if tensor.device.type != "cpu":
            return
        if self._precompiling is not None:
            started, names, future = self._precompiling
            try:
                future.result(timeout=2.0)
            except concurrent.futures.TimeoutError:
                self.log.warning(
                    "%s: the first coded step waits for the codec's kernels (%s), compiling for %.0f s "
                    "so far (numba caches them: `comm-codec precompile` once after installing skips this)",
                    self.name,
                    names,
                    time.monotonic() - started,
                )
                future.result()
                self.log.warning(
                    "%s: the codec's kernels (%s) are ready after %.0f s", self.name, names, time.monotonic() - started
                )
            self._precompiling = None
        self.codec.precompile([self.cast_dtype(tensor) or tensor.dtype])

    def swap_books(self, books: CodebookSet, group=None, device=None) -> None:
        """Check that every rank holds ``books`` (collective) and code with them from now on."""
        agreement.check_same_books(books, group if group is not None else self.group(), device)
        self.codebooks, self.codec, self.profiler = books, Codec(books, threads=self.codec_threads()), None
        self.verified = True
        self._has_book.clear()
        self.log.info("%s: coding with books %s from step %d", self.name, books.digest[:12], self.step)

    def codec_threads(self) -> int | None:
        """The user's thread count, else the rank's share of the node (once the first step found it)."""
        return self.threads if self.threads is not None else self._node_threads

    # -- the worker -------------------------------------------------------------------------
    def submit(self, fn, like: torch.Tensor | None = None) -> concurrent.futures.Future:
        """Run ``fn`` on the engine's worker thread, after every job submitted before it.

        Args:
            fn: the work, a callable without arguments.
            like: the tensor ``fn`` works on; a CUDA one makes the worker wait on the
                caller's stream first (it may still be being written) and synchronize
                its own before the future resolves.

        Returns:
            A future of what ``fn`` returns (or raises).
        """
        if self._executor is None or self._pid != os.getpid():  # a forked child needs its own thread
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="comm_codec")
            self._pid = os.getpid()
        if like is not None and like.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(like.device))
            return self._executor.submit(on_cuda_worker, like.device, ready, fn)
        return self._executor.submit(fn)

    def call(self, fn, tensor: torch.Tensor, async_op: bool):
        """Run a collective on the worker; return a :class:`FutureWork` when async, else wait for it.

        Args:
            fn: the collective, a callable without arguments.
            tensor: the tensor it works on (see :meth:`submit`).
            async_op: return at once with a ``Work`` the framework waits on.

        Returns:
            A :class:`FutureWork` when ``async_op``, else None (done).

        Raises:
            What ``fn`` raised, when not ``async_op`` (else from ``wait()``).
        """
        future = self.submit(fn, like=tensor)
        if async_op:
            return FutureWork(future)
        future.result()
        return None

    def step_on_worker(self, end: bool, begin: bool) -> None:
        """End the current step and/or begin the next one on the worker, after every collective queued before.

        For adapters whose collectives run on the worker: the engine's agreements then use
        the group in the same order as those collectives on every rank. Waits until done.

        Raises:
            What :meth:`begin_step` raises.
        """

        def run():
            if end:
                self.end_step()
            if begin:
                self.begin_step()

        self.submit(run).result()

    def shutdown(self) -> None:
        """Let the worker thread finish what was submitted and stop it (a later submit starts a new one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- pickling: settings, books, decision, counters; no group, worker or writer -------------
    def __getstate__(self):
        return {
            "settings": {name: getattr(self.config, name) for name in CommConfig.fields() if name != "codebooks"},
            "warmup_steps": self.warmup_steps,
            "name": self.name,
            "collectives": self.collectives,
            "step": self.step,
            "coding": self.coding,
            "switch": self.switch,
            "refresh": self.refresh,
            "codebooks": self.codebooks.to_dict() if self.codebooks is not None else None,
            # Warmup statistics travel too: a state saved at the end of warmup builds its
            # books from them at the first step after resuming.
            "profiler": self.profiler,
            "stats": {name: s.__getstate__() for name, s in self._stats.items()},
        }

    def __setstate__(self, state):
        self.config = CommConfig(**state["settings"])
        self.warmup_steps = state["warmup_steps"]
        self.process_group = None
        self.writer = None
        self.log = log
        self.name, self.collectives = state["name"], tuple(state["collectives"])
        self.step, self.coding = state["step"], state["coding"]
        self.switch, self.refresh = state["switch"], state["refresh"]
        self.refresh.until = None  # a resumed run measures anew
        books = state["codebooks"]
        self.codebooks = CodebookSet.from_dict(books, f"<pickled {self.name}>") if books is not None else None
        self.profiler = state["profiler"]
        self.verified = False
        self._stats = {}
        for name, counters in state["stats"].items():
            self._stats[name] = CommStats()
            self._stats[name].__setstate__(counters)
        self._init_run()
        self.codec = Codec(self.codebooks, threads=self.codec_threads()) if self.codebooks is not None else None

    # -- internal -----------------------------------------------------------------------------
    def _shared_settings(self) -> dict:
        """The settings that change which collectives a rank issues (and the step it is at)."""
        return {
            **self.config.shared(),
            "warmup_steps": self.warmup_steps,
            "step": self.step,
            "books": "online" if self.codebooks is None else "fixed",
        }

    def _check_settings(self, group, device) -> None:
        hosts = agreement.check_same_settings(self.name, self._shared_settings(), group, device)
        self._node_threads = default_threads(agreement.ranks_per_node(hosts))
        if self.codec is not None:
            self.codec.threads = self.codec_threads()
        self._checked = True

    def _warmup_books(self, group, device) -> CodebookSet:
        if self.profiler is None or not self.profiler.kinds():
            raise AgreementError(
                f"{self.name}: warmup ended without observing any tensor of a float dtype; nothing to build books from"
            )
        return agreement.build_books(
            self.profiler, group, {"source": f"online {self.name} warmup", "steps": self.warmup_steps}, device
        )


class FutureWork(dist.Work):
    """A ``torch.distributed.Work`` over a worker's future: ``wait()`` returns when the collective is done.

    Frameworks that expect a ``Work`` from an asynchronous collective (FSDP2's all-gather,
    DeepSpeed's parameter fetch) wait on it before they read the output; the decode runs
    on the engine's worker meanwhile.

    Args:
        future: the future :meth:`CodingEngine.submit` returned.
    """

    def __init__(self, future: concurrent.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        """Wait until the collective is done; raise what it raised.

        Args:
            timeout: a ``datetime.timedelta`` or seconds; None or zero waits as long as
                it takes (torch's ``Work.wait`` default).

        Returns:
            True.

        Raises:
            CollectiveError: not done within ``timeout``.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        try:
            self._future.result(timeout=seconds if seconds else None)
        except concurrent.futures.TimeoutError:
            raise CollectiveError(f"comm_codec collective not done after {seconds:g} s (Work.wait timeout)") from None
        return True

    def is_completed(self) -> bool:
        """Whether the collective is done."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the collective is done without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self):
        """The collective's exception, or None (also while it runs)."""
        return self._future.exception() if self._future.done() else None
