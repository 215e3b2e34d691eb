#!/usr/bin/env bash
# Installs the Debian packages the guest tooling needs, if missing:
# qemu-system-x86 (QEMU 7.2), linux-image-cloud-amd64 (the guest kernel and
# its modules) and busybox-static (the guest's userland).
#
# Usage: tools/guest/install-deps.sh
# Exit status 0 when everything is present afterwards.
set -euo pipefail

installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

missing=()
for pkg in qemu-system-x86 linux-image-cloud-amd64 busybox-static; do
  installed "$pkg" || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
  else
    echo "install-deps: not root and no sudo; install ${missing[*]} by hand" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
