#!/usr/bin/env bash
# Launch launch_scripts/train_ddp.py (TinyLM, DDP + huffman_hook, gloo) with torchrun.
#
# One node, 2 processes (launcher options: launch_scripts/_launch.sh; the rest goes to
# train_ddp.py):
#   bash launch_scripts/run_ddp.sh --steps 40 --dtype bf16
#   bash launch_scripts/run_ddp.sh --nproc-per-node 4 --save-codebooks /tmp/books.json
#
# Several nodes: the same command on every node, with the node count, this node's rank and
# one address every node reaches (a c10d rendezvous there, or node 0 as static master):
#   bash launch_scripts/run_ddp.sh --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29400 --steps 40
#   bash launch_scripts/run_ddp.sh --nnodes 2 --node-rank 1 --rdzv-endpoint HOST:29400 --steps 40
#   (or --master-addr HOST --master-port 29500 instead of --rdzv-endpoint)
# gloo picks the interface that resolves the hostname; set GLOO_SOCKET_IFNAME=eth0 (etc.)
# when that is the wrong one.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch_scripts/_launch.sh
source launch_scripts/_launch.sh
# One intra-op thread per process unless told otherwise (train_ddp.py sets it too).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun "${TORCHRUN_ARGS[@]}" launch_scripts/train_ddp.py "${SCRIPT_ARGS[@]}"
