# Sourced by the bandwidth benchmarks: a network namespace whose loopback is shaped with
# tbf. Only 127.0.0.1 lives in it, and it is deleted on exit,
# whatever happens. Set NS (default: $CCBW_NS or ccbw) before sourcing.
#
#   source launch_scripts/netns.sh
#   netns_check my_script.sh      # root, iproute2, no leftover namespace; exits 2 if not
#   netns_up 1gbit                # create, bring lo up, shape it
#   netns_rate 10gbit             # reshape
#   netns_down                    # delete (also runs on EXIT)

NS="${NS:-${CCBW_NS:-ccbw}}"
NETNS_CREATED=0

netns_down() {
    if [ "$NETNS_CREATED" = 1 ]; then
        ip netns del "$NS" 2>/dev/null || true
        NETNS_CREATED=0
        echo "(namespace $NS deleted)"
    fi
}
trap netns_down EXIT
trap 'exit 130' INT TERM

netns_check() {  # netns_check SCRIPT_NAME
    if [ "$(id -u)" != 0 ]; then
        echo "$1: network namespaces need root" >&2
        exit 2
    fi
    if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        echo "ip/tc not found: installing iproute2"
        apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
    fi
    if ip netns list | grep -qw "$NS"; then
        echo "$1: namespace $NS already exists (another run?); delete it with" \
             "'ip netns del $NS' or set CCBW_NS" >&2
        exit 2
    fi
}

netns_up() {  # netns_up RATE
    ip netns add "$NS"
    NETNS_CREATED=1
    ip netns exec "$NS" ip link set lo up
    ip netns exec "$NS" tc qdisc add dev lo root tbf rate "$1" burst 256kb latency 50ms
    echo "namespace $NS: $(ip netns exec "$NS" tc qdisc show dev lo)"
}

netns_rate() {  # netns_rate RATE
    ip netns exec "$NS" tc qdisc replace dev lo root tbf rate "$1" burst 256kb latency 50ms
    echo "namespace $NS: $(ip netns exec "$NS" tc qdisc show dev lo)"
}
