#!/usr/bin/env bash
# Builds the guest initramfs: static busybox, tools/guest/init as /init, the
# kernel modules virtio_net needs (with their dependencies, in load order,
# resolved through modules.dep of the Debian cloud kernel), and optional
# extra binaries (with the shared libraries they link). Also copies the
# kernel image next to it.
#
# Usage: tools/guest/build-initramfs.sh [--out DIR] [--kver VERSION] [--bin PATH]...
#   --out DIR      output directory (default: target/guest); writes
#                  DIR/initramfs.cpio.gz and DIR/vmlinuz
#   --kver VER     kernel version (default: the newest *-cloud-amd64 in /lib/modules)
#   --bin PATH     also install PATH as /bin/<name> (repeatable)
#   --module NAME  also install kernel module NAME with its dependencies and
#                  load it at boot (repeatable; e.g. vfio-pci, vfio_iommu_type1)
#   --no-install   do not install missing Debian packages
#
# Prints the two output paths on success.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out="$root/target/guest"
kver=""
bins=()
modules=()
install=1
while (($#)); do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --kver) kver=$2; shift 2 ;;
    --bin) bins+=("$2"); shift 2 ;;
    --module) modules+=("$2"); shift 2 ;;
    --no-install) install=0; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "build-initramfs: unknown argument $1" >&2; exit 2 ;;
  esac
done

if ((install)); then
  "$here/install-deps.sh"
fi

if [[ -z $kver ]]; then
  kver=$(ls -1 /lib/modules | grep -- '-cloud-amd64$' | sort -V | tail -n1 || true)
fi
moddir=/lib/modules/$kver
if [[ -z $kver || ! -f $moddir/modules.dep || ! -f /boot/vmlinuz-$kver ]]; then
  echo "build-initramfs: no cloud kernel found (install linux-image-cloud-amd64)" >&2
  exit 1
fi
busybox=/bin/busybox
linkage=$(ldd "$busybox" 2>&1 || true)
if [[ ! -x $busybox ]] || ! grep -qE 'not a dynamic executable|statically linked' <<<"$linkage"; then
  echo "build-initramfs: $busybox is not static (install busybox-static)" >&2
  exit 1
fi

mkdir -p "$out"
stage=$(mktemp -d "$out/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT

# Module load order: dependencies first (depth-first over modules.dep).
declare -A seen=()
order=()
resolve() {
  local mod=$1 line deps d
  [[ -n ${seen[$mod]:-} ]] && return 0
  seen[$mod]=1
  line=$(grep -E "^(kernel/)?[^:]*/${mod}\.ko(\.[a-z]+)?:" "$moddir/modules.dep" | head -n1 || true)
  if [[ -z $line ]]; then
    # Built into the kernel: nothing to load.
    if grep -qE "/${mod}\.ko" "$moddir/modules.builtin" 2>/dev/null; then
      return 0
    fi
    echo "build-initramfs: module $mod not found for $kver" >&2
    exit 1
  fi
  deps=${line#*:}
  for d in $deps; do
    d=$(basename "$d")
    resolve "${d%%.ko*}"
  done
  order+=("${line%%:*}")
}
for m in virtio_pci virtio_net "${modules[@]}"; do
  resolve "$m"
done

mkdir -p "$stage"/{bin,sbin,dev,proc,sys,tmp,etc,lib/modules,usr/bin,usr/sbin}
cp "$busybox" "$stage/bin/busybox"
for applet in $("$busybox" --list); do
  [[ $applet == busybox ]] && continue
  ln -sf busybox "$stage/bin/$applet"
done
: > "$stage/lib/modules/load-order"
for rel in "${order[@]}"; do
  name=$(basename "$rel")
  case "$name" in
    *.ko) cp "$moddir/$rel" "$stage/lib/modules/$name" ;;
    *.ko.xz) xz -dc "$moddir/$rel" > "$stage/lib/modules/${name%.xz}"; name=${name%.xz} ;;
    *.ko.zst) zstd -qdc "$moddir/$rel" > "$stage/lib/modules/${name%.zst}"; name=${name%.zst} ;;
    *.ko.gz) gzip -dc "$moddir/$rel" > "$stage/lib/modules/${name%.gz}"; name=${name%.gz} ;;
  esac
  echo "$name" >> "$stage/lib/modules/load-order"
done

for b in "${bins[@]}"; do
  cp "$b" "$stage/bin/$(basename "$b")"
  # Shared libraries (and the loader) at their host paths.
  while read -r lib; do
    [[ -f $lib ]] || continue
    mkdir -p "$stage$(dirname "$lib")"
    cp -L "$lib" "$stage$lib"
  done < <(ldd "$b" 2>/dev/null | grep -oE '/[^ ]+' || true)
done

install -m 0755 "$here/init" "$stage/init"

(cd "$stage" && find . -print0 | sort -z | "$busybox" cpio --null -o -H newc 2>/dev/null) \
  | gzip -1 > "$out/initramfs.cpio.gz.tmp"
mv "$out/initramfs.cpio.gz.tmp" "$out/initramfs.cpio.gz"
cp "/boot/vmlinuz-$kver" "$out/vmlinuz.tmp"
mv "$out/vmlinuz.tmp" "$out/vmlinuz"
echo "$out/initramfs.cpio.gz"
echo "$out/vmlinuz"
