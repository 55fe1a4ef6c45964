#!/usr/bin/env bash
# Launch launch_scripts/train_deepspeed.py (TinyLM, DeepSpeed ZeRO 0-3 on CPU with gloo,
# the comm_codec plugin configured by the "comm_codec" section of ds_config.json).
#
# One node, 2 processes, with torchrun (default) or the deepspeed launcher (launcher
# options: launch_scripts/_launch.sh; the rest goes to train_deepspeed.py):
#   bash launch_scripts/run_deepspeed.sh --steps 30                    # ZeRO-2 (ds_config.json)
#   bash launch_scripts/run_deepspeed.sh --steps 30 --zero-stage 0     # or 1, 2, 3
#   bash launch_scripts/run_deepspeed.sh --steps 30 --zero-stage 3 --offload   # optimizer on the CPU
#   LAUNCHER=deepspeed bash launch_scripts/run_deepspeed.sh --steps 30 --zero-stage 1 --dtype fp32
#   bash launch_scripts/run_deepspeed.sh --matrix --steps 30 --json /tmp/ds_matrix.json
#   bash launch_scripts/run_deepspeed.sh --no-plugin            # the same run, plain DeepSpeed
#
# Several nodes: the same command on every node, with the node count, this node's rank and
# one address every node reaches:
#   bash launch_scripts/run_deepspeed.sh --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29400 --steps 30
#   bash launch_scripts/run_deepspeed.sh --nnodes 2 --node-rank 1 --rdzv-endpoint HOST:29400 --steps 30
# With LAUNCHER=deepspeed each node starts its own processes (deepspeed --no_ssh): give
# --master-addr HOST (node 0) and a hostfile listing every node ("host slots=2" per line) in
# HOSTFILE; or, from one node over passwordless ssh, run `deepspeed --hostfile hostfile
# --master_addr HOST launch_scripts/train_deepspeed.py` yourself.
# gloo picks the interface that resolves the hostname; set GLOO_SOCKET_IFNAME=eth0 (etc.)
# when that is the wrong one.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch_scripts/_launch.sh
source launch_scripts/_launch.sh
# One intra-op thread per process unless told otherwise (train_deepspeed.py sets it too).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
case "${LAUNCHER:-torchrun}" in
    torchrun)
        exec torchrun "${TORCHRUN_ARGS[@]}" launch_scripts/train_deepspeed.py "${SCRIPT_ARGS[@]}" ;;
    deepspeed)
        if [ "$NNODES" -eq 1 ]; then
            # On a CPU accelerator the launcher counts no GPUs: --num_gpus is the process count.
            exec deepspeed --num_gpus "$NPROC" --master_addr "${MASTER_ADDR_ARG:-127.0.0.1}" \
                --master_port "$MASTER_PORT_ARG" launch_scripts/train_deepspeed.py "${SCRIPT_ARGS[@]}"
        fi
        [ -n "$MASTER_ADDR_ARG" ] && [ -n "${HOSTFILE:-}" ] || {
            echo "run_deepspeed.sh: LAUNCHER=deepspeed on $NNODES nodes needs --master-addr HOST and HOSTFILE=path" >&2
            exit 2; }
        exec deepspeed --no_ssh --hostfile "$HOSTFILE" --node_rank "$NODE_RANK" --num_gpus "$NPROC" \
            --master_addr "$MASTER_ADDR_ARG" --master_port "$MASTER_PORT_ARG" \
            launch_scripts/train_deepspeed.py "${SCRIPT_ARGS[@]}" ;;
    *)
        echo "run_deepspeed.sh: LAUNCHER must be torchrun or deepspeed, got '$LAUNCHER'" >&2
        exit 2 ;;
esac
