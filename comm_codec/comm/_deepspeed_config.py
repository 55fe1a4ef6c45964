"""The ``"comm_codec"`` section of a DeepSpeed config, and the setups the plugin refuses.

Split out of :mod:`comm_codec.comm.deepspeed` (which re-exports the public names): the
section is parsed into a :class:`~comm_codec.comm.config.CommConfig` (validated there,
once) beside the DeepSpeed-only keys, and what a config, model or engine shows the seams
would not see is refused with a message naming the setting.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist

from ..core.codebooks import KINDS
from ..core.errors import CodebookError, ConfigError
from .config import CommConfig

__all__ = [
    "SECTION",
    "STAGE_KINDS",
    "DEEPSPEED_ONLY",
    "CommCodecConfig",
    "parse_config",
    "parse_section",
    "section_error",
    "json_text",
    "load_config_file",
    "check_zero",
    "check_config",
    "check_engine",
    "unsupported",
    "zero_section",
]

SECTION = "comm_codec"

# The traffic each ZeRO stage codes, by codebook kind: gradient reduction at every stage,
# the parameter all-gathers at stage 3.
STAGE_KINDS = {0: ("gradient",), 1: ("gradient",), 2: ("gradient",), 3: ("gradient", "weight")}
_SUPPORTED_KINDS = ("gradient", "weight")
_STAGES = (0, 1, 2, 3)


# -- configuration ------------------------------------------------------------------------
# The section's keys that are not CommConfig settings: the plugin's own.
DEEPSPEED_ONLY = ("enabled", "kinds", "monitor")


@dataclasses.dataclass(frozen=True)
class CommCodecConfig:
    """The ``"comm_codec"`` section of a DeepSpeed config, parsed.

    Its keys are the :class:`~comm_codec.comm.config.CommConfig` settings (the same as
    ``HuffmanState``'s and ``comm_codec.fsdp.register``'s, validated there) plus the
    DeepSpeed-only keys of :data:`DEEPSPEED_ONLY`; any other key is refused.

    Attributes:
        config: the coding settings.
        codebooks: ``"default"`` (the shipped books), ``"online"`` (built from the first
            ``warmup_steps`` steps), or the path of a saved :class:`CodebookSet`; unset in
            the file: ``"online"`` when ``warmup_steps`` > 0, else ``"default"``.
        enabled: install the codec (a present section defaults to true).
        kinds: the traffic to code, by codebook kind: ``"gradient"`` (gradient reduction,
            every stage), ``"weight"`` (the parameter all-gathers of ZeRO stage 3); None:
            everything the stage moves.
        monitor: also write comm_codec/* scalars to DeepSpeed's monitor (TensorBoard,
            W&B, CSV) when one is enabled in the config.

    Every other setting reads through to ``config`` (``section.mode``, ``section.cast``...).
    """

    config: CommConfig
    codebooks: str = "default"
    enabled: bool = True
    kinds: tuple[str, ...] | None = None
    monitor: bool = True

    def __getattr__(self, name):
        if name in CommConfig.fields():
            return getattr(self.config, name)
        raise AttributeError(name)


def section_error(key: str, problem: str) -> ConfigError:
    exc = ConfigError(f"{SECTION}.{key}" if key else SECTION, None, problem)
    exc.args = (
        f'invalid "{SECTION}" section in the DeepSpeed config: '
        + (f"{SECTION}.{key}: " if key else f"{SECTION}: ")
        + problem,
    )
    return exc


def json_text(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def parse_section(section: dict) -> CommCodecConfig:
    allowed = (*CommConfig.fields(), *DEEPSPEED_ONLY)
    for key in section:
        if key not in allowed:
            raise section_error(key, f"unknown key; allowed keys: {', '.join(allowed)}")
    own = {key: section[key] for key in DEEPSPEED_ONLY if key in section}
    for key in ("enabled", "monitor"):
        if key in own and not isinstance(own[key], bool):
            raise section_error(key, f"{json_text(own[key])}; allowed: true or false")
    kinds = own.get("kinds")
    if kinds is not None:
        if not isinstance(kinds, list) or not kinds:
            raise section_error("kinds", f"{json_text(kinds)}; allowed: a non-empty list of {list(_SUPPORTED_KINDS)}")
        for kind in kinds:
            if kind not in _SUPPORTED_KINDS:
                what = (
                    "is not coded by the DeepSpeed plugin (it codes gradient reduction and ZeRO-3 parameter "
                    "all-gathers)"
                    if kind in KINDS
                    else "is an unknown tensor kind"
                )
                raise section_error("kinds", f"{kind!r} {what}; allowed: {list(_SUPPORTED_KINDS)}")
        own["kinds"] = tuple(kinds)
    settings = {key: value for key, value in section.items() if key not in DEEPSPEED_ONLY}
    source = settings.pop("codebooks", None)
    warmup = settings.get("warmup_steps", 0)
    if source == "online":
        if warmup == 0:
            raise section_error(
                "", 'codebooks "online" needs warmup_steps >= 1 (the steps whose statistics build the books)'
            )
    elif source is not None and warmup:
        raise section_error(
            "warmup_steps",
            f"warmup_steps builds the books online, but codebooks is {source!r}: "
            'drop codebooks (or set it to "online") to build them, or set warmup_steps to 0',
        )
    elif source not in (None, "default"):
        if not isinstance(source, str):
            raise section_error(
                "codebooks",
                f'{json_text(source)}; allowed: "default", "online" or the path of a file saved by CodebookSet.save',
            )
        settings["codebooks"] = source
    try:
        config = CommConfig(**settings)
    except ConfigError as exc:
        raise section_error(exc.key, f"{json_text(exc.value)}; allowed: {exc.allowed}") from None
    except CodebookError as exc:
        raise CodebookError(
            f'invalid "{SECTION}" section in the DeepSpeed config: {SECTION}.codebooks: '
            f"cannot load codebook file {source!r}: {exc}"
        ) from None
    if source is None:
        source = "online" if config.warmup_steps else "default"
    return CommCodecConfig(config=config, codebooks=source, **own)


def parse_config(config) -> CommCodecConfig | None:
    """Validate the ``"comm_codec"`` section of a DeepSpeed config.

    Args:
        config: a whole DeepSpeed config (dict, or path of a JSON/HJSON file), or a
            :class:`CommCodecConfig`.

    Returns:
        The validated section, or None when the config has none.

    Raises:
        ConfigError: an unknown key or a bad value; the message names the key
            (``comm_codec.cast``...), the value and what is allowed.
        CodebookError: a codebook file that is missing or not a codebook set.
        FileNotFoundError: the config file does not exist.
    """
    if isinstance(config, CommCodecConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        config = load_config_file(config)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or a path, got {type(config).__name__}")
    section = config.get(SECTION)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise section_error("", f"{json_text(section)}; allowed: an object (must be an object of settings)")
    return parse_section(section)


def load_config_file(path) -> dict:
    import hjson  # a DeepSpeed dependency; DeepSpeed reads config files with it

    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return hjson.loads(text)


# -- scope checks -------------------------------------------------------------------------
def unsupported(feature: str, fix: str) -> ConfigError:
    exc = ConfigError(SECTION, None, "a supported setup")
    exc.args = (f'comm_codec.deepspeed does not support {feature}; {fix}, or set "{SECTION}": {{"enabled": false}}',)
    return exc


# ZeRO settings that take the traffic off the seams (ZeRO++'s lossy paths, fetching by
# all-reduce, all-reduced ZeRO-3 gradients): key -> (the value DeepSpeed defaults to,
# what that setting does instead).
_ZERO_REFUSED = {
    "zero_quantized_weights": (False, "ZeRO++ quantized weights (lossy int8 all-gathers in place of the coded ones)"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized frozen weights (lossy int8 all-gathers)"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradients (a lossy all-to-all reduction)"),
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitions (secondary weight copies gathered per node)"),
    "stage3_use_all_reduce_for_fetch_params": (False, "parameter fetch by all-reduce"),
}


def zero_section(config: dict) -> dict:
    zero = config.get("zero_optimization") or {}
    return zero if isinstance(zero, dict) else {}


def check_zero(zero: dict, section: CommCodecConfig) -> int:
    """Refuse the ZeRO settings and "comm_codec" values the plugin does not cover; return the stage.

    Every message names the key and the values allowed, and every rank raises it alike
    (the config is the same everywhere), before the first step.

    Raises:
        ValueError: an unsupported stage, ZeRO++ option, offload device, kind or cast.
    """
    stage = zero.get("stage", 0)
    if stage not in _STAGES:
        raise unsupported(
            f"ZeRO stage {stage!r} (zero_optimization.stage; allowed: 0, 1, 2, 3)", "use ZeRO stage 0, 1, 2 or 3"
        )
    for key, (default, what) in _ZERO_REFUSED.items():
        if zero.get(key, default) != default:
            raise unsupported(
                f"{what} (zero_optimization.{key}: {zero[key]!r}; allowed with comm_codec: {json.dumps(default)})",
                f"set zero_optimization.{key} to {json.dumps(default)}",
            )
    if stage == 3 and zero.get("reduce_scatter", True) is not True:
        raise unsupported(
            "all-reduced ZeRO-3 gradients (zero_optimization.reduce_scatter: false; allowed at stage 3: true)",
            "set zero_optimization.reduce_scatter to true",
        )
    for key in ("offload_optimizer", "offload_param"):
        offload = zero.get(key) or {}
        device = offload.get("device", "none") if isinstance(offload, dict) else offload
        if device not in ("none", "cpu", None):
            raise unsupported(
                f'offload to {device!r} (zero_optimization.{key}.device; allowed: "cpu", "none")', 'offload to "cpu"'
            )
        if key == "offload_param" and device == "cpu" and stage != 3:
            raise unsupported(
                f"offload_param at ZeRO stage {stage} (zero_optimization.offload_param; "
                "DeepSpeed offloads parameters at stage 3 only)",
                "remove offload_param",
            )
    allowed = list(STAGE_KINDS[stage])
    for kind in section.kinds or ():
        if kind not in allowed:
            raise section_error(
                "kinds",
                f"{kind!r} (parameter all-gathers) is coded at ZeRO stage 3 only; allowed at stage {stage}: {allowed}",
            )
    if stage == 3 and section.cast is not None:
        raise section_error(
            "cast",
            f"{section.cast!r} at ZeRO stage 3, where weights and gradients must "
            "arrive exactly; allowed at stage 3: null",
        )
    return stage


def check_config(config: dict, section: CommCodecConfig, model=None) -> None:
    """Refuse, before an engine is built, what the config or model already shows."""
    check_zero(zero_section(config), section)
    opt_type = str((config.get("optimizer") or {}).get("type", "")).lower().replace("_", "")
    if "onebit" in opt_type or "zeroone" in opt_type:
        raise unsupported(
            f"1-bit optimizers (optimizer.type {config['optimizer']['type']!r}: they compress gradients themselves)",
            "use a standard optimizer",
        )
    if model is not None:
        from deepspeed.pipe import PipelineModule

        if isinstance(model, PipelineModule):
            raise unsupported(
                "the pipeline engine (model is a PipelineModule)", "train a plain torch.nn.Module with ZeRO 0-3"
            )


def check_engine(engine) -> None:
    """Refuse engines whose gradient reduction does not go through the seams."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(engine, PipelineEngine):
        raise unsupported("the pipeline engine", "train a plain torch.nn.Module with ZeRO 0-3")
    if isinstance(engine, DeepSpeedHybridEngine):
        raise unsupported("the hybrid engine (hybrid_engine.enabled)", "disable hybrid_engine")
    stage = engine.zero_optimization_stage()
    if get_accelerator().device_name() != "cpu":
        raise unsupported(
            f"the {get_accelerator().device_name()} accelerator yet (the codec codes CPU buffers)",
            "train on CPU with gloo",
        )
    name = type(engine.optimizer).__name__.lower() + " " + str(engine.optimizer_name()).lower()
    if "onebit" in name or "zeroone" in name:
        raise unsupported("1-bit optimizers", "use a standard optimizer")
    expected = (DeepSpeedZeroOptimizer_Stage3,) if stage == 3 else (DeepSpeedZeroOptimizer, BF16_Optimizer)
    if stage > 0 and not isinstance(engine.optimizer, expected):
        raise unsupported(
            f"the ZeRO optimizer {type(engine.optimizer).__name__}",
            f"use DeepSpeed's ZeRO {'3' if stage == 3 else '1/2'} optimizer",
        )
    if stage == 3 and (not engine.optimizer.reduce_scatter or engine.optimizer.all2all_process_group is not None):
        raise unsupported(
            "this ZeRO-3 gradient reduction (zero_optimization.reduce_scatter must be true, "
            "zero_quantized_gradients false)",
            "use the default reduce-scatter",
        )
    if type(engine.optimizer).__name__.startswith("ZenFlow") or engine._config.zero_config.zenflow is not None:
        raise unsupported("ZenFlow (zero_optimization.zenflow)", "disable zenflow")
    if engine.has_moe_layers:
        raise unsupported("mixture-of-experts layers (expert-parallel groups)", "train without MoE")
    if engine.is_deepcompile_enabled():
        raise unsupported("DeepCompile (compile.deepcompile)", "disable deepcompile")
    if not engine.enable_backward_allreduce:
        raise unsupported("engines without backward all-reduce", "leave gradient reduction to DeepSpeed")
    world = dist.get_world_size()
    if (
        engine.mpu is not None
        or getattr(engine, "sequence_parallel_size", 1) != 1
        or dist.get_world_size(engine.data_parallel_group) != world
    ):
        raise unsupported(
            "model, tensor or sequence parallelism (the data-parallel group must be the whole world)",
            "use pure data parallelism",
        )
    sparse = [
        n
        for n, m in engine.module.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    ]
    if sparse:
        raise unsupported(
            f"sparse embedding gradients (module {sparse[0]!r} has sparse=True; DeepSpeed "
            "all-gathers those outside the coded reduction)",
            "use sparse=False",
        )
