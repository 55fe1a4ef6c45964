#!/usr/bin/env bash
# Launch launch_scripts/train_ddp.py (TinyLM, DDP + huffman_hook, gloo) with torchrun.
#
# Single node, NPROC processes (default 2); extra arguments go to train_ddp.py:
#   bash launch_scripts/run_ddp.sh --steps 40 --dtype bf16
#   NPROC=4 bash launch_scripts/run_ddp.sh --save-codebooks /tmp/books.json
#
# Multi-node: run the same command on every node, with this node's rank, the node count
# and one reachable HOST:PORT (any node; the c10d rendezvous starts there):
#   torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \
#       --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id ccdemo \
#       launch_scripts/train_ddp.py --steps 40
#   torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 \
#       --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id ccdemo \
#       launch_scripts/train_ddp.py --steps 40
# gloo picks the interface that resolves the hostname; set GLOO_SOCKET_IFNAME=eth0 (etc.)
# when that is the wrong one.
set -euo pipefail
cd "$(dirname "$0")/.."
# One intra-op thread per process unless told otherwise (train_ddp.py sets it too).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" launch_scripts/train_ddp.py "$@"
