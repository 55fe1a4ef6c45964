#!/usr/bin/env bash
# Launch launch_scripts/train_fsdp.py (TinyLM, FSDP2 + comm_codec.fsdp, gloo) with torchrun.
#
# One node, 2 processes (launcher options: launch_scripts/_launch.sh; the rest goes to
# train_fsdp.py):
#   bash launch_scripts/run_fsdp.sh --steps 40 --dtype bf16
#   bash launch_scripts/run_fsdp.sh --nproc-per-node 4 --save-codebooks /tmp/books.json
#
# Several nodes: the same command on every node, with the node count, this node's rank and
# one address every node reaches:
#   bash launch_scripts/run_fsdp.sh --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29400 --steps 40
#   bash launch_scripts/run_fsdp.sh --nnodes 2 --node-rank 1 --rdzv-endpoint HOST:29400 --steps 40
#   (or --master-addr HOST --master-port 29500). Set GLOO_SOCKET_IFNAME=eth0 (etc.) when gloo
#   picks the wrong interface.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch_scripts/_launch.sh
source launch_scripts/_launch.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun "${TORCHRUN_ARGS[@]}" launch_scripts/train_fsdp.py "${SCRIPT_ARGS[@]}"
