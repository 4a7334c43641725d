#!/bin/sh
# Installs Chromium for the web page's browser tests (tests/browser.py) where none is found and apt can install
# it: as root or through passwordless sudo. Silent when a browser is there; elsewhere it says why it did nothing
# and exits 0: those tests then skip (.ci/run makes them fail).
set -eu

for name in "${PAGEDSERVE_CHROMIUM:-chromium}" chromium chromium-browser google-chrome google-chrome-stable chrome; do
    if command -v "$name" >/dev/null 2>&1; then
        exit 0
    fi
done

skip() {
    echo "install-chromium.sh: $1: the browser tests will skip" >&2
    exit 0
}

command -v apt-get >/dev/null 2>&1 || skip "no Chromium and no apt-get"
if [ "$(id -u)" -eq 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root="sudo -n"
else
    skip "no Chromium, and installing it needs root or passwordless sudo"
fi

echo "install-chromium.sh: installing Debian's chromium package for the browser tests" >&2
# $as_root is empty or a command and its flag: split on purpose.
# shellcheck disable=SC2086
$as_root apt-get update -qq >/dev/null || skip "apt-get update failed"
# shellcheck disable=SC2086
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null || skip "apt-get could not install chromium"
