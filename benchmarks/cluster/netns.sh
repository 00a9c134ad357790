#!/usr/bin/env bash
# Emulated hosts on one machine: network namespaces joined by veth links through a bridge, each link
# rate-limited with tc, and MPI jobs launched across them.
#
#   sudo bash benchmarks/cluster/netns.sh up 4 1gbit        # hosts adasum-h0..h3, 10.213.0.1..4, 1 Gbit/s links
#   sudo bash benchmarks/cluster/netns.sh run 4 2 -- python benchmarks/allreduce.py   # 2 ranks per host
#   sudo bash benchmarks/cluster/netns.sh down
#
# Every address lives inside namespaces this script creates (the bridge too has its own namespace), so
# no traffic leaves them. Needs root, iproute2 (ip, tc) and the MPICH from this project's .venv. Inter-host
# traffic goes over TCP (MPICH's ofi netmod with the tcp provider); ranks on one host use shared memory.
set -euo pipefail
PREFIX=adasum
SUBNET=10.213.0
SWITCH=$PREFIX-sw
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

ns_of() { echo "$PREFIX-h$1"; }

up() {
    local n=$1 rate=$2
    ip netns add "$SWITCH"
    ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" link set br0 up
    for i in $(seq 0 $((n - 1))); do
        local ns; ns=$(ns_of "$i")
        ip netns add "$ns"
        ip link add adasum0 netns "$ns" type veth peer name "p$i" netns "$SWITCH"
        ip -n "$SWITCH" link set "p$i" master br0
        ip -n "$SWITCH" link set "p$i" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev adasum0
        ip -n "$ns" link set adasum0 up
        # shape both directions: host → switch on the host side, switch → host on the switch side
        tc -n "$ns" qdisc add dev adasum0 root tbf rate "$rate" burst 512kb latency 100ms
        tc -n "$SWITCH" qdisc add dev "p$i" root tbf rate "$rate" burst 512kb latency 100ms
    done
    echo "up: $n hosts at $rate: $(for i in $(seq 0 $((n - 1))); do printf '%s.%s ' $SUBNET $((i + 1)); done)"
}

down() {
    for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
        ip netns del "$ns"
    done
}

run() {
    local n=$1 per=$2
    shift 2
    [ "${1:-}" = "--" ] && shift
    local hostfile; hostfile=$(mktemp)
    for i in $(seq 0 $((n - 1))); do echo "$SUBNET.$((i + 1)):$per" >> "$hostfile"; done
    local bin="$ROOT/.venv/bin"
    ip netns exec "$(ns_of 0)" env PATH="$bin:$PATH" OMP_NUM_THREADS=1 \
        MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=adasum0 \
        MASTER_ADDR="$SUBNET.1" GLOO_SOCKET_IFNAME=adasum0 \
        "$bin/mpiexec" -launcher ssh -launcher-exec "$HERE/nsexec" -iface adasum0 -f "$hostfile" \
        -n $((n * per)) "$@"
    rm -f "$hostfile"
}

case "${1:-}" in
    up) up "${2:-2}" "${3:-1gbit}" ;;
    down) down ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 up HOSTS RATE | run HOSTS RANKS_PER_HOST -- COMMAND... | down" >&2; exit 2 ;;
esac
