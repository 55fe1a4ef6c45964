"""One config for every adapter: the same options dict through DDP, FSDP2 and the DeepSpeed section."""

from __future__ import annotations

import dataclasses

import pytest

import comm_codec as cc
from comm_codec.comm.config import CommConfig
from comm_codec.ddp import HuffmanState
from comm_codec.fsdp import FSDPState

pytestmark = pytest.mark.unit

try:
    import comm_codec.deepspeed as ccds
except ImportError:  # pragma: no cover - the deepspeed extra is part of CI
    ccds = None

OPTIONS = {
    "warmup_steps": 4,
    "mode": "always",
    "min_bytes": 1024,
    "threads": 1,
    "log_every": 7,
    "drift_every": 3,
    "refresh_threshold": 0.02,
    "refresh_steps": 2,
    "recheck_every": 50,
    "probe_steps": 2,
    "hysteresis": 0.1,
}


def test_the_same_options_configure_ddp_fsdp2_and_the_deepspeed_section_alike():
    expected = CommConfig(**OPTIONS)
    assert HuffmanState(**OPTIONS).config == expected
    assert FSDPState(**OPTIONS).config == expected
    assert ccds is not None, "the deepspeed extra is installed in CI"
    assert ccds.parse_config({"comm_codec": dict(OPTIONS)}).config == expected
    # and a config object is taken as it is, keywords beside it replacing fields
    assert HuffmanState(config=expected).config is expected
    assert FSDPState(config=expected, mode="never").config == dataclasses.replace(expected, mode="never")


def test_the_deepspeed_section_allows_the_config_fields_and_its_documented_own_keys():
    assert ccds.DEEPSPEED_ONLY == ("enabled", "kinds", "monitor")
    with pytest.raises(cc.ConfigError) as info:
        ccds.parse_config({"comm_codec": {"nope": 1}})
    allowed = str(info.value).split("allowed keys: ", 1)[1].split(", ")
    assert allowed == [*CommConfig.fields(), *ccds.DEEPSPEED_ONLY]


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("warmup_steps", -1, "an integer >= 0"),
        ("warmup_steps", True, "an integer >= 0"),
        ("mode", "fast", "'auto', 'always', 'never'"),
        ("cast", "fp8", "None (lossless) or 'bf16'"),
        ("min_bytes", 1.5, "an integer >= 0"),
        ("log_every", -1, "an integer >= 0"),
        ("hysteresis", 1.0, "a fraction in [0, 1)"),
        ("probe_steps", 0, "an integer >= 1"),
        ("recheck_every", 0, "an integer >= 1"),
        ("refresh_steps", 0, "an integer >= 1"),
        ("refresh_threshold", 0.0, "None or a fraction > 0"),
    ],
)
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(cc.ConfigError) as info:
        CommConfig(**{key: value})
    assert str(info.value) == f"{key}={value!r}; allowed: {allowed}"
    assert (info.value.key, info.value.value, info.value.allowed) == (key, value, allowed)


def test_config_is_frozen_keyword_only_and_unknown_options_are_named():
    config = CommConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "never"
    with pytest.raises(TypeError):
        CommConfig(None)  # keyword-only
    with pytest.raises(TypeError, match="unknown option 'warmup'; allowed: codebooks, warmup_steps"):
        HuffmanState(warmup=3)


def test_a_missing_codebook_file_is_a_codebook_error_everywhere(tmp_path):
    missing = tmp_path / "missing.json"
    for make in (
        lambda: CommConfig(codebooks=missing),
        lambda: HuffmanState(codebooks=str(missing)),
        lambda: FSDPState(codebooks=missing),
        lambda: ccds.parse_config({"comm_codec": {"codebooks": str(missing)}}),
    ):
        with pytest.raises(cc.CodebookError, match="no such file"):
            make()


def test_fsdp2_refuses_cast_naming_the_key():
    with pytest.raises(cc.ConfigError, match="cast='bf16'; allowed: None here"):
        FSDPState(cast="bf16")


@pytest.mark.parametrize(
    "key, value",
    [
        ("mode", "sometimes"),
        ("probe_steps", 0),
        ("recheck_every", True),
        ("hysteresis", 1.0),
        ("drift_every", -1),
        ("refresh_threshold", 0.0),
        ("refresh_steps", 0),
    ],
)
def test_the_parts_that_take_a_few_settings_validate_them_as_the_config_does(key, value):
    from comm_codec.comm.autoswitch import AutoSwitch
    from comm_codec.comm.refresh import BookRefresh

    part = AutoSwitch if key in ("mode", "probe_steps", "recheck_every", "hysteresis") else BookRefresh
    extra = {"drift_every": 1} if key == "refresh_threshold" else {}
    with pytest.raises(cc.ConfigError) as by_config:
        CommConfig(**{key: value}, **extra)
    with pytest.raises(cc.ConfigError) as by_part:
        part(**{key: value}, **extra)
    assert str(by_part.value) == str(by_config.value)


def test_a_refresh_threshold_without_drift_is_refused_alike():
    from comm_codec.comm.refresh import BookRefresh

    with pytest.raises(cc.ConfigError) as by_config:
        CommConfig(refresh_threshold=0.1)
    with pytest.raises(cc.ConfigError) as by_part:
        BookRefresh(refresh_threshold=0.1)
    assert str(by_part.value) == str(by_config.value)
