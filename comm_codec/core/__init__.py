"""The codec core: byte streams, Huffman books, the frame format, :class:`Codec`, the GPU host side.

Imports only :mod:`comm_codec.kernels` below it; nothing here knows about training.
"""
