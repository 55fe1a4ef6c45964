"""Offline checkpoint compression: any checkpoint file in, the same bytes back out.

:func:`compress_file` finds the tensors inside a safetensors file or a ``torch.save`` zip
*without unpickling anything* and codes each one with :class:`~comm_codec.Codec`; every
other byte is coded with zstd. :func:`decompress_file` writes the original file back,
byte for byte, and checks its digest before the output appears. ``base=`` codes each
tensor as the XOR of its bit pattern with the same-named tensor of a previous checkpoint.
:mod:`comm_codec.checkpoint.lossy` is the opt-in lossy mode.

Example::

    >>> from comm_codec import checkpoint
    >>> s = checkpoint.compress_file("weights_bf16.safetensors", "w.cckp")      # doctest: +SKIP
    >>> print(s.line())                                                        # doctest: +SKIP
    >>> checkpoint.decompress_file("w.cckp", "w.safetensors")                  # doctest: +SKIP

The package, one concept per module (each imports only those listed before it):

- :mod:`.errors`: :class:`CheckpointError`, :class:`ChainError`.
- :mod:`.files`: read-only maps, atomic outputs, streaming hashes.
- :mod:`.report`: what a call returns (:class:`Summary`), sizes as printed, the progress line.
- :mod:`.schema`: the checks a JSON index is held to.
- :mod:`.container`: header, index and trailer shared by both formats; magics.
- :mod:`.pickle_scan`, :mod:`.formats`: finding tensors in safetensors, torch zips, DCP data
  files and legacy torch.save files.
- :mod:`.plan`: transforms and book choice per tensor.
- :mod:`.exact_index`, :mod:`.exact`: the lossless format (this package's face re-exports it).
- :mod:`.lossy_transforms`, :mod:`.lossy_index`, :mod:`.lossy_blobs`, :mod:`.lossy_tensors`,
  :mod:`.lossy_chain`, :mod:`.lossy`: the ExCP-style and precision-cut format
  (``lossy_format.md``).
- :mod:`.tensors`: tensors straight out of a compressed file (``load_file``, a lazy ``safe_open``).
- :mod:`.directory`: a tree of checkpoint files (sharded safetensors, DCP, any tree)
  compressed into a mirror and back (``compress_dir`` / ``decompress_dir`` / ``verify_dir``).

The commands ``comm-codec compress / decompress / verify / ls`` are
:mod:`comm_codec.tools.checkpoint_cli`.
"""

from .container import LOSSY_MAGIC, MAGIC
from .directory import compress_dir, decompress_dir, verify_dir
from .errors import CheckpointError
from .exact import PIECE_BYTES, compress_file, decompress_file, describe, load, save, verify_file
from .exact_index import VERSION, is_checkpoint, read_index
from .report import Summary
from .tensors import load_file, safe_open

__all__ = [
    "CheckpointError",
    "Summary",
    "compress_file",
    "decompress_file",
    "verify_file",
    "compress_dir",
    "decompress_dir",
    "verify_dir",
    "load_file",
    "safe_open",
    "read_index",
    "describe",
    "is_checkpoint",
    "save",
    "load",
    "MAGIC",
    "LOSSY_MAGIC",
    "VERSION",
    "PIECE_BYTES",
]
