#!/usr/bin/env bash
# Makes a headless Chromium and its ChromeDriver answer on a Debian or Ubuntu machine where none
# does, as root: installs Debian's chromium and chromium-driver. Does nothing where both are on
# PATH. CI runs it so that the browser test of `omrl view` runs; it says why when it cannot.
set -uo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "no Chromium, and no way to install one here (needs root and apt-get)" >&2
    exit 1
fi
echo "installing chromium and chromium-driver from Debian's packages"
{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver; } \
    >/tmp/omrl-browser-install.log 2>&1 || { echo "install failed: see /tmp/omrl-browser-install.log" >&2; exit 1; }
echo "$(chromium --version) is installed"
