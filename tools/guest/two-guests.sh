#!/usr/bin/env bash
# The guest quick start: boots two stock Linux guests (QEMU, TCG) whose
# network card is the emulated NIC: one pindown device process, both
# guests on its socket (each takes a port of the device's switch). The
# guests ping each other and one sends MIB MiB of random bytes to the
# other with busybox nc; the script prints each guest's results and exits
# 0 only if both pings were answered and the bytes arrived intact (the
# SHA-256 of what was sent equals that of what was received).
#
# Usage: tools/guest/two-guests.sh [MIB]     (default 4)
# Needs tools/guest/install-deps.sh's packages, and the device binary:
# $PINDOWN_EMU_DEVICE, else target/release/pindown-emu-device (cargo build
# --release -p pindown-emu-device). The guest kit (kernel and initramfs) is
# built into target/guest/net on first use.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mib=${1:-4}
device=${PINDOWN_EMU_DEVICE:-$root/target/release/pindown-emu-device}
kit=$root/target/guest/net
[[ -x $device ]] || { echo "$0: $device not found (cargo build --release -p pindown-emu-device)" >&2; exit 69; }
if [[ ! -f $kit/initramfs.cpio.gz || $here/init -nt $kit/initramfs.cpio.gz ]]; then
  "$here/build-initramfs.sh" --out "$kit" --no-install >/dev/null
fi

work=$(mktemp -d /tmp/pindown-two-guests.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$device" --socket-dir "$work" --ports 1 >"$work/device.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -S $work/port0.sock ]] && break; sleep 0.1; done
[[ -S $work/port0.sock ]] || { cat "$work/device.log" >&2; exit 1; }

# A guest's time limit: QEMU under TCG boots in seconds; a guest still
# running after this has hung (a receiver whose sender failed waits in nc).
limit=${PINDOWN_GUEST_TIMEOUT:-300}
guest() { # NAME N RUN
  exec timeout "$limit" "$here/run-guest.sh" --socket "$work/port0.sock" --log "$work/$1.log" --dir "$kit" \
    --mac "52:54:00:00:10:0$2" --ip "10.10.0.$2/24" --peer "10.10.0.$((3 - $2))" \
    --run "$3" --arg "size=$mib" >"$work/$1.qemu.log" 2>&1
}
guest sender 1 ping,send &
sender=$!
pids+=($sender)
guest receiver 2 ping,recv &
receiver=$!
pids+=($receiver)
# Each guest powers off after its last action, which ends its QEMU.
status=0
wait "$sender" || status=$?
wait "$receiver" || status=$?

result() { # GUEST KEY
  { sed -n "s/.*PINDOWN-RESULT.* $2=\([^ ]*\).*/\1/p; s/.*PINDOWN-RESULT $2=\([^ ]*\).*/\1/p" \
      "$work/$1.log" 2>/dev/null || true; } | tr -d '\r' | head -n 1
}
for g in sender receiver; do
  echo "== $g"
  { grep -a PINDOWN-RESULT "$work/$g.log" 2>/dev/null || true; } | tr -d '\r' |
    sed 's/^.*PINDOWN-RESULT /  /'
done
sent=$(result sender send_sha256)
got=$(result receiver recv_sha256)
if ((status == 0)) && [[ $(result sender ping) == ok && $(result receiver ping) == ok &&
      $(result sender send) == ok && -n $sent && $sent == "$got" &&
      $(result receiver recv_bytes) == $((mib << 20)) ]]; then
  echo "two guests: pings answered both ways; $mib MiB arrived intact (sha256 $sent)"
  exit 0
fi
echo "two guests: FAILED (exit status $status; 124 is the time limit). QEMU and the device said:" >&2
for f in "$work"/*.qemu.log "$work"/device.log; do
  [[ -s $f ]] && { echo "-- $(basename "$f")"; tail -n 20 "$f"; } >&2
done
exit 1
