#!/usr/bin/env bash
# Install everything the gateway needs into ./.venv: bubblewrap (apt-get, when
# root and missing), a virtualenv, the package with its data and test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing bubblewrap with apt-get ..."
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    else
        echo "bubblewrap (bwrap) is missing: install the package 'bubblewrap'" >&2
        echo "  e.g. sudo apt-get install bubblewrap   or   sudo dnf install bubblewrap" >&2
        exit 1
    fi
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[data,test]"
# The spawn helper: one static exec (rlimits, then the agent's uid) in front of bwrap.
# Without a C compiler the gateway uses prlimit and setpriv instead (a little slower).
HELPER=kernel_gateway/sandbox/kg-spawn-helper
if command -v cc >/dev/null 2>&1 && cc -O2 -Wall -static -o "$HELPER.tmp" kernel_gateway/sandbox/spawn_helper.c 2>/dev/null; then
    chmod 0755 "$HELPER.tmp" && mv "$HELPER.tmp" "$HELPER"
else
    rm -f "$HELPER.tmp"
    echo "note: no C compiler (or no static libc): sandboxes start through prlimit + setpriv" >&2
fi
echo "installed: $(.venv/bin/kernel-gateway --version) in $(pwd)/.venv, $(bwrap --version)"
