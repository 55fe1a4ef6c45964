"""Split tensors into byte streams and join them back, bit for bit.

A float's bytes are not equally compressible: the exponent byte carries ~2.7 bits of
information on real bf16 tensors, the mantissa bytes almost 8. Coding them as separate
streams lets each get its own codebook (or be stored raw when coding does not pay).

The sign bit sits *between* the exponent and the rest of the bits of every IEEE format,
so it would make the exponent byte a mixture of two shifted distributions. We rotate the
element's bits left by one, which moves the sign to the least significant bit:

=================  ==============================  ===========================================
dtype              rotated bits (msb → lsb)        streams (0 first)
=================  ==============================  ===========================================
bfloat16           e8 m7 s                         [e8] [m7 s]
float16            e5 m10 s                        [e5 m_hi3] [m_lo7 s]
float32            e8 m23 s                        [e8] [m_hi8] [m_mid8] [m_lo7 s]
float8_e4m3fn      e4 m3 s                         [e4 m3 s]
float8_e5m2        e5 m2 s                         [e5 m2 s]
int8, uint8        (not rotated)                   [b]
=================  ==============================  ===========================================

Stream 0 of a float type is its *exponent stream*: the exponent sits in its top bits,
``exp_shift`` bits up. The kernels code it relative to a per-chunk reference exponent
(see :mod:`comm_codec.core.frame`), which makes one book fit layers of different scale.

Non-contiguous tensors are accepted everywhere and copied to contiguous memory first;
contiguous CPU tensors are used without a copy.

This module does not import torch: a :class:`StreamSpec` names its torch dtype and
gives the dtype object (``spec.dtype``) only when asked, so the checkpoint commands,
which code numpy arrays of a file's bytes, run without torch. ``SUPPORTED_DTYPES`` and
``ACCUMULABLE_DTYPES`` (tuples of torch dtypes) import torch when first read.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from ..kernels.layout import bits_dtype

if TYPE_CHECKING:  # annotations only: torch is imported where a tensor is first used
    import torch

__all__ = [
    "ACCUMULABLE_DTYPES",
    "StreamSpec",
    "is_accumulable",
    "SUPPORTED_DTYPES",
    "spec_for",
    "spec_for_code",
    "SUPPORTED_NAMES",
    "as_bits",
    "split",
    "join",
]


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """How one dtype is laid out in byte streams.

    Attributes:
        torch_name: the torch dtype's name ("bfloat16"); ``dtype`` is the dtype itself
            (imports torch on first use).
        code: the dtype's number in the frame header (stable; never reuse one).
        name: the short name used in codebook files ("bf16", ...).
        itemsize: bytes per element; also the number of streams.
        rotate: whether the sign bit is rotated to the least significant bit.
        exp_shift: position of the exponent inside stream 0's byte, or -1 when the type
            has no exponent (integers), in which case stream 0 is coded as is.
        split_bits: the low bits of stream 0's byte that a frame with split exponents
            stores raw beside the code of the rest (0: the type never splits).
    """

    torch_name: str
    code: int
    name: str
    itemsize: int
    rotate: bool
    exp_shift: int
    split_bits: int = 0

    @functools.cached_property
    def dtype(self):
        """The torch dtype (torch is imported here, not before)."""
        import torch

        return getattr(torch, self.torch_name)

    @property
    def nstreams(self) -> int:
        return self.itemsize

    @property
    def bits_dtype(self) -> np.dtype:
        """The integer numpy dtype the kernels see one element's bit pattern as.

        See :func:`comm_codec.kernels.layout.bits_dtype`: unsigned for rotated (IEEE)
        types, int8 for the 1-byte integer types.
        """
        return bits_dtype(self.itemsize, self.rotate)


_SPECS = (
    StreamSpec("bfloat16", 1, "bf16", 2, True, 0),
    StreamSpec("float16", 2, "fp16", 2, True, 3, 3),
    StreamSpec("float32", 3, "fp32", 4, True, 0),
    StreamSpec("float8_e4m3fn", 4, "fp8_e4m3", 1, True, 4, 3),
    StreamSpec("float8_e5m2", 5, "fp8_e5m2", 1, True, 3, 3),
    StreamSpec("int8", 6, "int8", 1, False, -1),
    StreamSpec("uint8", 7, "uint8", 1, False, -1),
)
_BY_TORCH_NAME = {s.torch_name: s for s in _SPECS}
_BY_CODE = {s.code: s for s in _SPECS}
_BY_NAME = {s.name: s for s in _SPECS}

# The torch names of the supported dtypes ("bfloat16", ...), without importing torch.
SUPPORTED_NAMES = tuple(s.torch_name for s in _SPECS)
# The float types whose frames add into a float32 sum (Codec.decode_accumulate): what the
# coded all-reduce, reduce-scatter and reduce sum.
_ACCUMULABLE_NAMES = ("bfloat16", "float16", "float32")


def __getattr__(name: str):
    # The torch dtype tuples import torch when first read (PEP 562), not with the module.
    if name == "SUPPORTED_DTYPES":
        return tuple(s.dtype for s in _SPECS)
    if name == "ACCUMULABLE_DTYPES":
        return tuple(_BY_TORCH_NAME[n].dtype for n in _ACCUMULABLE_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_accumulable(spec: StreamSpec) -> bool:
    """Whether frames of this layout add into a float32 sum (bfloat16, float16, float32)."""
    return spec.torch_name in _ACCUMULABLE_NAMES


def _supported_names() -> str:
    return ", ".join(SUPPORTED_NAMES)


def spec_for(dtype) -> StreamSpec:
    """Return the stream layout of ``dtype``.

    Args:
        dtype: a torch dtype, a codebook dtype name such as ``"bf16"``, or a torch
            dtype's name such as ``"bfloat16"``.

    Returns:
        The :class:`StreamSpec` for that dtype.

    Raises:
        TypeError: the dtype is not supported; the message lists the supported ones.
    """
    if isinstance(dtype, str):
        spec = _BY_NAME.get(dtype) or _BY_TORCH_NAME.get(dtype)
    elif type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":  # torch is loaded already
        spec = _BY_TORCH_NAME.get(str(dtype).removeprefix("torch."))
    else:
        spec = None
    if spec is None:
        raise TypeError(f"comm_codec cannot code dtype {dtype}; supported dtypes are {_supported_names()}")
    return spec


def spec_for_code(code: int) -> StreamSpec | None:
    """Return the stream layout for a frame's dtype code, or None for an unknown code."""
    return _BY_CODE.get(code)


def as_bits(tensor) -> tuple[np.ndarray, StreamSpec]:
    """View a CPU tensor's elements as a flat numpy array of unsigned bit patterns.

    Contiguous tensors are viewed without a copy; others are copied once.

    Args:
        tensor: a CPU tensor of a supported dtype, any shape.

    Returns:
        ``(bits, spec)``: a 1-D array of ``spec.bits_dtype`` sharing memory with the
        tensor when it was contiguous, and the dtype's :class:`StreamSpec`.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        ValueError: the tensor is not on the CPU.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    spec = spec_for(tensor.dtype)
    if tensor.device.type != "cpu":
        raise ValueError(f"expected a CPU tensor, got one on {tensor.device}")
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():  # reshape of a non-viewable tensor already copied
        flat = flat.contiguous()
    ints = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[spec.itemsize])
    return ints.numpy().view(spec.bits_dtype), spec


def _rotl(bits: np.ndarray, width: int) -> np.ndarray:
    return (bits << 1) | (bits >> (width - 1))


def _rotr(bits: np.ndarray, width: int) -> np.ndarray:
    return (bits >> 1) | (bits << (width - 1))


def split(tensor) -> list[np.ndarray]:
    """Split a tensor into its byte streams (a reference implementation, not the hot path).

    The kernels in :mod:`comm_codec.kernels` do the same per chunk without
    materialising the streams; this function defines what they must produce.

    Args:
        tensor: a CPU tensor of a supported dtype.

    Returns:
        ``spec.nstreams`` uint8 arrays of ``numel`` bytes each, stream 0 first.

    Raises:
        TypeError: unsupported dtype.
    """
    bits, spec = as_bits(tensor)
    bits = bits.view(np.dtype(f"u{spec.itemsize}"))
    width = 8 * spec.itemsize
    rot = _rotl(bits, width) if spec.rotate else bits
    return [((rot >> (8 * (spec.itemsize - 1 - s))) & 0xFF).astype(np.uint8) for s in range(spec.nstreams)]


def join(streams: list[np.ndarray], dtype) -> torch.Tensor:
    """Join byte streams made by :func:`split` back into a 1-D tensor.

    Args:
        streams: the uint8 streams, stream 0 first, all the same length.
        dtype: the tensor's dtype.

    Returns:
        A 1-D tensor of ``dtype`` whose bits equal the split tensor's.

    Raises:
        TypeError: unsupported dtype.
        ValueError: wrong number of streams or streams of different lengths.
    """
    spec = spec_for(dtype)
    if len(streams) != spec.nstreams:
        raise ValueError(f"{spec.name} has {spec.nstreams} streams, got {len(streams)}")
    n = len(streams[0])
    if any(len(s) != n for s in streams):
        raise ValueError("all streams must have the same length")
    udt = np.dtype(f"u{spec.itemsize}")
    import torch

    rot = np.zeros(n, dtype=udt)
    for s, stream in enumerate(streams):
        rot |= stream.astype(udt) << (8 * (spec.itemsize - 1 - s))
    bits = _rotr(rot, 8 * spec.itemsize) if spec.rotate else rot
    ints = torch.from_numpy(bits.view({1: np.uint8, 2: np.int16, 4: np.int32}[spec.itemsize]))
    return ints.view(dtype)
