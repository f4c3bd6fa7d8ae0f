#!/usr/bin/env bash
# The Debian packages `make test-full` needs beyond Python and Java: a PostgreSQL server (the
# tests start their own, on 127.0.0.1 in a temporary folder; the package's own cluster is not
# used) and Chromium with its WebDriver (the console's browser test drives a headless Chromium).
# Installs only what is missing; nothing to do on a machine that has them.
set -euo pipefail

missing=()
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql-15)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)

if ((${#missing[@]} == 0)); then
    exit 0
fi
echo "==> installing Debian packages: ${missing[*]}"
if [[ $(id -u) != 0 ]]; then
    echo "error: ${missing[*]} missing and this is not root; install with: sudo apt-get install ${missing[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
