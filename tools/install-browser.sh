#!/usr/bin/env bash
# System packages (`make setup-browser`): Debian's chromium, its chromedriver and a font, for
# the dashboard's browser test and screenshot. Installs with apt-get as root (or through sudo)
# and says so; nothing is downloaded outside the distribution's packages.
set -euo pipefail
PACKAGES=(chromium chromium-driver fonts-dejavu-core)
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  echo "install-browser: chromium and chromedriver already installed"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install-browser: need root (or sudo) to apt-get install chromium chromium-driver" >&2
    exit 1
  fi
fi
echo "install-browser: apt-get install ${PACKAGES[*]}${SUDO:+ (through sudo)}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
chromium --version
