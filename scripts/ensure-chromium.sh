#!/usr/bin/env bash
# The dashboard's tests drive a real headless Chromium through Playwright. They use
# Debian's chromium package (never `playwright install`, which downloads a browser).
set -euo pipefail
[ "$(uname -s)" = Linux ] || exit 0
command -v chromium >/dev/null && exit 0
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing Debian's chromium (the dashboard's browser tests)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
elif command -v apt-get >/dev/null; then
    echo "note: chromium is missing; the dashboard's browser tests need it: sudo apt-get install chromium"
else
    echo "note: chromium not found; the dashboard's browser tests need /usr/bin/chromium"
fi
