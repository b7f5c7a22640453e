#!/usr/bin/env bash
# slurm/vcluster.sh - a multi-node cluster on one machine: each "node" is a network
# namespace with its own host name and address, all joined by a bridge whose links can be
# rate-limited (tbf), and MPI runs across them over TCP.
#
#   bash slurm/vcluster.sh up [NODES] [RATE]   # mpidl-node1..NODES (default 2); RATE: a tbf
#                                              # rate such as 1gbit or 100mbit (default: none)
#   bash slurm/vcluster.sh mpiexec -n 4 -ppn 2 .venv/bin/python -m mpi4py script.py ...
#   bash slurm/vcluster.sh status
#   bash slurm/vcluster.sh down                # removes exactly what `up` made
#
# Needs root, iproute2 (ip, tc) and util-linux (unshare). `up` records what it makes in
# $MPIDL_VCLUSTER_STATE (default /run/mpidl-vcluster) and is idempotent: a second `up` with
# the same nodes and rate does nothing; `down` reads the record, so it never touches a
# namespace, link or /etc/hosts line it did not make.
#
# `mpiexec` runs the venv's MPICH Hydra across the nodes: Hydra's ssh launcher is replaced by
# slurm/vcluster-launch (it enters the node's namespace and sets its host name), -iface puts
# the proxies' call-back on the bridge, and UCX_TLS=tcp,self keeps MPICH from using shared
# memory between "nodes" (one machine, one boot id: it would otherwise bypass the network).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
STATE=${MPIDL_VCLUSTER_STATE:-/run/mpidl-vcluster}
BRIDGE=mpidlbr0
NET=10.88.0
MARK="# mpidl-vcluster"

die() { echo "vcluster: error: $*" >&2; exit 1; }

node_names() { # the node names of the recorded cluster, one per line
  [ -f "$STATE/nodes" ] && cat "$STATE/nodes"
}

up() {
  local n=${1:-2} rate=${2:-}
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "NODES must be 1..200, got '$n'"
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  if [ -f "$STATE/nodes" ]; then
    if [ "$(wc -l < "$STATE/nodes")" = "$n" ] && [ "$(cat "$STATE/rate")" = "$rate" ]; then
      echo "vcluster: already up: $(paste -sd' ' "$STATE/nodes")${rate:+, links $rate}"
      return
    fi
    die "a cluster of $(wc -l < "$STATE/nodes") node(s) (rate '$(cat "$STATE/rate")') is up; run '$0 down' first"
  fi
  mkdir -p "$STATE"
  : > "$STATE/nodes"
  echo "$rate" > "$STATE/rate"
  ip link add "$BRIDGE" type bridge
  echo "$BRIDGE" > "$STATE/bridge"
  ip addr add "$NET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i name
  for i in $(seq 1 "$n"); do
    name=mpidl-node$i
    ip netns add "$name"
    echo "$name" >> "$STATE/nodes"
    ip link add "mpidl-v$i" type veth peer name eth0 netns "$name"
    ip link set "mpidl-v$i" master "$BRIDGE" up
    ip -n "$name" addr add "$NET.$i/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" link set lo up
    if [ -n "$rate" ]; then  # both directions: into the node (bridge side) and out of it
      tc qdisc add dev "mpidl-v$i" root tbf rate "$rate" burst 256kb latency 50ms
      ip netns exec "$name" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
    fi
    echo "$NET.$i $name $MARK" >> /etc/hosts
  done
  echo "vcluster: up: $(paste -sd' ' "$STATE/nodes")${rate:+, links $rate} (bridge $BRIDGE, $NET.0/24)"
}

down() {
  [ -d "$STATE" ] || { echo "vcluster: nothing to take down"; return; }
  local name
  while read -r name; do
    [ -n "$name" ] || continue
    ip netns pids "$name" 2>/dev/null | xargs -r kill 2>/dev/null || true  # ranks left behind
    ip netns del "$name" 2>/dev/null || true  # (removes its veth pair too)
  done < <(node_names || true)
  if [ -f "$STATE/bridge" ]; then
    ip link del "$(cat "$STATE/bridge")" 2>/dev/null || true
  fi
  if grep -q "$MARK" /etc/hosts; then
    # (in place: /etc/hosts may be a bind mount that cannot be replaced)
    local kept
    kept=$(grep -v "$MARK" /etc/hosts)
    printf '%s\n' "$kept" > /etc/hosts
  fi
  rm -rf "$STATE"
  echo "vcluster: down"
}

status() {
  if [ ! -f "$STATE/nodes" ]; then echo "vcluster: down"; return 1; fi
  local rate
  rate=$(cat "$STATE/rate")
  echo "vcluster: up: $(paste -sd' ' "$STATE/nodes"), links ${rate:-not limited}"
}

run_mpiexec() {
  [ -f "$STATE/nodes" ] || die "the cluster is down: run '$0 up' first"
  local mpiexec=${MPIEXEC:-$ROOT/.venv/bin/mpiexec}
  [ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec) || die "no mpiexec (set MPIEXEC)"
  exec "$mpiexec" -launcher ssh -launcher-exec "$HERE/vcluster-launch" -iface "$BRIDGE" \
    -hosts "$(paste -sd, "$STATE/nodes")" -genv UCX_TLS tcp,self "$@"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) status ;;
  mpiexec) shift; run_mpiexec "$@" ;;
  *) echo "usage: $0 up [NODES] [RATE] | mpiexec ARGS... | status | down" >&2; exit 2 ;;
esac
