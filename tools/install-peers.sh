#!/usr/bin/env bash
# Installs the peer libraries the report (pindown-report) measures pindown
# against, and the font its PNG plots are drawn with, if missing:
#   openmpi-bin libopenmpi-dev   Open MPI (mpirun, mpicc)
#   mpich libmpich-dev           MPICH (mpiexec.hydra, mpicc.mpich)
#   ucx-utils libucx-dev         UCX (ucx_info; libucs/libucm and their
#                                headers for the registration-cache peer)
#   fonts-dejavu-core            DejaVu Sans for the PNG plots
#   pkg-config                   the compiler flags of UCX
# A peer that is missing when the report runs is reported as missing.
#
# Usage: tools/install-peers.sh
# Exit status 0 when everything is present afterwards.
set -euo pipefail
missing=()
for pkg in openmpi-bin libopenmpi-dev mpich libmpich-dev ucx-utils libucx-dev \
           fonts-dejavu-core pkg-config; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
    || missing+=("$pkg")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "install-peers: installing ${missing[*]}" >&2
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
    [[ -t 0 ]] || SUDO=(sudo -n)   # no terminal to ask for a password
  else
    echo "install-peers: not root and no sudo; install ${missing[*]} by hand" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
