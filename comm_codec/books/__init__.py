"""Fitting books: symbol statistics in, :class:`~comm_codec.CodebookSet` out (no torch.distributed)."""
