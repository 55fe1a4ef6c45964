"""DeepSpeed ZeRO-3 seams: the parameter all-gathers and gradient reduce-scatters, coded.

ZeRO-3 moves two things every step, and DeepSpeed 0.19 funnels each through one small
function (the same ones ZeRO++'s quantized paths use):

* **Parameter fetch**: ``Init``'s ``all_gather_coalesced`` (every param's closure; the
  fetch coordinator calls it before forward and backward, prefetches included) issues
  ``partition_parameters._dist_allgather_fn(input, output, group)``, asynchronously, and
  waits on the returned handle before it reads the parameters. Coded: every rank's shard
  goes out as a frame of "weight" books and every rank decodes the owners' exact bits,
  on the engine's worker, behind a :class:`~comm_codec.comm.engine.FutureWork` -- so the
  fetch DeepSpeed prefetches runs while the current module computes.
* **Gradient reduction**: ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`` calls
  ``stage3.reduce_scatter_coalesced(grads, group)``, which lays each rank's partitions of
  the bucket's gradients out as W rows, pre-divides by W and reduce-scatters. Coded: the
  rows are reduce-scattered with "gradient" books, and each rank sums all W raw rows in
  rank order in float32, divides by W (DeepSpeed's averaging) and rounds once -- the
  rule of the DDP hook and FSDP2, so a coded step is bit-identical to an uncoded
  rank-order reference. What DeepSpeed does around it (predivide and postscale
  factors, the gradient accumulation dtype, offload copies) stays its own.

The module functions are replaced once per process by dispatchers; they code only inside
a call that the per-engine wrappers (each parameter's ``all_gather_coalesced``, the
optimizer's ``__avg_scatter_grads``) mark on the calling thread, and are DeepSpeed's own
functions everywhere else (another engine, ``GatheredParameters``, persistent parameters
re-gathered after the step, which go through ``Init._all_gather``). Every collective of
the seams, coded or plain, runs on the engine's worker in call order, on a twin of
DeepSpeed's group with the world group's timeout (the one the user gave
``init_process_group``): a stalled rank fails the others within it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading

import torch
import torch.distributed as dist

from . import agreement, collectives
from .engine import CodingEngine

__all__ = ["FETCH_PARAMETERS", "SEAMS", "Zero3Seams", "check_fetch", "install_dispatchers", "seam_parameters"]

log = logging.getLogger(__name__)

# The DeepSpeed 0.19 functions the seams stand in for or wrap, with their parameters:
# (module under deepspeed., class or None for a module function, name).
SEAMS = {
    ("runtime.zero.partition_parameters", None, "_dist_allgather_fn"): ["input_tensor", "output_tensor", "group"],
    ("runtime.zero.stage3", None, "reduce_scatter_coalesced"): ["tensors", "group"],
    ("runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"): [
        "self",
        "params_to_reduce",
        "communication_data_type",
    ],
}
# The parameters of the per-parameter closure Init gives every ZeRO-3 parameter.
FETCH_PARAMETERS = ["params", "safe_mode", "quantize"]
_AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The seams whose DeepSpeed call is on this thread's stack (set by the wrappers).
_active = threading.local()
# DeepSpeed's own functions, which the dispatchers call outside a marked call.
_original: dict = {}
_install_lock = threading.Lock()


def _dispatch_all_gather(input_tensor, output_tensor, group=None):
    seams = getattr(_active, "seams", None)
    if seams is None:
        return _original["all_gather"](input_tensor, output_tensor, group)
    return seams.all_gather(input_tensor, output_tensor, group)


def _dispatch_reduce_scatter(tensors, group=None):
    seams = getattr(_active, "seams", None)
    if seams is None:
        return _original["reduce_scatter"](tensors, group)
    return seams.reduce_scatter(tensors, group)


def seam_parameters(fn) -> list[str] | None:
    """The parameter names of a DeepSpeed function, under its decorators; None if not a function.

    ``functools.wraps`` decorators are followed through ``__wrapped__``; DeepSpeed's
    ``instrument_w_nvtx`` (a plain ``(*args, **kwargs)`` closure) through its ``func`` cell.
    """
    import inspect

    for _ in range(8):
        if not callable(fn):
            return None
        inner = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        if inner is None and code is not None and "func" in code.co_freevars and fn.__closure__:
            inner = fn.__closure__[code.co_freevars.index("func")].cell_contents
        if inner is None:
            return list(inspect.signature(fn).parameters)
        fn = inner
    return None


def install_dispatchers() -> None:
    """Put the dispatchers in place of DeepSpeed's ZeRO-3 all-gather and reduce-scatter functions (once per process)."""
    with _install_lock:
        if _original:
            return
        pp = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
        s3 = importlib.import_module("deepspeed.runtime.zero.stage3")
        _original["all_gather"] = pp._dist_allgather_fn
        _original["reduce_scatter"] = s3.reduce_scatter_coalesced
        pp._dist_allgather_fn = _dispatch_all_gather
        s3.reduce_scatter_coalesced = _dispatch_reduce_scatter


def check_fetch(param) -> None:
    """Refuse a parameter whose fetch closure is not DeepSpeed 0.19's (a changed seam).

    Raises:
        RuntimeError: naming what changed.
    """
    params = seam_parameters(getattr(param, "all_gather_coalesced", None))
    if params != FETCH_PARAMETERS:
        raise RuntimeError(
            f"DeepSpeed's ZeRO-3 parameters no longer fetch through all_gather_coalesced"
            f"({', '.join(FETCH_PARAMETERS)}) (found {params}); comm_codec.deepspeed cannot "
            "install safely into it"
        )


class _Marked:
    """While active, this thread's ZeRO-3 collectives go to ``seams`` (re-entrant)."""

    __slots__ = ("seams", "saved")

    def __init__(self, seams):
        self.seams = seams

    def __enter__(self):
        self.saved = getattr(_active, "seams", None)
        _active.seams = self.seams

    def __exit__(self, *exc):
        _active.seams = self.saved


class Zero3Seams:
    """One engine's ZeRO-3 seams over its :class:`CodingEngine` (collectives "reduce_scatter", "all_gather").

    Args:
        coder: the coding engine (books, mode, worker, statistics).
        engine: the DeepSpeed engine (its module's parameters and its ZeRO-3 optimizer).
        kinds: the traffic to code: "gradient" (reduce-scatters), "weight" (all-gathers).

    Raises:
        RuntimeError: a seam is not DeepSpeed 0.19's.
    """

    __slots__ = ("coder", "kinds", "twin", "ranks", "step_open", "patched")

    def __init__(self, coder: CodingEngine, engine, kinds):
        self.coder = coder
        self.kinds = frozenset(kinds)
        self.step_open = False
        opt = engine.optimizer
        params = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
        for p in params[:1]:
            check_fetch(p)
        groups = {
            tuple(dist.get_process_group_ranks(g))
            for g in [opt.dp_process_group] + [p.ds_process_group for p in params]
        }
        if len(groups) != 1:
            raise ValueError(
                f"comm_codec.deepspeed: ZeRO-3 partitions over several groups {sorted(groups)}; "
                "it codes one data-parallel group over the whole world"
            )
        self.ranks = groups.pop()
        # Creating a group is collective: here, where every rank installs. The twin takes
        # the world group's timeout (DeepSpeed's own groups are made with 30 minutes).
        self.twin = agreement.twin_group(dist.group.WORLD, self.ranks)
        coder.use_group(self.twin)
        install_dispatchers()
        # (object, attribute, its own value before, or None where the class's showed through)
        self.patched = [(p, "all_gather_coalesced", vars(p).get("all_gather_coalesced")) for p in params]
        self.patched.append((opt, _AVG_SCATTER, vars(opt).get(_AVG_SCATTER)))
        for p in params:
            p.all_gather_coalesced = self._marking(p.all_gather_coalesced)
        setattr(opt, _AVG_SCATTER, self._marking(getattr(opt, _AVG_SCATTER)))

    def _marking(self, fn):
        @functools.wraps(fn)
        def marked(*args, **kwargs):
            with _Marked(self):
                return fn(*args, **kwargs)

        return marked

    # -- steps -----------------------------------------------------------------------------
    def open_step(self) -> None:
        """Begin the step at its first collective (on the worker, after what is queued)."""
        self.coder.keep_torch_threads()
        if not self.step_open:
            self.step_open = True
            self.coder.step_on_worker(end=False, begin=True)

    def close_step(self) -> None:
        """Count the step (after an optimizer step), on the worker."""
        self.coder.step_on_worker(end=True, begin=False)
        self.step_open = False
        self.coder.keep_torch_threads()

    def _twin_of(self, group):
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        if ranks != self.ranks:
            raise RuntimeError(
                f"comm_codec.deepspeed: ZeRO-3 called a collective on ranks {list(ranks)}, not "
                f"the data-parallel group {list(self.ranks)} the plugin installed over"
            )
        return self.twin

    # -- the collectives ------------------------------------------------------------------
    def all_gather(self, input_tensor: torch.Tensor, output_tensor: torch.Tensor, group):
        """``_dist_allgather_fn``: gather every rank's shard into ``output_tensor``; return a Work.

        Raises:
            ValueError: buffers DeepSpeed could not have meant (W x n on one side, n on the other).
        """
        self.open_step()
        twin = self._twin_of(group)
        world, n = len(self.ranks), input_tensor.numel()
        if output_tensor.numel() != world * n or output_tensor.dtype != input_tensor.dtype:
            raise ValueError(
                f"comm_codec.deepspeed: all-gather of {n} {input_tensor.dtype} elements into "
                f"{output_tensor.numel()} {output_tensor.dtype}, expected {world} x {n} of one dtype"
            )
        coder = self.coder

        def run():
            coder.dispatch(
                "all_gather",
                input_tensor,
                twin,
                numel_per_rank=n,
                kind="weight",
                allowed="weight" in self.kinds,
                coded=lambda stats: collectives.all_gather(
                    list(output_tensor.view(world, n)),
                    input_tensor,
                    coder.codec,
                    twin,
                    kind="weight",
                    stats=stats,
                    workspace=coder.workspace,
                ),
                plain=lambda: _all_gather_single(output_tensor, input_tensor, group=twin),
            )

        return coder.call(run, input_tensor, async_op=True)

    def reduce_scatter(self, tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
        """``reduce_scatter_coalesced``: this rank's averaged partition of every gradient, as DeepSpeed returns them.

        Each tensor is cut in W partitions of ``ceil(numel / W)`` elements (the last ones
        short or empty); row r holds partition r of every tensor, zero-padded.
        """
        self.open_step()
        twin = self._twin_of(group)
        world = len(self.ranks)
        rank = self.ranks.index(dist.get_rank())
        dtype = tensors[0].dtype
        sizes = [-(-t.numel() // world) for t in tensors]
        width = sum(sizes)
        rows = torch.zeros(world, width, dtype=dtype, device=tensors[0].device)
        offset = 0
        for t, size in zip(tensors, sizes):
            flat = t.reshape(-1)
            for r in range(world):
                part = flat[r * size : (r + 1) * size]
                rows[r, offset : offset + part.numel()] = part
            offset += size
        out = torch.empty(width, dtype=dtype, device=rows.device)
        coder = self.coder

        def plain():  # DeepSpeed's own: pre-divide, then sum
            rows.div_(world)
            _reduce_scatter_single(out, rows.view(-1), group=twin)

        def run():
            coder.dispatch(
                "reduce_scatter",
                rows,
                twin,
                numel_per_rank=width,
                kind="gradient",
                allowed="gradient" in self.kinds,
                plain=plain,
                coded=lambda stats: collectives.reduce_scatter(
                    out,
                    list(rows),
                    coder.codec,
                    twin,
                    average=True,
                    kind="gradient",
                    stats=stats,
                    workspace=coder.workspace,
                ),
            )

        coder.call(run, rows, async_op=False)
        self.coder.keep_torch_threads()
        parts, offset = [], 0
        for t, size in zip(tensors, sizes):
            mine = max(0, min(size, t.numel() - rank * size))
            parts.append(out.narrow(0, offset, mine))
            offset += size
        return parts
