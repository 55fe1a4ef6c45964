"""Data package: the codebook files shipped with comm_codec (see README.md here)."""
