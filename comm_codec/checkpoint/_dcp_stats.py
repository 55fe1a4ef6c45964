"""What a DCP Writer's saves and a Reader's loads did on one rank: the figures of their ``stats()``.

Both report a :class:`~comm_codec.checkpoint.report.Summary` (``format="dcp"``), the
checkpoint sibling of the traffic record: ``bytes_in`` is what the state dict holds
uncompressed (a Writer: the items' bytes as ``FileSystemWriter`` would store them; a
Reader: the bytes restored into the state dict), ``bytes_out`` what is stored (a Writer:
the data files written; a Reader: the records read, a pack frame counted once),
``tensors`` the tensor items, ``coded`` those stored as frames, ``seconds`` the time in
``write_data`` / ``read_data``.
"""

from __future__ import annotations

import math

from .report import Summary

__all__ = ["Counts"]


class Counts:
    """Running totals of one Writer or Reader.

    Args:
        coded: the first transform descriptors of a record stored as a frame.
    """

    def __init__(self, coded: tuple):
        self.coded_descriptors = coded
        self.bytes_in = self.bytes_out = self.tensors = self.coded = 0
        self.seconds = 0.0

    def _is_coded(self, descriptors) -> bool:
        return bool(descriptors) and descriptors[0] in self.coded_descriptors

    def add_file(self, raw: int, plain: dict, results: list, size: int, tensors: int) -> None:
        """Count a written data file: ``raw`` bytes coded as frames, ``plain`` items stored
        as DCP stores them (offset -> (length, crc)), its write results, its size."""
        self.bytes_in += raw + sum(length for length, _ in plain.values())
        self.bytes_out += size
        self.tensors += tensors
        self.coded += sum(self._is_coded(r.storage_data.transform_descriptors) for r in results)

    def add_read(self, req, info, seen: set, chunks: dict, value: bool) -> None:
        """Count one read item (``seen``: the records of its file counted already;
        ``value``: a non-tensor value, not a tensor)."""
        if (info.relative_path, info.offset) not in seen:
            seen.add((info.relative_path, info.offset))
            self.bytes_out += info.length
        if value:
            self.bytes_in += info.length
            return
        dtype = chunks[(req.storage_index.fqn, tuple(req.storage_index.offset or ()))][0]
        self.bytes_in += math.prod(req.lengths) * dtype.itemsize
        self.tensors += 1
        self.coded += self._is_coded(getattr(info, "transform_descriptors", None))

    def summary(self, op: str, threads: int) -> Summary:
        return Summary(op, self.bytes_in, self.bytes_out, self.seconds, threads, "dcp", self.tensors, self.coded)
