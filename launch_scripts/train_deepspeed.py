"""Train TinyLM with DeepSpeed (ZeRO 0-3, CPU offload, gloo) and the comm_codec plugin.

The DeepSpeed config (``--deepspeed_config``, default ``launch_scripts/ds_config.json``)
carries a ``"comm_codec"`` section; ``comm_codec.deepspeed.initialize`` reads it (with no
``kinds`` it codes gradients, and at stage 3 the parameter all-gathers too). Ranks
come from the launcher's environment (torchrun, or the ``deepspeed`` launcher, which also
passes ``--local_rank``). See ``launch_scripts/run_deepspeed.sh``.

Usage::

    torchrun --standalone --nproc-per-node 2 launch_scripts/train_deepspeed.py --steps 30
    deepspeed --num_gpus 2 launch_scripts/train_deepspeed.py --steps 30 --zero-stage 1 --dtype fp32
    torchrun ... launch_scripts/train_deepspeed.py --zero-stage 3 --offload   # ZeRO-3, optimizer on the CPU
    # the same run without the plugin, for comparison:
    torchrun ... launch_scripts/train_deepspeed.py --no-plugin
    # every ZeRO stage x dtype, with and without the plugin, in one launch; prints the
    # loss comparison, bytes ratio and step times (and --json PATH writes them):
    torchrun ... launch_scripts/train_deepspeed.py --matrix --steps 30

Each (stage, dtype) pair trains from the same initial weights on the same batches with
and without the plugin, so losses can be compared step by step. (At stage 3 the coded
reduce-scatter sums in rank order and DeepSpeed's own in its own: on more than 2 ranks
losses may then agree to rounding only; tests/test_zero3.py checks them against a
rank-order reference.)
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.tools.tinylm import TinyLM, batches, load_corpus

log = logging.getLogger("train_deepspeed")
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        default=os.path.join(HERE, "ds_config.json"),
        help="DeepSpeed config with a comm_codec section (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--zero-stage",
        "--stage",
        dest="stage",
        type=int,
        choices=(0, 1, 2, 3),
        help="ZeRO stage 0-3: overrides zero_optimization.stage of the config (ds_config.json: 2)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="offload the optimizer to the CPU (zero_optimization.offload_optimizer; stage 2 or 3)",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="override the bf16 section")
    p.add_argument("--no-plugin", action="store_true", help="plain deepspeed.initialize (comm_codec off)")
    p.add_argument(
        "--matrix",
        action="store_true",
        help="run ZeRO 0,1,2 x fp32,bf16, each with and without the plugin; print a table",
    )
    p.add_argument("--stages", default="0,1,2,3", help="stages for --matrix (default: %(default)s)")
    p.add_argument("--dtypes", default="fp32,bf16", help="dtypes for --matrix (default: %(default)s)")
    p.add_argument("--codebooks", help='override comm_codec.codebooks ("default", "online" or a path)')
    p.add_argument("--warmup-steps", type=int, help="override comm_codec.warmup_steps")
    p.add_argument("--mode", choices=("auto", "always", "never"), help="override comm_codec.mode")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument(
        "--vocab",
        type=int,
        default=256,
        help="embedding/output rows (default 256: bytes); a BERT-like 30522 makes the "
        "embedding gradient mostly exact zeros, as in real LMs",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch and codec (numba) threads per process (default: cores / local processes)",
    )
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="DeepSpeed and comm_codec info logs")
    return p.parse_args(argv)


def run_config(base: dict, stage: int | None, dtype: str | None, plugin: bool, offload: bool = False) -> dict:
    """The DeepSpeed config of one run: base with stage, dtype, offload and the plugin switch applied."""
    cfg = copy.deepcopy(base)
    if stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = stage
    if offload:
        cfg.setdefault("zero_optimization", {})["offload_optimizer"] = {"device": "cpu"}
    if dtype is not None:
        cfg["bf16"] = {"enabled": dtype == "bf16"}
    cfg.setdefault("comm_codec", {})["enabled"] = plugin
    return cfg


def train(cfg: dict, args, rank: int, world: int) -> dict:
    """Train ``args.steps`` steps with one config; return losses, step times and stats."""
    import comm_codec.deepspeed as ccds

    torch.manual_seed(args.seed)
    model = TinyLM(vocab=args.vocab, d_model=args.d_model, n_layers=args.layers, seq_len=args.seq_len)
    engine, *_ = ccds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = batches(
        load_corpus(),
        engine.train_micro_batch_size_per_gpu(),
        args.seq_len,
        seed=args.seed,
        rank=rank,
        world_size=world,
    )
    losses, times = [], []
    for step in range(args.steps):
        dist.barrier()  # time the steps, not the stragglers of the previous one
        t0 = time.perf_counter()
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(data)
            logits = engine(x)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if rank == 0 and (step + 1) % max(1, args.steps // 5) == 0:
            log.info("step %d loss %.4f (%.0f ms)", step + 1, losses[-1], 1e3 * times[-1])
    plugin = cfg.get("comm_codec", {}).get("enabled", False)
    stats = ccds.stats(engine).as_dict() if plugin else None
    if stats:
        # Per-rank counts differ (each rank codes other shards); the wire carries them all.
        total = torch.tensor([stats["bytes_in"], stats["bytes_out"]], dtype=torch.float64)
        dist.all_reduce(total)
        stats["world_bytes_in"], stats["world_bytes_out"] = int(total[0]), int(total[1])
        stats["world_ratio"] = stats["world_bytes_in"] / max(1, stats["world_bytes_out"])
    warm = cfg.get("comm_codec", {}).get("warmup_steps", 0) if plugin else 0
    timed = times[max(2, warm) :] or times
    return {
        "losses": losses,
        "ms_per_step": 1e3 * statistics.median(timed),
        "stats": stats,
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
    }  # ZeRO-3: partitioned


def _compare(a: list, b: list) -> tuple[float, bool]:
    diff = max((abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b)), default=0.0)
    return diff, a == b


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "train_deepspeed.py: RANK is not set; start it with torchrun or the deepspeed launcher "
            "(see launch_scripts/run_deepspeed.sh)",
            file=sys.stderr,
        )
        return 2
    rank = int(os.environ["RANK"])
    os.environ.setdefault("LOCAL_RANK", str(args.local_rank if args.local_rank is not None else 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(levelname)s rank {rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)

    import deepspeed
    from deepspeed.utils import logger as ds_logger

    if not args.verbose:
        ds_logger.setLevel(logging.WARNING)
        logging.getLogger("comm_codec").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    with open(args.deepspeed_config, encoding="utf-8") as fh:
        base = json.load(fh)
    section = base.setdefault("comm_codec", {})
    # The codec's numba threads default to every core; with several ranks per machine
    # that oversubscribes the cores, and OpenMP's spinning barriers make coding ~10x slower.
    section.setdefault("threads", min(threads, _numba_threads()))
    if args.codebooks is not None:
        section["codebooks"] = args.codebooks
    if args.warmup_steps is not None:
        section["warmup_steps"] = args.warmup_steps
    if args.mode is not None:
        section["mode"] = args.mode
    if args.batch_size:
        base["train_micro_batch_size_per_gpu"] = args.batch_size
        base.pop("train_batch_size", None)

    if not args.matrix:
        cfg = run_config(base, args.stage, args.dtype, plugin=not args.no_plugin, offload=args.offload)
        result = train(cfg, args, rank, world)
        if rank == 0:
            st = result["stats"]
            print(
                f"{world} ranks, ZeRO {cfg['zero_optimization'].get('stage', 0)}, "
                f"{'bf16' if cfg.get('bf16', {}).get('enabled') else 'fp32'}, {result['params']:,} params: "
                f"final loss {result['losses'][-1]:.4f}, {result['ms_per_step']:.0f} ms/step"
                + (
                    f", wire ratio {st['world_ratio']:.3f} ({st['world_bytes_in'] / 1e6:.1f} -> "
                    f"{st['world_bytes_out'] / 1e6:.1f} MB, all ranks)"
                    if st
                    else " (no plugin)"
                )
            )
            _write_json(args.json, {"config": cfg, "world": world, **result})
        return 0

    rows = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for dtype in args.dtypes.split(","):
            offload = args.offload and stage >= 2
            off = train(run_config(base, stage, dtype, plugin=False, offload=offload), args, rank, world)
            on = train(run_config(base, stage, dtype, plugin=True, offload=offload), args, rank, world)
            # Every rank's losses must match; gather each rank's worst difference.
            diff, equal = _compare(on["losses"], off["losses"])
            # As a tensor, not all_gather_object: that would unpickle what each peer sends.
            from comm_codec.comm.agreement import collective_device

            mine = torch.tensor([diff, float(equal)], dtype=torch.float64, device=collective_device())
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            worst = [(float(t[0]), bool(t[1])) for t in parts]
            st = on["stats"]
            rows.append(
                {
                    "stage": stage,
                    "dtype": dtype,
                    "steps": args.steps,
                    "max_rel_loss_diff": max(d for d, _ in worst),
                    "bit_equal": all(e for _, e in worst),
                    "loss_first": off["losses"][0],
                    "loss_last_off": off["losses"][-1],
                    "loss_last_on": on["losses"][-1],
                    "ratio": st["world_ratio"],
                    "bytes_in": st["world_bytes_in"],
                    "bytes_out": st["world_bytes_out"],
                    "rank0_ratio": st["ratio"],
                    "ms_off": off["ms_per_step"],
                    "ms_on": on["ms_per_step"],
                    "encode_s": st["encode_seconds"],
                    "decode_s": st["decode_seconds"],
                    "coded_calls": st["calls"],
                    "raw_calls": st["raw_calls"],
                }
            )
            if rank == 0:
                log.info("ZeRO %d %s done: wire ratio %.3f", stage, dtype, st["world_ratio"])
    if rank == 0:
        print(
            f"\n{world} ranks, TinyLM {off['params']:,} params, {args.steps} steps, "
            f"comm_codec section: {json.dumps(base.get('comm_codec', {}))}"
        )
        print(
            "| ZeRO | dtype | loss step 1 | last loss, off | last loss, on | max rel. loss diff | bit-equal "
            "| wire ratio | MB in -> out, all ranks | ms/step off | ms/step on |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(
                f"| {r['stage']} | {r['dtype']} | {r['loss_first']:.4f} | {r['loss_last_off']:.6f} | "
                f"{r['loss_last_on']:.6f} | {r['max_rel_loss_diff']:.1e} | {'yes' if r['bit_equal'] else 'no'} | "
                f"{r['ratio']:.3f} | {r['bytes_in'] / 1e6:.1f} -> {r['bytes_out'] / 1e6:.1f} | "
                f"{r['ms_off']:.0f} | {r['ms_on']:.0f} |"
            )
        _write_json(args.json, {"world": world, "base_config": base, "rows": rows})
    return 0


def _numba_threads() -> int:
    import numba

    return numba.config.NUMBA_NUM_THREADS


def _write_json(path, data) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
