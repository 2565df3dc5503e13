#!/usr/bin/env bash
# Debian's chromium and its chromedriver, for the dashboard's browser test and screenshot.
# Nothing is downloaded outside the distribution's packages.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install-browser: need root (or sudo) to apt-get install chromium chromium-driver" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
chromium --version
