# Launcher options shared by run_ddp.sh, run_fsdp.sh and run_deepspeed.sh (sourced, not run).
#
#   --nproc-per-node P          processes on this node (default: $NPROC or 2)
#   --nnodes N                  nodes in the job (default 1: a standalone single-node run)
#   --node-rank R               this node's rank, 0..N-1
#   --rdzv-endpoint HOST:PORT   a c10d rendezvous at HOST:PORT (any node; the store starts there)
#   --master-addr HOST          or: static rendezvous, node 0's address ...
#   --master-port PORT          ... and a free port there (default: $MASTER_PORT or 29500)
#   --rdzv-id ID                the job id of a c10d rendezvous (default: $RDZV_ID or comm_codec)
#   --                          everything after it goes to the training script as it is
#
# The spellings torchrun and the deepspeed launcher use (--nproc_per_node, --node_rank,
# --master_addr, ...) and the --opt=value form are accepted. Every other argument goes to the
# training script, in order. Sets NPROC, NNODES, NODE_RANK, RDZV_ENDPOINT, MASTER_ADDR_ARG,
# MASTER_PORT_ARG, RDZV_ID, SCRIPT_ARGS (an array) and TORCHRUN_ARGS (an array).

NPROC="${NPROC:-2}"
NNODES=1
NODE_RANK=0
RDZV_ENDPOINT=""
MASTER_ADDR_ARG=""
MASTER_PORT_ARG="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-comm_codec}"
SCRIPT_ARGS=()

_launch_usage_error() {
    echo "$(basename "$0"): $1" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    opt="$1"
    value=""
    case "$opt" in
        --*=*) value="${opt#*=}"; opt="${opt%%=*}"; shift ;;
        --nproc-per-node|--nproc_per_node|--nnodes|--node-rank|--node_rank|--rdzv-endpoint|--rdzv_endpoint|\
        --master-addr|--master_addr|--master-port|--master_port|--rdzv-id|--rdzv_id)
            [ $# -ge 2 ] || _launch_usage_error "$opt needs a value"
            value="$2"; shift 2 ;;
        --) shift; SCRIPT_ARGS+=("$@"); break ;;
        *) SCRIPT_ARGS+=("$1"); shift; continue ;;
    esac
    case "$opt" in
        --nproc-per-node|--nproc_per_node) NPROC="$value" ;;
        --nnodes) NNODES="$value" ;;
        --node-rank|--node_rank) NODE_RANK="$value" ;;
        --rdzv-endpoint|--rdzv_endpoint) RDZV_ENDPOINT="$value" ;;
        --master-addr|--master_addr) MASTER_ADDR_ARG="$value" ;;
        --master-port|--master_port) MASTER_PORT_ARG="$value" ;;
        --rdzv-id|--rdzv_id) RDZV_ID="$value" ;;
        *) SCRIPT_ARGS+=("$opt=$value") ;;  # --opt=value of the training script
    esac
done

for _n in "$NPROC" "$NNODES" "$NODE_RANK" "$MASTER_PORT_ARG"; do
    [[ "$_n" =~ ^[0-9]+$ ]] || _launch_usage_error "expected a number, got '$_n'"
done
[ "$NNODES" -ge 1 ] && [ "$NPROC" -ge 1 ] || _launch_usage_error "--nnodes and --nproc-per-node must be >= 1"
[ "$NODE_RANK" -lt "$NNODES" ] || _launch_usage_error "--node-rank $NODE_RANK is not in 0..$((NNODES - 1))"
if [ "$NNODES" -gt 1 ] && [ -z "$RDZV_ENDPOINT" ] && [ -z "$MASTER_ADDR_ARG" ]; then
    _launch_usage_error "--nnodes $NNODES needs --rdzv-endpoint HOST:PORT or --master-addr HOST (the same on every node)"
fi

if [ -n "$RDZV_ENDPOINT" ]; then
    # c10d assigns node ranks itself (torchrun ignores --node-rank there)
    TORCHRUN_ARGS=(--nnodes "$NNODES" --nproc-per-node "$NPROC"
                   --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
elif [ -n "$MASTER_ADDR_ARG" ]; then
    TORCHRUN_ARGS=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC"
                   --master-addr "$MASTER_ADDR_ARG" --master-port "$MASTER_PORT_ARG")
else
    TORCHRUN_ARGS=(--standalone --nproc-per-node "$NPROC")
fi
