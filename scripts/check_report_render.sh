#!/usr/bin/env bash
# Renders a run's report.html in headless Chromium and writes a screenshot, to check
# that the page (and its inlined plots) displays. Needs Debian's chromium package:
#   apt-get install -y chromium
# Usage: scripts/check_report_render.sh RUN_DIR [SCREENSHOT.png]
set -euo pipefail
run_dir=$1
shot=${2:-$run_dir/report.png}
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/.venv/bin/meshyard" report "$run_dir"
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --window-size=1200,2000 --screenshot="$shot" \
  "file://$(cd "$run_dir" && pwd)/report.html" 2>/dev/null
echo "screenshot: $shot"
