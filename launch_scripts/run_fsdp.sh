#!/usr/bin/env bash
# Launch launch_scripts/train_fsdp.py (TinyLM, FSDP2 + comm_codec.fsdp, gloo) with torchrun.
#
# Single node, NPROC processes (default 2); extra arguments go to train_fsdp.py:
#   bash launch_scripts/run_fsdp.sh --steps 40 --dtype bf16
#   NPROC=4 bash launch_scripts/run_fsdp.sh --save-codebooks /tmp/books.json
#
# Multi-node: run the same command on every node, with this node's rank, the node count
# and one reachable HOST:PORT (the c10d rendezvous starts there):
#   torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \
#       --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id ccfsdp \
#       launch_scripts/train_fsdp.py --steps 40
#   (and --node-rank 1 on the other node). Set GLOO_SOCKET_IFNAME=eth0 (etc.) when gloo
#   picks the wrong interface.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" launch_scripts/train_fsdp.py "$@"
