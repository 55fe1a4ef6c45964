#!/usr/bin/env bash
# DeepSpeed step time with and without the comm_codec plugin, 2 gloo ranks, on loopback
# shaped to 1 Gbit/s inside a network namespace (then unshaped with --unshaped too).
# Needs root (ip netns, tc) and iproute2.
#
#   bash launch_scripts/bench_deepspeed.sh                 # ZeRO 0 and 2, fp32 and bf16
#   bash launch_scripts/bench_deepspeed.sh --stages 0 --dtypes bf16 --steps 10
#   options: --stages LIST (0,2)  --dtypes LIST (fp32,bf16)  --steps N (12)  --warmup N (3)
#            --d-model N (512)  --layers N (4)  --batch N (2)  --vocab N (256)
#            --out DIR (/tmp/comm_codec_ds_bench)  --unshaped (also run on plain loopback)
#   MODE=auto bash ... times the plugin in auto mode (default: MODE=always, coding every step)
#   an embedding-heavy, BERT-sized vocabulary (its embedding gradient is mostly exact zeros):
#   bash launch_scripts/bench_deepspeed.sh --vocab 30522 --d-model 256 --layers 2
#
# The model is TinyLM made wide and fed small batches, so that moving its gradients, not
# computing them, is most of a step. The plugin builds books online in the first --warmup
# steps; step times are medians over the steps after that. The namespace (default ccbw,
# or $CCBW_NS) holds only 127.0.0.1 and is deleted on exit, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."

STAGES=0,2; DTYPES=fp32,bf16; STEPS=12; WARMUP=3; DMODEL=512; LAYERS=4; BATCH=2; VOCAB=256
OUT=/tmp/comm_codec_ds_bench; UNSHAPED=0
while [ $# -gt 0 ]; do
    case "$1" in
        --stages) STAGES="$2"; shift ;;
        --dtypes) DTYPES="$2"; shift ;;
        --steps) STEPS="$2"; shift ;;
        --warmup) WARMUP="$2"; shift ;;
        --d-model) DMODEL="$2"; shift ;;
        --layers) LAYERS="$2"; shift ;;
        --vocab) VOCAB="$2"; shift ;;
        --batch) BATCH="$2"; shift ;;
        --out) OUT="$2"; shift ;;
        --unshaped) UNSHAPED=1 ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "bench_deepspeed.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done

PY="${PYTHON:-python}"
source launch_scripts/netns.sh
netns_check bench_deepspeed.sh
mkdir -p "$OUT"
echo "comm_codec DeepSpeed benchmark, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at start"
echo "(other processes on these cores distort every timing below: check the load average)"

run() {  # run LABEL [ip netns exec NS]
    local label="$1"; shift
    local port=$((29600 + RANDOM % 300))
    echo "== $label =="
    timeout -k 10 1500 "$@" env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 \
        "$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 \
        --master-port "$port" launch_scripts/train_deepspeed.py --matrix --stages "$STAGES" \
        --dtypes "$DTYPES" --steps "$STEPS" --warmup-steps "$WARMUP" --mode "${MODE:-always}" \
        --d-model "$DMODEL" --layers "$LAYERS" --vocab "$VOCAB" --seq-len 64 --batch-size "$BATCH" \
        --json "$OUT/$(echo "$label" | tr -cd '[:alnum:]')_v$VOCAB.json"
}

netns_up 1gbit
run "1 Gbit/s" ip netns exec "$NS"
netns_down
if [ "$UNSHAPED" = 1 ]; then
    run "unshaped"
fi
echo "load average $(cut -d' ' -f1-3 /proc/loadavg) at the end; JSON in $OUT"
