#!/usr/bin/env bash
# Launch launch_scripts/train_deepspeed.py (TinyLM, DeepSpeed ZeRO 0-3 on CPU with gloo,
# the comm_codec plugin configured by the "comm_codec" section of ds_config.json).
#
# Single node, NPROC processes (default 2), with torchrun (default) or the deepspeed
# launcher; extra arguments go to train_deepspeed.py:
#   bash launch_scripts/run_deepspeed.sh --steps 30
#   LAUNCHER=deepspeed bash launch_scripts/run_deepspeed.sh --steps 30 --stage 1 --dtype fp32
#   bash launch_scripts/run_deepspeed.sh --steps 30 --stage 3 --offload   # ZeRO-3, optimizer on the CPU
#   bash launch_scripts/run_deepspeed.sh --matrix --steps 30 --json /tmp/ds_matrix.json
#   bash launch_scripts/run_deepspeed.sh --no-plugin            # the same run, plain DeepSpeed
#
# Multi-node: run on every node, with this node's rank and one reachable HOST:PORT:
#   torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d \
#       --rdzv-endpoint HOST:29400 --rdzv-id ccds launch_scripts/train_deepspeed.py --steps 30
# or, from one node, with a hostfile ("host1 slots=2" per line) and passwordless ssh:
#   deepspeed --hostfile hostfile --master_addr HOST launch_scripts/train_deepspeed.py --steps 30
# gloo picks the interface that resolves the hostname; set GLOO_SOCKET_IFNAME=eth0 (etc.)
# when that is the wrong one.
set -euo pipefail
cd "$(dirname "$0")/.."
# One intra-op thread per process unless told otherwise (train_deepspeed.py sets it too).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
NPROC="${NPROC:-2}"
case "${LAUNCHER:-torchrun}" in
    torchrun)
        exec torchrun --standalone --nproc-per-node "$NPROC" launch_scripts/train_deepspeed.py "$@" ;;
    deepspeed)
        # On a CPU accelerator the launcher counts no GPUs: --num_gpus is the process count.
        exec deepspeed --num_gpus "$NPROC" --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29500}" \
            launch_scripts/train_deepspeed.py "$@" ;;
    *)
        echo "run_deepspeed.sh: LAUNCHER must be torchrun or deepspeed, got '$LAUNCHER'" >&2
        exit 2 ;;
esac
