#!/usr/bin/env bash
# All-reduce bandwidth benchmark: huffman_hook against PyTorch's hooks on real gradient
# buckets, 2 and 4 gloo ranks, on loopback shaped to 1 and 10 Gbit/s inside a network
# namespace, then on plain loopback. Needs root (ip netns, tc) and iproute2.
#
#   bash launch_scripts/bench_allreduce.sh            # a few minutes (building the data first)
#   bash launch_scripts/bench_allreduce.sh --quick    # 3 repetitions, no DDP step timing
#   options: --out DIR (default /tmp/comm_codec_bench), --fresh (rebuild the gradient
#            buckets and books), --no-netns (plain loopback only, no root needed)
#
# Besides the all-reduce of one 25 MB bucket, the full run times whole DDP training steps
# at 1 Gbit/s (2 ranks only: more ranks than cores would time the CPU, not the link). The namespace
# (default name ccbw, or $CCBW_NS) holds only 127.0.0.1; the loopback's rate is shared by
# all ranks. It is deleted on exit, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=/tmp/comm_codec_bench
REPS=5
E2E=3
FRESH=0
NETNS=1
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) REPS=3; E2E=0 ;;
        --out) OUT="$2"; shift ;;
        --fresh) FRESH=1 ;;
        --no-netns) NETNS=0 ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "bench_allreduce.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done

PY="${PYTHON:-python}"
BENCH=launch_scripts/bench_allreduce.py
RESULTS="$OUT/results"
FILES=()
FAILED=0
source launch_scripts/netns.sh
if [ "$NETNS" = 1 ]; then
    netns_check bench_allreduce.sh
fi

start=$(date +%s)
echo "comm_codec all-reduce benchmark, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at start"
echo "(other processes on these cores distort every timing below: check the load average)"
mkdir -p "$RESULTS"
rm -f "$RESULTS"/*.json
if [ "$FRESH" = 1 ] || [ ! -f "$OUT/data/meta.json" ]; then
    "$PY" "$BENCH" prepare --out "$OUT/data"
else
    echo "reusing the gradient buckets and books in $OUT/data (--fresh rebuilds them)"
fi
echo

run() {  # run LABEL RATE WORLD [ip netns exec NS]
    local label="$1" rate="$2" world="$3"; shift 3
    local json="$RESULTS/$(echo "$label" | tr -cd '[:alnum:]')_w$world.json"
    local e2e="$E2E"
    # Whole DDP steps: where the link is slow, and on 2 ranks only (4 ranks' steps on 2
    # cores would time the CPU, not the link).
    if [ "$world" -gt 2 ] || [ "$rate" != 1 ]; then e2e=0; fi
    if timeout -k 10 600 "$@" env GLOO_SOCKET_IFNAME=lo "$PY" "$BENCH" run --data "$OUT/data" \
        --world-size "$world" --network "$label" --rate-gbit "$rate" --reps "$REPS" --e2e-steps "$e2e" \
        --json "$json"; then
        FILES+=("$json")
    else
        echo "bench_allreduce.sh: the $label run with $world ranks failed (status $?)" >&2
        FAILED=1
    fi
}

if [ "$NETNS" = 1 ]; then
    netns_up 1gbit
    # (TORCH_CPP_LOG_LEVEL: the namespace has no DNS, and c10d warns about every peer's name)
    for w in 2 4; do run "1 Gbit/s" 1 "$w" ip netns exec "$NS" env TORCH_CPP_LOG_LEVEL=ERROR; done
    netns_rate 10gbit
    for w in 2 4; do run "10 Gbit/s" 10 "$w" ip netns exec "$NS" env TORCH_CPP_LOG_LEVEL=ERROR; done
    netns_down
fi
for w in 2 4; do run "unshaped" 0 "$w"; done

echo "== summary ($(($(date +%s) - start)) s; load average $(cut -d' ' -f1-3 /proc/loadavg) at the end) =="
"$PY" "$BENCH" summarize "${FILES[@]}"
exit "$FAILED"
