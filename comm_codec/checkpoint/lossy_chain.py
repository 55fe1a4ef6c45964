"""Chains of lossy excp files: finding each file's base, and the cache of reconstructed weights.

An excp file codes residuals against the *reconstruction* of its base, so decoding the
n-th file of a series needs the weights of files 0..n-1. :func:`chain_weights` walks the
chain back to the nearest cached link or to the keyframe (iteratively: chains may be
long), then decodes forward, weights only. The two most recent reconstructions stay
cached in the process, keyed by the lossy file's sha256, so compressing a series one file
after the other never decodes a chain twice; :func:`clear_cache` forgets them.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading

from ..core.quoting import printable, shown
from .errors import ChainError, CheckpointError, fail
from .files import FileMap, open_regular
from .lossy_index import load_index
from .lossy_tensors import Decoder

__all__ = ["chain_weights", "chain_files", "find_base", "remember", "clear_cache", "file_sha256"]

_CACHE_SIZE = 2
_cache: collections.OrderedDict = collections.OrderedDict()
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget the cached reconstructions (the next decode walks its whole chain)."""
    with _cache_lock:
        _cache.clear()


def _cached(sha: str) -> dict | None:
    with _cache_lock:
        hit = _cache.get(sha)
        if hit is not None:
            _cache.move_to_end(sha)
        return hit


def remember(sha: str, weights: dict) -> None:
    """Cache the reconstructed weights of the lossy file whose sha256 is ``sha``."""
    with _cache_lock:
        _cache[sha] = weights
        _cache.move_to_end(sha)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)


def file_sha256(path: str) -> str:
    """Return the sha256 of a regular file, read in blocks."""
    h = hashlib.sha256()
    with open_regular(path) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_base(path: str, index: dict, override, beside: str | None = None) -> tuple[str, str]:
    """Find and check the base a lossy file names; return (path, sha256).

    The recorded name comes from the file, so it is never followed as a path: it must be
    a plain file name, looked for beside the file (or in ``beside``: the working
    directory for a file read from stdin), and a regular file. Only a base the user
    names (``override``) may lie anywhere.

    Raises:
        ChainError: the base is missing (``missing`` is the path looked for).
        CheckpointError: the recorded name is not a plain file name, or the base found
            has another sha256.
    """
    rec = index["base"]
    cand = _base_path(path, rec, override, beside)
    if not os.path.exists(cand):
        raise ChainError(
            f"{path} is a lossy delta against {printable(rec['name'])} (sha256 {printable(rec['sha256'][:16])}...), "
            f"which is missing: no file {printable(cand)}. Decompressing it needs every earlier file of its chain "
            "back to the keyframe: keep them side by side, or pass the base's path (--base)",
            cand,
        )
    sha = file_sha256(cand)
    if sha != rec["sha256"]:
        raise CheckpointError(
            f"wrong base: {printable(cand)} has sha256 {sha[:16]}..., but {path} was compressed "
            f"against {printable(rec['name'])} with sha256 {printable(rec['sha256'][:16])}..."
        )
    return cand, sha


def _base_path(path: str, rec: dict, override, beside: str | None = None) -> str:
    """Where the base a file records is looked for: ``override``, or its plain name beside the
    file (in ``beside`` when given)."""
    if override is not None:
        return os.fspath(override)
    name = rec["name"]
    if name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
        fail(
            path,
            f"records its base as {shown(name, 80)}, which is not a plain file name: the file is "
            "corrupted or crafted; pass the base's path yourself (--base)",
        )
    return os.path.join(os.path.abspath(beside) if beside is not None else os.path.dirname(os.path.abspath(path)), name)


def chain_files(path: str, index: dict, override, beside: str | None = None) -> list[str]:
    """Return the files of a lossy file's chain that exist: its base, that file's base, and so on.

    Only names are followed (no digest is checked: :func:`find_base` does that when the
    chain is decoded), so that an output can be refused before anything is decoded when
    it would replace a file the chain needs. Stops at a keyframe, at a link that is
    missing or unreadable, or where the chain loops.
    """
    files: list[str] = []
    cur, rec, over, home = path, index["base"], override, beside
    while rec is not None:
        cand = _base_path(cur, rec, over, home)
        if not os.path.isfile(cand) or any(os.path.samefile(cand, f) for f in files + [path]):
            break
        files.append(cand)
        m = FileMap(cand)
        try:
            rec = load_index(m)["base"]
        except CheckpointError:
            break  # decoding the chain reports it
        finally:
            m.close()
        cur, over, home = cand, None, None
    return files


def chain_weights(path: str, sha: str, threads: int | None) -> dict:
    """Return the reconstructed weights of the lossy file at ``path`` (of sha256 ``sha``).

    Decodes its chain back to the nearest cached link or keyframe, and caches every link
    it decodes.

    Raises:
        ChainError: a base of the chain is missing.
        CheckpointError: a link is not an excp file, is corrupted, or the chain loops.
    """
    chain, seen = [], set()
    cur, cur_sha = path, sha
    weights = None
    while True:
        weights = _cached(cur_sha)
        if weights is not None:
            break
        if cur_sha in seen:
            fail(path, "its chain of bases loops")
        seen.add(cur_sha)
        m = FileMap(cur)
        try:
            index = load_index(m)
        finally:
            m.close()
        if index["mode"] != "excp":
            fail(cur, f"is a lossy {index['mode']} file; only excp files form chains")
        chain.append((cur, cur_sha))
        if index["base"] is None:
            break
        cur, cur_sha = find_base(cur, index, None)
    for link, link_sha in reversed(chain):
        m = FileMap(link)
        try:
            index = load_index(m)
            weights = Decoder(link, m, index, weights, threads).weights()
        finally:
            m.close()
        remember(link_sha, weights)
    return weights
