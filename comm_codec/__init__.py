"""comm_codec: lossless, fixed-codebook Huffman coding of distributed-training tensors.

Quick use::

    import comm_codec as cc
    codec = cc.Codec()                            # shipped default codebooks
    frame = codec.encode(grad, kind="gradient")   # 1-D torch.uint8, self-describing
    same = codec.decode(frame)                    # 1-D, original dtype, bit-exact

See ``comm_codec/frame_format.md`` for the frame layout and ``codebooks/README.md`` for books.
"""

from .codebooks import KINDS, CodebookGroup, CodebookSet
from .codec import Codec
from .frame import FrameError, get_frame_parameters
from .huffman import Codebook, CodebookError
from .profiler import WarmupProfiler
from .streams import SUPPORTED_DTYPES

__all__ = [
    "Codec",
    "Codebook",
    "CodebookGroup",
    "CodebookSet",
    "CodebookError",
    "FrameError",
    "KINDS",
    "SUPPORTED_DTYPES",
    "WarmupProfiler",
    "get_frame_parameters",
    "__version__",
]

__version__ = "0.1.0"
