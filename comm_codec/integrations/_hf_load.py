"""Load a compressed Hugging Face model directory straight into a transformers model.

A directory written by ``comm-codec compress MODEL_DIR OUT`` holds the model's
``config.json`` (and tokenizer files) as they were, and each safetensors shard as
``<shard>.cckp`` beside the shard index (``model.safetensors.index.json``). This reads
the shards in memory (:func:`comm_codec.checkpoint.tensors.load_file`) and hands the
state dict to the model class's own ``from_pretrained``; no file is written anywhere.
Every frame and segment is checked as it is decoded; each shard's whole-file digest is
hashed on another thread while transformers builds the model, and the model is returned
only once every digest matched::

    from transformers import AutoModel
    from comm_codec.integrations.hf import from_pretrained

    model = from_pretrained(AutoModel, "minilm.cckp/")
"""

from __future__ import annotations

import contextlib
import json
import os

from ..checkpoint.directory import SUFFIX
from ..checkpoint.errors import CheckpointError
from ..checkpoint.tensors import load_file_check_later

__all__ = ["from_pretrained", "load_state_dict"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Largest shard index read (the JSON lists every tensor name once).
_MAX_INDEX_BYTES = 64 << 20


def _shard_names(folder: str) -> list:
    """The safetensors shards a model directory names (from its index), or its single file."""
    index = os.path.join(folder, _INDEX)
    if not os.path.isfile(index):
        if os.path.isfile(os.path.join(folder, _SINGLE + SUFFIX)) or os.path.isfile(os.path.join(folder, _SINGLE)):
            return [_SINGLE]
        raise CheckpointError(
            f"{folder} holds neither {_SINGLE}{SUFFIX} nor {_INDEX}: not a compressed Hugging Face model directory"
        )
    if os.path.getsize(index) > _MAX_INDEX_BYTES:
        raise CheckpointError(f"{index} is larger than {_MAX_INDEX_BYTES} bytes: not a shard index")
    with open(index, encoding="utf-8") as fh:
        try:
            weight_map = json.load(fh)["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a shard index ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map is not a map of tensor names to shard files")
    names = sorted(set(weight_map.values()))
    for name in names:
        # Names from the file: only plain file names inside the directory are read.
        if not name or name != os.path.basename(name) or name in (".", "..") or "\0" in name:
            raise CheckpointError(f"{index}: shard {name!r} is not a file name inside {folder}")
    return names


def load_state_dict(folder, device: str = "cpu") -> dict:
    """Return the state dict of a compressed (or plain) Hugging Face model directory.

    Args:
        folder: a directory written by ``comm-codec compress MODEL_DIR OUT`` (shards as
            ``*.safetensors.cckp``); a shard left uncompressed is read as it is.
        device: where the tensors go.

    Returns:
        ``{name: tensor}`` over every shard.

    Raises:
        CheckpointError: not a model directory, a shard missing or corrupted, or a shard
            name in the index that is not a file of the directory.
    """
    state, checks = _state_check_later(os.fspath(folder), device)
    for check in checks:
        check()
    return state


def _state_check_later(folder: str, device: str) -> tuple[dict, list]:
    """Return the state dict and the digest checks still running (see
    :func:`~comm_codec.checkpoint.tensors.load_file_check_later`)."""
    state: dict = {}
    checks = []
    try:
        for name in _shard_names(folder):
            path = os.path.join(folder, name)
            if os.path.isfile(path + SUFFIX) and not os.path.islink(path + SUFFIX):
                tensors, check = load_file_check_later(path + SUFFIX, device=device)
                state.update(tensors)
                checks.append(check)
            elif os.path.isfile(path) and not os.path.islink(path):
                from safetensors.torch import load_file as st_load_file

                state.update(st_load_file(path, device=device))
            else:
                raise CheckpointError(f"{folder}: shard {name} is missing (neither {name}{SUFFIX} nor {name})")
    except BaseException:
        for check in checks:  # no digest thread is left running behind an error
            with contextlib.suppress(CheckpointError):
                check()
        raise
    return state, checks


def from_pretrained(model_class, folder, device: str = "cpu", **kwargs):
    """Build a transformers model from a compressed model directory, as ``from_pretrained`` does.

    Args:
        model_class: ``AutoModel``, ``AutoModelForCausalLM``, ``BertModel``... (anything
            with ``from_pretrained``).
        folder: the compressed directory (``config.json`` and ``*.safetensors.cckp``).
        device: where the weights are loaded.
        kwargs: passed on to ``model_class.from_pretrained`` (``torch_dtype``...).

    Returns:
        The model, its parameters bit for bit those of the original directory.

    Raises:
        CheckpointError: as :func:`load_state_dict`.
    """
    from transformers import AutoConfig

    folder = os.fspath(folder)
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(folder)
    state, checks = _state_check_later(folder, device)
    try:
        if hasattr(model_class, "_model_mapping"):  # AutoModel...: the class its config names
            from transformers.models.auto.auto_factory import _get_model_class

            model_class = _get_model_class(config, model_class._model_mapping)
        # The digests are hashed meanwhile: transformers takes the tensors as they are
        # (they become the parameters) and writes none of them.
        model = model_class.from_pretrained(None, config=config, state_dict=state, **kwargs)
    finally:
        for check in checks:  # raises CheckpointError for a shard whose digest is wrong
            check()
    return model
