#!/usr/bin/env bash
# Refresh the dashboard's chart library (uPlot, MIT) from the npm registry. The files are
# committed so that the coordinator serves its dashboard with no network and no node at run time.
set -euo pipefail
VERSION="${1:-1.6.32}"
DEST="$(cd "$(dirname "$0")/.." && pwd)/services/coordinator/static/vendor"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
npm pack "uplot@$VERSION" >/dev/null
tar xzf "uplot-$VERSION.tgz"
cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css "$DEST/"
cp package/LICENSE "$DEST/uPlot.LICENSE"
echo "uPlot $VERSION -> $DEST"
