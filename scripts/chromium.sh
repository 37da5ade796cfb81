#!/usr/bin/env bash
# Headless Chromium for rendering meshyard's pages (the report, the dashboard) and for the
# tests that check them: installs Debian's chromium package when it is missing, then prints
# the path of the browser on one line.
# Idempotent: when a browser is already on PATH it changes nothing.
# Installing needs root and apt-get; finding an installed browser does not.
#
#   chromium=$(scripts/chromium.sh) && "$chromium" --headless --screenshot=page.png URL
#
# Exits non-zero with one line saying why there is no browser when it cannot have one.
set -uo pipefail

fail() { echo "chromium: $*" >&2; exit 1; }

found() {
  local name
  for name in chromium chromium-browser google-chrome; do
    command -v "$name" >/dev/null && { command -v "$name"; return 0; }
  done
  return 1
}

install_package() {
  [ "$(id -u)" = 0 ] || fail "chromium is not installed and installing it needs root; run: sudo apt-get install chromium"
  command -v apt-get >/dev/null || fail "chromium is not installed and there is no apt-get to install it"
  export DEBIAN_FRONTEND=noninteractive
  # Several test sessions may ask at once: wait for dpkg's lock rather than failing on it.
  local wait=(-o DPkg::Lock::Timeout=300)
  apt-get "${wait[@]}" update -qq >/dev/null 2>&1 || fail "apt-get update failed (no network or no package sources?)"
  apt-get "${wait[@]}" install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null 2>&1 \
    || fail "apt-get install chromium failed"
}

found && exit 0
install_package
found || fail "apt-get installed chromium but no chromium is on PATH"
