#!/usr/bin/env bash
# The strategies benchmark across two emulated hosts (network namespaces joined by a veth pair,
# shaped with tc tbf), one rank per host, so the model's cross-host ("net") link class is real.
# Needs root and iproute2; removes what it creates, also on failure. Usage:
#   bash scripts/multihost_strategies.sh [RATE] [extra bench args...]    (RATE default 800mbit)
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-800mbit}; shift || true
BENCH_ARGS="$*"
A=cdmhA$$; B=cdmhB$$
cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$A"; ip netns add "$B"
ip link add va netns "$A" type veth peer name vb netns "$B"
ip -n "$A" addr add 10.213.0.1/24 dev va; ip -n "$B" addr add 10.213.0.2/24 dev vb
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set va up; ip -n "$B" link set vb up
ip netns exec "$A" tc qdisc add dev va root tbf rate "$RATE" burst 256kb latency 100ms
ip netns exec "$B" tc qdisc add dev vb root tbf rate "$RATE" burst 256kb latency 100ms
PORT=$((29000 + $$ % 1000))
run() {  # namespace, host name, interface, node rank
  ip netns exec "$1" unshare --uts sh -c "hostname $2; GLOO_SOCKET_IFNAME=$3 exec torchrun \
    --nnodes=2 --node_rank=$4 --nproc_per_node=1 --master_addr=10.213.0.1 --master_port=$PORT \
    -m conduit_dist.bench strategies $BENCH_ARGS"
}
run "$A" hostA va 0 &
pa=$!
run "$B" hostB vb 1 > /dev/null 2>&1 &
pb=$!
wait $pa; wait $pb
