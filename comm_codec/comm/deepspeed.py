"""DeepSpeed plugin: ZeRO 0-3 gradient reduction (and ZeRO-3 parameter all-gathers) with Huffman-coded frames.

Add a ``"comm_codec"`` section to the DeepSpeed config and call
:func:`initialize` where you called ``deepspeed.initialize`` (same arguments, same
return values)::

    {"train_micro_batch_size_per_gpu": 8,
     "zero_optimization": {"stage": 2},
     "bf16": {"enabled": true},
     "comm_codec": {"enabled": true, "codebooks": "online", "warmup_steps": 5}}

    import comm_codec.deepspeed as ccds
    engine, optimizer, loader, scheduler = ccds.initialize(model=model, config="ds_config.json",
                                                           model_parameters=model.parameters())
    ...
    ccds.stats(engine)   # same dict as HuffmanState.stats(): bytes_in, bytes_out, ratio, ...

Code that builds the engine itself calls :func:`install` on it.

**The seam.** DeepSpeed funnels every dense gradient reduction of ZeRO stages 0-2 through
three small methods that flatten a bucket, scale it and issue one collective; the plugin
replaces each with a copy of DeepSpeed 0.19's own body in which only that collective is
swapped (so DeepSpeed's pre-/post-scaling, ``gradient_predivide_factor``,
``communication_data_type`` and ``gradient_allreduce_op`` keep their meaning):

* ``DeepSpeedEngine.allreduce_bucket`` (ZeRO 0, and the BF16_Optimizer that ZeRO 1 uses
  with bf16 weights and fp32 gradient accumulation): ``all_reduce`` becomes
  :func:`comm_codec.collectives.all_reduce` (two-phase, coded, bit-identical on every rank).
* ``DeepSpeedZeroOptimizer.allreduce_bucket`` (ZeRO 1 and 2). With ``rank=None`` -- the
  default ``use_multi_rank_bucket_allreduce`` path, where ``average_tensor`` all-reduces
  the whole bucket and each rank keeps its partition -- the coded all-reduce. With a
  destination rank (``"use_multi_rank_bucket_allreduce": false``: each slice of the bucket
  is reduced to the rank that owns its partition) ``reduce`` becomes a coded reduce: every
  other rank sends the slice as one frame to the owner, which sums all ranks' slices in
  rank order in float32. Each rank then sends ``(W-1)/W`` of the bucket, coded, as a
  reduce-scatter would; only the owner ends with the sum, as with ``dist.reduce``.
* ``DeepSpeedZeroOptimizer.gradient_reduction_w_predivide`` (``"reduce_scatter": false``):
  ``all_reduce`` becomes the coded one.

Sums are rank-order float32 sums rounded once to the buffer dtype, so with two ranks the
results equal DeepSpeed's bit for bit; with more they differ in the last bit (summation
order), as two NCCL algorithms do. Norm, overflow and parameter all-gather traffic stays
uncompressed at stages 0-2; ZeRO-3's parameter all-gathers and gradient reduce-scatters
are :mod:`comm_codec.comm.zero3`'s seams. Offload to the CPU changes nothing on the wire
and is covered. Unsupported setups (ZeRO++ quantization and hpZ, NVMe offload, pipeline
or hybrid engines, MoE, sequence or tensor parallelism, sparse embeddings, non-CPU
devices, DeepSpeed other than 0.19.x) are refused at :func:`initialize` / :func:`install` with a message
naming the feature, instead of running uncompressed while claiming to compress.

**Warmup.** ``"warmup_steps": N`` reduces plainly for N optimizer steps while a
:class:`~comm_codec.books.profiler.WarmupProfiler` observes the buckets, then builds the books
from statistics summed over the data-parallel group (identical by construction, checked
by digest), exactly as ``HuffmanState(warmup_steps=N)`` does: the plugin runs the same
:class:`~comm_codec.comm.engine.CodingEngine`. (``"codebooks": "online"`` says the same
explicitly; without warmup the shipped books, or a saved file's, code from the first
step.)

**Mode.** ``"mode": "auto"`` (the default) codes only where that measures faster on this
run, ``"always"`` codes every step after warmup, ``"never"`` leaves DeepSpeed's
reduction alone; ``recheck_every``, ``probe_steps`` and ``hysteresis`` tune auto as in
:class:`comm_codec.ddp.HuffmanState`. A step's mode is decided at its first reduction,
the same on every rank.
"""

from __future__ import annotations

import functools
import inspect
import os

try:
    import deepspeed
    import deepspeed.comm as ds_dist
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"comm_codec.deepspeed needs DeepSpeed 0.19.x, which did not import ({_exc}): "
        "pip install 'comm_codec[deepspeed]'"
    ) from _exc

import torch

from ..core.codebooks import CodebookSet
from ..core.errors import ConfigError
from ..core.logs import watch_deepspeed
from . import collectives
from ._deepspeed_config import (
    DEEPSPEED_ONLY,
    SECTION,
    STAGE_KINDS,
    CommCodecConfig,
    check_config,
    check_engine,
    check_zero,
    json_text,
    load_config_file,
    parse_config,
    parse_section,
    section_error,
    zero_section,
)
from ._deepspeed_log import PluginLog
from .config import CommConfig, make_config
from .engine import CODED_DTYPES, CodingEngine
from .stats import LOGGED, TrafficStats
from .zero3 import SEAMS as ZERO3_SEAMS
from .zero3 import Zero3Seams, seam_parameters

__all__ = [
    "CommCodecConfig",
    "DEEPSPEED_ONLY",
    "DeepSpeedState",
    "SUPPORTED_DEEPSPEED",
    "initialize",
    "install",
    "parse_config",
    "register",
    "stats",
]

# Inside DeepSpeed, the plugin's lines go where DeepSpeed's own go (shown from the ds_config's
# "log_level"), or to comm_codec's verbosity switch where DeepSpeed's level hides them.
ds_logger = deepspeed.utils.logger
plugin_log = PluginLog(ds_logger)
watch_deepspeed()  # an engine built without the plugin warns at its first backward when its config has a section

SUPPORTED_DEEPSPEED = "0.19"  # the major.minor whose reduction methods the plugin copies

# The DeepSpeed methods replaced, with the parameters their 0.19 bodies (copied below) take.
_SEAMS = {
    ("runtime.engine", "DeepSpeedEngine", "allreduce_bucket"): ["self", "bucket", "dp_group", "dp_world_size"],
    ("runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "allreduce_bucket"): [
        "self",
        "bucket",
        "communication_data_type",
        "rank",
        "log",
        "divide",
        "process_group",
    ],
    ("runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "gradient_reduction_w_predivide"): [
        "self",
        "tensor",
        "communication_data_type",
    ],
}


# -- scope checks -------------------------------------------------------------------------
def _check_version() -> None:
    version = deepspeed.__version__
    if ".".join(version.split(".")[:2]) != SUPPORTED_DEEPSPEED:
        raise RuntimeError(
            f"comm_codec.deepspeed supports DeepSpeed {SUPPORTED_DEEPSPEED}.x (it replaces version-specific "
            f"gradient-reduction methods); found DeepSpeed {version}. Install a supported one: "
            "pip install 'comm_codec[deepspeed]'"
        )
    import importlib

    for (module, cls, method), params in {**_SEAMS, **ZERO3_SEAMS}.items():
        owner = importlib.import_module(f"deepspeed.{module}")
        owner = getattr(owner, cls, None) if cls is not None else owner
        fn = getattr(owner, method, None)
        if seam_parameters(fn) != params:
            where = f"{cls}.{method}" if cls is not None else f"deepspeed.{module}.{method}"
            raise RuntimeError(
                f"DeepSpeed {version} changed {where} (expected parameters {params}); "
                "comm_codec.deepspeed cannot install safely into it"
            )


# -- the plugin ---------------------------------------------------------------------------
class DeepSpeedState:
    """The codec installed in one DeepSpeed engine: what :func:`register` returns.

    Attributes:
        config: the parsed ``"comm_codec"`` section.
        coder: the :class:`~comm_codec.comm.engine.CodingEngine` (books, mode, statistics).
        engine: the DeepSpeed engine.
        stage: its ZeRO stage.
        kinds: the traffic coded ("gradient"; and "weight" at ZeRO-3).
    """

    __slots__ = ("config", "coder", "engine", "stage", "kinds", "zero3", "_step_open", "_patched")

    def __init__(self, engine, config: CommCodecConfig, stage: int):
        self.stage = stage
        self.kinds = tuple(config.kinds or STAGE_KINDS[stage])
        if config.codebooks != "online":
            books = config.config.codebooks
            _check_books(
                books if books is not None else CodebookSet.default(),
                config.codebooks,
                _coded_dtypes(engine, stage, self.kinds),
            )
        zero3 = stage == 3
        try:
            self.coder = CodingEngine(
                engine.data_parallel_group,
                config.config,
                name="comm_codec.deepspeed",
                allow_cast=not zero3,
                logger=plugin_log,
                plain_name="plain reduce-scatter/all-gather" if zero3 else "plain all-reduce",
                collectives=("reduce_scatter", "all_gather") if zero3 else ("all_reduce",),
            )
        except ConfigError as exc:
            raise section_error(exc.key, f"{json_text(exc.value)}; allowed: {exc.allowed}") from None
        # Creating a group is collective: here, where every rank installs.
        self.zero3 = Zero3Seams(self.coder, engine, self.kinds) if zero3 else None
        if not zero3:
            self.coder.group()
        self.config = config
        self.engine = engine
        self._step_open = False
        self._patched: list = []

    def stats(self) -> TrafficStats:
        """Return the traffic record (:class:`~comm_codec.comm.stats.TrafficStats`), as every state's ``stats()``."""
        return self.coder.stats()

    def patch(self, obj, name: str, value) -> None:
        """Set ``obj.name`` to ``value``, remembering what :meth:`detach` puts back."""
        self._patched.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, value)

    def detach(self) -> None:
        """Give the engine back DeepSpeed's own reduction (and fetch, at ZeRO-3); the statistics stay readable."""
        patched = self._patched + (self.zero3.patched if self.zero3 is not None else [])
        for obj, name, before in reversed(patched):
            if before is None:
                vars(obj).pop(name, None)  # the class's method shows through again
            else:
                setattr(obj, name, before)
        self._patched = []
        if self.zero3 is not None:
            self.zero3.patched = []
        if getattr(self.engine, "_comm_codec", None) is self:
            self.engine._comm_codec = None
        self.coder.shutdown()

    def reduce(self, tensor: torch.Tensor, group, dst: int | None = None) -> None:
        """Sum ``tensor`` over ``group`` in place: on every rank, or only on rank ``dst``.

        The collective DeepSpeed would have issued (``all_reduce``, or ``reduce`` to the
        group rank ``dst``), coded once warmup is over; buckets the codec cannot code or
        that are too small to pay go plainly, exactly as DeepSpeed sends them.
        """
        coder = self.coder
        try:
            if not self._step_open:  # the step's first reduction: settings check, books, mode
                self._step_open = True
                coder.begin_step()
            if dst is None:

                def plain():
                    ds_dist.all_reduce(tensor, group=group)

                def coded(stats):
                    collectives.all_reduce(
                        tensor,
                        coder.codec,
                        group,
                        cast=coder.cast_dtype(tensor),
                        stats=stats,
                        workspace=coder.workspace,
                    )
            else:

                def plain():
                    ds_dist.reduce(tensor, ds_dist.get_global_rank(group, dst), group=group)

                def coded(stats):
                    collectives.reduce(
                        tensor,
                        dst,
                        coder.codec,
                        group,
                        cast=coder.cast_dtype(tensor),
                        stats=stats,
                        workspace=coder.workspace,
                    )

            coder.dispatch(
                "all_reduce" if dst is None else "reduce",
                tensor,
                group,
                numel_per_rank=tensor.numel(),
                kind="gradient",
                coded=coded,
                plain=plain,
                record="all_reduce",
                dst=dst,
                reduced_kind="reduced_gradient" if dst is None else None,
                allowed=tensor.device.type == "cpu",
            )
        finally:
            coder.keep_torch_threads()

    def end_of_step(self) -> None:
        coder = self.coder
        if self.zero3 is not None:
            self.zero3.close_step()
        else:
            coder.end_step()
        self._step_open = False
        engine = self.engine
        monitor = getattr(engine, "monitor", None)
        if (
            self.config.monitor
            and monitor is not None
            and monitor.enabled
            and self.config.log_every
            and coder.step % self.config.log_every == 0
            and engine.global_rank == 0
        ):
            d = coder.stats()
            monitor.write_events([(f"comm_codec/{key}", d[key], engine.global_samples) for key in LOGGED])


# -- the replaced DeepSpeed methods (0.19 bodies; only the collective differs) ------------
def _engine_allreduce_bucket(plugin, engine, bucket, dp_group, dp_world_size=None):
    tensor = engine.flatten(bucket)
    tensor_to_allreduce = tensor
    if engine.communication_data_type != tensor.dtype:
        tensor_to_allreduce = tensor.to(engine.communication_data_type)
    if dp_world_size is None:
        dp_world_size = ds_dist.get_world_size(group=dp_group)
    if not engine.gradient_average:
        plugin.reduce(tensor_to_allreduce, dp_group)
    elif engine.postscale_gradients():
        if engine.gradient_predivide_factor() != 1.0:
            tensor_to_allreduce.mul_(1.0 / engine.gradient_predivide_factor())
        plugin.reduce(tensor_to_allreduce, dp_group)
        if engine.gradient_predivide_factor() != dp_world_size:
            tensor_to_allreduce.mul_(engine.gradient_predivide_factor() / dp_world_size)
    else:
        tensor_to_allreduce.mul_(1.0 / dp_world_size)
        plugin.reduce(tensor_to_allreduce, dp_group)
    if engine.communication_data_type != tensor.dtype and tensor is not tensor_to_allreduce:
        tensor.copy_(tensor_to_allreduce)
    return tensor


def _zero_allreduce_bucket(
    plugin, opt, bucket, communication_data_type, rank=None, log=None, divide=True, process_group=None
):
    from deepspeed.runtime.zero import stage_1_and_2

    tensor = opt.flatten(bucket)
    process_group = opt.dp_process_group if process_group is None else process_group
    tensor_to_allreduce = tensor
    if stage_1_and_2.pg_correctness_test or opt.sequence_parallel_size > 1:
        communication_data_type = torch.float32
    if communication_data_type != tensor.dtype:
        tensor_to_allreduce = tensor.to(communication_data_type)
    if divide and opt.gradient_average:
        tensor_to_allreduce.div_(ds_dist.get_world_size(group=process_group) / float(opt.sequence_parallel_size))
    plugin.reduce(tensor_to_allreduce, process_group, rank)
    if communication_data_type != tensor.dtype and tensor is not tensor_to_allreduce:
        if rank is None or rank == ds_dist.get_rank(group=process_group):
            tensor.copy_(tensor_to_allreduce)
    return tensor_to_allreduce


def _zero_gradient_reduction_w_predivide(plugin, opt, tensor, communication_data_type):
    if tensor.size().numel() == 0:
        return tensor
    dp_world_size = ds_dist.get_world_size(group=opt.dp_process_group)
    tensor_to_allreduce = tensor
    if communication_data_type != tensor.dtype:
        tensor_to_allreduce = tensor.to(communication_data_type)
    if not opt.gradient_average:
        plugin.reduce(tensor_to_allreduce, opt.dp_process_group)
    elif opt.postscale_gradients:
        if opt.gradient_predivide_factor != 1.0:
            tensor_to_allreduce.mul_(1.0 / opt.gradient_predivide_factor)
        plugin.reduce(tensor_to_allreduce, opt.dp_process_group)
        if opt.gradient_predivide_factor != dp_world_size:
            tensor_to_allreduce.mul_(
                opt.gradient_predivide_factor / (dp_world_size / float(opt.sequence_parallel_size))
            )
    else:
        tensor_to_allreduce.div_(dp_world_size / float(opt.sequence_parallel_size))
        plugin.reduce(tensor_to_allreduce, opt.dp_process_group)
    if communication_data_type != tensor.dtype and tensor is not tensor_to_allreduce:
        tensor.copy_(tensor_to_allreduce)
    return tensor_to_allreduce


def _coded_dtypes(engine, stage: int, kinds) -> dict:
    """The dtypes each coded kind travels in: the communication dtype for gradients, the parameters' for weights."""
    dtypes = {"gradient": {engine.communication_data_type}}
    if stage == 3 and "weight" in kinds:
        dtypes["weight"] = {p.dtype for p in engine.module.parameters()}
    return {k: sorted((d for d in v if d in CODED_DTYPES), key=str) for k, v in dtypes.items() if k in kinds}


def _check_books(books: CodebookSet, source: str, wanted: dict) -> None:
    """Refuse fixed books that hold no book for a (kind, dtype) this engine codes: it would travel plainly."""
    held = sorted({f"{k}/{d}" for (k, d, _), _ in books.groups()})
    for kind, dtypes in wanted.items():
        for dtype in dtypes:
            try:
                books.group(kind, dtype, 0)
            except ValueError:
                name = str(dtype).replace("torch.", "")
                raise section_error(
                    "codebooks",
                    f"the books {source!r} hold no {kind!r} book for {name} (this engine sends "
                    f"{kind}s as {name}; the books hold {', '.join(held)}); allowed: books profiled "
                    f'on {name} {kind}s, "default" or "online" (with warmup_steps)',
                ) from None


def _wrap_step(plugin, step):
    @functools.wraps(step)
    def wrapped(*args, **kwargs):
        before = plugin.engine.global_steps
        result = step(*args, **kwargs)
        if plugin.engine.global_steps != before:  # an optimizer step (accumulation boundary)
            plugin.end_of_step()
        return result

    return wrapped


# -- public -------------------------------------------------------------------------------
def install(engine, config=None) -> DeepSpeedState:
    """Install the codec into an existing engine's gradient reduction (:func:`register` with a section).

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (from ``deepspeed.initialize``).
        config: the ``"comm_codec"`` section (dict or :class:`CommCodecConfig`), or None
            to read it from the engine's DeepSpeed config.

    Returns:
        The :class:`DeepSpeedState` (``.stats()``, ``.detach()``).

    Raises:
        ConfigError: no enabled section, bad values, or a setup the plugin does not
            support (named in the message).
        CodebookError: a codebook file that cannot be loaded.
        RuntimeError: an unsupported DeepSpeed version, or the plugin already installed.
    """
    _check_version()
    if getattr(engine, "_comm_codec", None) is not None:
        raise RuntimeError("comm_codec is already installed in this engine")
    if config is None:
        section = parse_config(engine.config if isinstance(engine.config, dict) else engine._config._param_dict)
    elif isinstance(config, dict):
        section = parse_config({SECTION: config})
    else:
        section = parse_config(config)
    if section is None or not section.enabled:
        raise section_error(
            "",
            f'the DeepSpeed config has no enabled "{SECTION}" section; add '
            f'"{SECTION}": {{"enabled": true}} or pass config=',
        )
    check_engine(engine)
    raw = engine.config if isinstance(engine.config, dict) else engine._config._param_dict
    stage = check_zero(zero_section(raw) | {"stage": engine.zero_optimization_stage()}, section)
    plugin = DeepSpeedState(engine, section, stage)
    plugin.coder.start_precompile({p.dtype for p in engine.module.parameters()} | {engine.communication_data_type})
    plugin.patch(engine, "allreduce_bucket", functools.partial(_engine_allreduce_bucket, plugin, engine))
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer) and stage < 3:
        opt = engine.optimizer
        plugin.patch(opt, "allreduce_bucket", functools.partial(_zero_allreduce_bucket, plugin, opt))
        plugin.patch(
            opt, "gradient_reduction_w_predivide", functools.partial(_zero_gradient_reduction_w_predivide, plugin, opt)
        )
    plugin.patch(engine, "step", _wrap_step(plugin, engine.step))
    engine._comm_codec = plugin
    if engine.global_rank == 0:
        plugin_log.info(
            "comm_codec installed: ZeRO stage %d, %s, books %s, warmup %d, cast %s, mode %s, coding %s",
            stage,
            type(engine.optimizer).__name__,
            section.codebooks,
            section.warmup_steps,
            section.cast,
            section.mode,
            "/".join(plugin.kinds),
        )
    return plugin


def register(
    engine, *, config: CommConfig | None = None, kinds=None, monitor: bool = True, **options
) -> DeepSpeedState:
    """Code the gradient reduction (and ZeRO-3's parameter fetch) of a DeepSpeed engine; return its state.

    The same keywords as ``HuffmanState`` and ``comm_codec.fsdp.register``, plus the
    DeepSpeed-only ``kinds`` and ``monitor`` (see :class:`CommCodecConfig`). Without any,
    the engine's own ``"comm_codec"`` config section is used when it has one.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine``, on every rank.
        config: a :class:`~comm_codec.comm.config.CommConfig` (keywords beside it replace
            its fields).
        kinds: the traffic to code ("gradient", "weight"); None: what the stage moves.
        monitor: also write comm_codec/* scalars to DeepSpeed's monitor.
        **options: :class:`~comm_codec.comm.config.CommConfig` settings.

    Returns:
        The :class:`DeepSpeedState`.

    Raises:
        ConfigError, CodebookError, RuntimeError: as :func:`install`.
        TypeError: an unknown option.
    """
    if config is None and not options and kinds is None and monitor:
        raw = engine.config if isinstance(engine.config, dict) else engine._config._param_dict
        section = parse_config(raw)
        if section is not None and section.enabled:
            return install(engine, section)
    config = make_config(config, options, "comm_codec.deepspeed.register")
    section = CommCodecConfig(config=config, codebooks=_source(config), kinds=_kinds(kinds), monitor=bool(monitor))
    return install(engine, section)


def _source(config: CommConfig) -> str:
    if config.codebooks is not None:
        return f"<books {config.codebooks.digest[:12]}>"
    return "online" if config.warmup_steps else "default"


def _kinds(kinds):
    if kinds is None:
        return None
    parsed = parse_section({"kinds": list(kinds)})
    return parsed.kinds


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` plus the ``"comm_codec"`` config section.

    Takes the same arguments and returns the same ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. The section is validated, and what the config
    or model already shows to be unsupported is refused, before DeepSpeed builds the
    engine; without an enabled section this is plain ``deepspeed.initialize``.

    Raises:
        ValueError, RuntimeError: as :func:`install`.
    """
    _check_version()
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    params = bound.arguments
    config = params.get("config") or params.get("config_params")
    ds_args = params.get("args")
    if config is None and getattr(ds_args, "deepspeed_config", None) is not None:
        config = ds_args.deepspeed_config
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        config = load_config_file(config)
    section = None
    if isinstance(config, dict):
        section = parse_config(config)
        if section is not None and section.enabled:
            check_config(config, section, params.get("model"))
    result = deepspeed.initialize(*args, **kwargs)
    engine = result[0]
    if section is None:  # a config DeepSpeed read itself (base64...): look at what it parsed
        section = parse_config(engine.config if isinstance(engine.config, dict) else engine._config._param_dict)
    if section is not None and section.enabled:
        install(engine, section)
    elif section is not None:
        engine._comm_codec_disabled = True  # stats() reports a disabled plugin instead of refusing
    return result


def stats(engine) -> TrafficStats:
    """Return the plugin's traffic record: ``register(engine).stats()``, kept for the contract.

    An engine whose config has a ``"comm_codec"`` section with ``"enabled": false``
    gets a record with ``"enabled": False`` and every counter 0.

    Raises:
        ValueError: the engine was not built by :func:`initialize` with a ``"comm_codec"``
            section, nor given the plugin by :func:`install`.
    """
    plugin = getattr(engine, "_comm_codec", None)
    if plugin is None and getattr(engine, "_comm_codec_disabled", False):
        return _disabled_stats()
    if plugin is None:
        raise ValueError(
            "this engine has no comm_codec plugin; build it with comm_codec.deepspeed.initialize "
            'and an enabled "comm_codec" config section, or call comm_codec.deepspeed.install'
        )
    return plugin.stats()


def _disabled_stats() -> TrafficStats:
    """The stats of a ``"comm_codec"`` section with ``"enabled": false``: nothing coded, nothing counted."""
    return TrafficStats(enabled=False, mode="never")
