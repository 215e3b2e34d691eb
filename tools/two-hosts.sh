#!/usr/bin/env bash
# Runs a rank program under MPICH's Hydra (mpiexec.hydra) on two hosts:
# two network namespaces joined by a veth pair (10.231.0.1 and
# 10.231.0.2), one pindown device process in each, joined into one fabric
# over UDP with a fresh job token. Ranks r = 0, 2, 4, ... use host 0's
# device and r = 1, 3, ... host 1's, so neighbouring ranks talk across the
# fabric. Everything is torn down on exit.
#
# Usage: tools/two-hosts.sh [-n RANKS] PROGRAM [ARGS...]
#   RANKS: even, 2 or more (default 4).
# Needs root (ip netns), iproute2 and mpiexec.hydra (Debian mpich; both
# from tools/install-test-deps.sh), and the device binary:
# $PINDOWN_EMU_DEVICE, else target/release/pindown-emu-device (cargo build
# --release -p pindown-emu-device). Exit status: the launcher's.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
ranks=4
if [[ ${1:-} == -n && $# -ge 2 ]]; then
  ranks=$2
  shift 2
fi
if (($# < 1)) || ! [[ $ranks =~ ^[0-9]+$ ]] || ((ranks < 2 || ranks % 2)); then
  echo "usage: $0 [-n RANKS (even, >= 2)] PROGRAM [ARGS...]" >&2
  exit 64
fi
device=${PINDOWN_EMU_DEVICE:-$here/target/release/pindown-emu-device}
for tool in ip mpiexec.hydra "$device"; do
  command -v "$tool" >/dev/null || {
    echo "$0: $tool not found (tools/install-test-deps.sh; cargo build --release -p pindown-emu-device)" >&2
    exit 69
  }
done
[[ $(id -u) -eq 0 ]] || { echo "$0: network namespaces need root" >&2; exit 77; }

hosts=("pindown-qs-$$-0" "pindown-qs-$$-1")
address=(10.231.0.1 10.231.0.2)
work=$(mktemp -d /tmp/pindown-two-hosts.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for host in "${hosts[@]}"; do ip netns delete "$host" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

for i in 0 1; do ip netns add "${hosts[$i]}"; done
ip link add eth0 netns "${hosts[0]}" type veth peer name eth0 netns "${hosts[1]}"
for i in 0 1; do
  ip -n "${hosts[$i]}" addr add "${address[$i]}/24" dev eth0
  ip -n "${hosts[$i]}" link set eth0 up
  ip -n "${hosts[$i]}" link set lo up
done

token=$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')
ports=$((ranks / 2))
for i in 0 1; do
  peer=$((1 - i))
  mkdir -p "$work/host$i"
  PINDOWN_FABRIC_TOKEN=$token ip netns exec "${hosts[$i]}" "$device" \
    --socket-dir "$work/host$i" --ports "$ports" --node "$i" \
    --fabric-listen "${address[$i]}:7400" --fabric-peer "$peer=${address[$peer]}:7400" \
    >"$work/device$i.log" 2>&1 &
  pids+=($!)
done
# The devices are ready once every port's socket exists.
for _ in $(seq 100); do
  ready=$(find "$work"/host0 "$work"/host1 -name 'port*.sock' | wc -l)
  ((ready == ranks)) && break
  sleep 0.1
done
if ((ready != ranks)); then
  echo "$0: the devices did not come up; their logs:" >&2
  cat "$work"/device*.log >&2
  exit 1
fi
mkdir "$work/ranks"
for ((r = 0; r < ranks; r++)); do
  ln -s "$work/host$((r % 2))/port$((r / 2)).sock" "$work/ranks/port$r.sock"
done
echo "two-hosts: $ranks ranks, devices at ${address[0]} and ${address[1]} (token $token)" >&2
status=0
env -u PMI_FD -u PMI_PORT -u PINDOWN_DEVICE PINDOWN_DEVICE_DIR="$work/ranks" \
  mpiexec.hydra -n "$ranks" "$@" &
pids+=($!)   # stopped with the devices if this script is stopped
wait "$!" || status=$?
if ((status != 0)); then
  for i in 0 1; do
    [[ -s $work/device$i.log ]] && { echo "-- device on host $i:"; tail -n 20 "$work/device$i.log"; } >&2
  done
fi
exit "$status"
