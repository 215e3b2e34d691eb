#!/usr/bin/env bash
# Installs every Debian package the tests need, if missing: the guest
# tooling (tools/guest/install-deps.sh), the report's peers and plot font
# (tools/install-peers.sh: Open MPI, MPICH, UCX, DejaVu; the MPIs are also
# the vector transfer baselines, the MPI_Pack cross-check and the
# launchers of the fabric tests) and iproute2 (the network namespaces the
# fabric's hosts live in).
#
# Usage: tools/install-test-deps.sh
# Exit status 0 when everything is present afterwards.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
"$here/guest/install-deps.sh"
"$here/install-peers.sh"

missing=()
for pkg in iproute2; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
    || missing+=("$pkg")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "install-test-deps: installing ${missing[*]}" >&2
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
  else
    echo "install-test-deps: not root and no sudo; install ${missing[*]} by hand" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
