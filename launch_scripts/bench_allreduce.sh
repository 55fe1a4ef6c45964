#!/usr/bin/env bash
# All-reduce bandwidth benchmark: huffman_hook against PyTorch's hooks on real gradient
# buckets, 2 and 4 gloo ranks, on loopback shaped to 1 and 10 Gbit/s inside a network
# namespace, then on plain loopback. Needs root (ip netns, tc) and iproute2.
#
#   bash launch_scripts/bench_allreduce.sh            # ~2 min on 2 cores (+1.5 min building data)
#   bash launch_scripts/bench_allreduce.sh --quick    # 3 repetitions, no DDP step timing: ~1.5 min
#   options: --out DIR (default /tmp/comm_codec_bench), --fresh (rebuild the gradient
#            buckets and books), --no-netns (plain loopback only, no root needed)
#
# Besides the all-reduce of one 25 MB bucket, the full run times whole DDP training steps
# at 1 Gbit/s (2 ranks only: 4 ranks on 2 cores would time the CPU, not the link). The namespace
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

NS="${CCBW_NS:-ccbw}"
PY="${PYTHON:-python}"
BENCH=launch_scripts/bench_allreduce.py
RESULTS="$OUT/results"
CREATED=0
FILES=()
FAILED=0

cleanup() {
    if [ "$CREATED" = 1 ]; then
        ip netns del "$NS" 2>/dev/null || true
        CREATED=0
        echo "(namespace $NS deleted)"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$NETNS" = 1 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "bench_allreduce.sh: network namespaces need root; rerun as root or with --no-netns" >&2
        exit 2
    fi
    if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        echo "ip/tc not found: installing iproute2"
        apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
    fi
    if ip netns list | grep -qw "$NS"; then
        echo "bench_allreduce.sh: namespace $NS already exists (another run?); delete it with" \
             "'ip netns del $NS' or set CCBW_NS" >&2
        exit 2
    fi
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
    ip netns add "$NS"
    CREATED=1
    ip netns exec "$NS" ip link set lo up
    ip netns exec "$NS" tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 50ms
    echo "namespace $NS: $(ip netns exec "$NS" tc qdisc show dev lo)"
    # (TORCH_CPP_LOG_LEVEL: the namespace has no DNS, and c10d warns about every peer's name)
    for w in 2 4; do run "1 Gbit/s" 1 "$w" ip netns exec "$NS" env TORCH_CPP_LOG_LEVEL=ERROR; done
    ip netns exec "$NS" tc qdisc replace dev lo root tbf rate 10gbit burst 256kb latency 50ms
    echo "namespace $NS: $(ip netns exec "$NS" tc qdisc show dev lo)"
    for w in 2 4; do run "10 Gbit/s" 10 "$w" ip netns exec "$NS" env TORCH_CPP_LOG_LEVEL=ERROR; done
    cleanup
fi
for w in 2 4; do run "unshaped" 0 "$w"; done

echo "== summary ($(($(date +%s) - start)) s; load average $(cut -d' ' -f1-3 /proc/loadavg) at the end) =="
"$PY" "$BENCH" summarize "${FILES[@]}"
exit "$FAILED"
