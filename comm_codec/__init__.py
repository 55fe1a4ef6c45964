"""comm_codec: lossless, fixed-codebook Huffman coding of distributed-training tensors.

Quick use::

    import comm_codec as cc
    codec = cc.Codec()                            # shipped default codebooks
    frame = codec.encode(grad, kind="gradient")   # 1-D torch.uint8, self-describing
    same = codec.decode(frame)                    # 1-D, original dtype, bit-exact

The names below are loaded on first use (PEP 562), so that importing a submodule -- the
command line, the error classes -- does not import torch and numba. The layers, each
importing only those below it: ``kernels`` (numba leaves), ``core`` (streams, frames,
books, the codec), ``books`` (fitting books from statistics), ``comm`` (the coding
engine, collectives, the DDP / FSDP2 / DeepSpeed adapters), ``checkpoint``,
``integrations`` and ``tools`` (command line, benchmarks, demos). ``comm_codec.ddp``,
``.fsdp``, ``.deepspeed`` and ``.collectives`` are the adapters' public paths.

See ``comm_codec/core/frame_format.md`` for the frame layout and ``codebooks/README.md`` for books.
"""

from __future__ import annotations

import importlib

from .core.errors import (
    AgreementError,
    ChainError,
    CheckpointError,
    CodebookError,
    CollectiveError,
    CommCodecError,
    ConfigError,
    FrameError,
)
from .core.logs import set_verbosity, verbosity_from_env, watch_deepspeed
from .core.version import __version__

verbosity_from_env()
watch_deepspeed()  # a ds_config "comm_codec" section that nothing installs says so (stdlib only until DeepSpeed loads)

__all__ = [
    "Codec",
    "CommConfig",
    "Codebook",
    "CodebookGroup",
    "CodebookSet",
    "CommCodecError",
    "CodebookError",
    "CheckpointError",
    "ChainError",
    "CollectiveError",
    "AgreementError",
    "ConfigError",
    "FrameError",
    "KINDS",
    "SUPPORTED_DTYPES",
    "WarmupProfiler",
    "get_frame_parameters",
    "set_verbosity",
    "__version__",
]

# name -> module that defines it (imported when the name is first read)
_LAZY = {
    "Codec": ".core.codec",
    "CommConfig": ".comm.config",
    "Codebook": ".core.huffman",
    "CodebookGroup": ".core.codebooks",
    "CodebookSet": ".core.codebooks",
    "KINDS": ".core.codebooks",
    "SUPPORTED_DTYPES": ".core.streams",
    "WarmupProfiler": ".books.profiler",
    "get_frame_parameters": ".core.frame",
}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'comm_codec' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
