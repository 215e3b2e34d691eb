#!/usr/bin/env bash
# Starts one test guest: QEMU 7.2 (TCG) on q35 with an intel-iommu (device
# IOTLB), memfd guest memory shared with the vhost-user backend, and a
# virtio-net-pci NIC (iommu_platform, ATS, multiqueue) whose backend is
# emu-device's socket. The guest's console goes to a file; the guest role
# is passed on the kernel command line (see tools/guest/init).
#
# Usage: tools/guest/run-guest.sh --socket SOCK --log FILE [options] [-- QEMU-ARGS...]
#   --socket PATH     emu-device's vhost-user socket (must be listening)
#   --log FILE        console output (serial port)
#   --mac MAC         the NIC's MAC (default 52:54:00:00:10:01)
#   --ip ADDR/LEN     guest address of eth0 (default 10.10.0.1/24)
#   --peer ADDR       the other guest (default 10.10.0.2)
#   --run ACTIONS     comma-separated actions of /init (default ping)
#   --arg KEY=VALUE   extra pindown.KEY=VALUE on the kernel command line
#   --queues N        queue pairs of the NIC (default 2)
#   --smp N           vCPUs (default 1)
#   --mem SIZE        guest memory (default 256M)
#   --dir DIR         where build-initramfs.sh put its output (default target/guest)
#   --reboot          let a guest reboot (default: a reboot ends QEMU)
#   --aw-bits N       IOVA width of the guest's intel-iommu (QEMU's default
#                     is 39; a VFIO driver using identity IOVAs needs 48)
#   --no-iommu        no intel-iommu, and a NIC without iommu_platform/ats
#   --paused          no kernel: QEMU starts paused (-S), performs the
#                     vhost-user handshake with the device and waits
# The script execs QEMU, so its pid is QEMU's. The guest powers off by itself
# after its last action.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dir="$root/target/guest"
socket="" log="" mac=52:54:00:00:10:01 ip=10.10.0.1/24 peer=10.10.0.2 run=ping
queues=2 smp=1 mem=256M
iommu=intel-iommu,intremap=on,caching-mode=on,device-iotlb=on
extra=()
noreboot=(-no-reboot)
paused=0
while (($#)); do
  case "$1" in
    --socket) socket=$2; shift 2 ;;
    --log) log=$2; shift 2 ;;
    --mac) mac=$2; shift 2 ;;
    --ip) ip=$2; shift 2 ;;
    --peer) peer=$2; shift 2 ;;
    --run) run=$2; shift 2 ;;
    --arg) extra+=("pindown.$2"); shift 2 ;;
    --queues) queues=$2; shift 2 ;;
    --smp) smp=$2; shift 2 ;;
    --mem) mem=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --reboot) noreboot=(); shift ;;
    --aw-bits) iommu+=",aw-bits=$2"; shift 2 ;;
    --no-iommu) iommu=""; shift ;;
    --paused) paused=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "run-guest: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [[ -z $socket || -z $log ]]; then
  echo "run-guest: --socket and --log are required" >&2
  exit 2
fi
boot=()
if ((paused)); then
  boot=(-S)
else
  for f in "$dir/vmlinuz" "$dir/initramfs.cpio.gz"; do
    if [[ ! -f $f ]]; then
      echo "run-guest: $f missing; run tools/guest/build-initramfs.sh first" >&2
      exit 1
    fi
  done
  # no_timer_check: a host busy with other work can make the guest's early
  # timer check fail under TCG, which panics with interrupt remapping on.
  append="console=ttyS0 loglevel=4 intel_iommu=on iommu=strict panic=-1 no_timer_check"
  append+=" pindown.ip=$ip pindown.peer=$peer pindown.run=$run ${extra[*]:-}"
  boot=(-kernel "$dir/vmlinuz" -initrd "$dir/initramfs.cpio.gz" -append "$append")
fi

mq=off
((queues > 1)) && mq=on
nic="virtio-net-pci,netdev=n0,bus=rp0,mac=$mac,mq=$mq,vectors=0,disable-legacy=on"
viommu=()
if [[ -n $iommu ]]; then
  viommu=(-device "$iommu")
  nic+=",iommu_platform=on,ats=on"
fi

# vectors=0: QEMU 7.2 under TCG crashes in the MSI-X irqfd path of a
# vhost-user NIC; INTx avoids it. intremap=on needs the split irqchip.
exec qemu-system-x86_64 \
  -M q35,accel=tcg,kernel-irqchip=split -cpu max -smp "$smp" -m "$mem" \
  -object "memory-backend-memfd,id=mem0,size=$mem,share=on" \
  -machine memory-backend=mem0 \
  "${viommu[@]}" \
  -device pcie-root-port,id=rp0,bus=pcie.0,chassis=1 \
  -chardev "socket,id=c0,path=$socket,server=off" \
  -netdev "vhost-user,id=n0,chardev=c0,queues=$queues" \
  -device "$nic" \
  "${boot[@]}" \
  -display none -nodefaults -serial "file:$log" "${noreboot[@]}" \
  "$@"
