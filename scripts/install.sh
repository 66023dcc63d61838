#!/usr/bin/env bash
# Install everything the gateway needs into ./.venv: bubblewrap and chromium (apt-get,
# when root and missing), a virtualenv, the package with its data, test and lab extras
# (the test extra has playwright, which drives chromium in the JupyterLab browser tests).
# Only what is missing or changed is installed, and a changed file is renamed into place:
# a demo running from this .venv (scripts/demo.sh) keeps its jlk and kernel-gateway.
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

# The JupyterLab browser tests drive Debian's chromium: playwright cannot download a browser here.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing chromium with apt-get (for the JupyterLab browser tests) ..."
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "note: chromium is missing: tests/test_lab_browser.py will skip (apt-get install chromium)" >&2
    fi
fi

# install_jlk SOURCE BINDIR: the skill's jlk as BINDIR/jlk, run by BINDIR/python (as pip
# installs it), renamed over the old one only if it differs: never absent, never half written.
install_jlk() {
    local tmp="$2/.jlk.$$"
    { printf '#!%s/python\n' "$(cd "$2" && pwd)"; tail -n +2 "$1"; } >"$tmp"
    chmod 0755 "$tmp"
    if cmp -s "$tmp" "$2/jlk"; then rm -f "$tmp"; else mv -f "$tmp" "$2/jlk"; fi
}

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# The package is installed editable: its code is read from here. pip runs again only when
# what it installs changed (pyproject.toml, the extras): it deletes and rewrites the
# scripts in .venv/bin. Its output (and setuptools' "Editable installation" notice, which
# says the flat layout's .pth file is in use, as intended) is shown only if it fails.
EXTRAS="data,test,lab"
STAMP=.venv/.kernel-gateway-installed
want="$(cat pyproject.toml; echo "$EXTRAS")"
want="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/kernel-gateway ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] \
        && .venv/bin/python -c 'import kernel_gateway' 2>/dev/null; then
    :
else
    log=$(mktemp)
    if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e ".[$EXTRAS]"; } >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "install.sh: pip install failed (its output is above)" >&2
        exit 1
    fi
    rm -f "$log"
    echo "$want" >"$STAMP"
fi
install_jlk skills/jupyter-live-kernel/scripts/jlk .venv/bin
# Two small static programs of the spawn path, when a C compiler is there:
# - kg-spawn-helper, one exec (rlimits, then the agent's uid) in front of bwrap;
#   without it the gateway uses prlimit and setpriv (a little slower);
# - kg-exec-stub, the payload of a spare command sandbox; without it every
#   command sets its sandbox up when it is asked for (slower).
build() {  # build SOURCE BINARY WHAT-ELSE
    if command -v cc >/dev/null 2>&1 && cc -O2 -Wall -static -o "$2.tmp" "$1" 2>/dev/null; then
        chmod 0755 "$2.tmp"
        if cmp -s "$2.tmp" "$2"; then rm -f "$2.tmp"; else mv "$2.tmp" "$2"; fi
    else
        rm -f "$2.tmp"
        echo "note: no C compiler (or no static libc) for $2: $3" >&2
    fi
}
build kernel_gateway/sandbox/spawn_helper.c kernel_gateway/sandbox/kg-spawn-helper "sandboxes start through prlimit + setpriv"
build kernel_gateway/sandbox/exec_stub.c kernel_gateway/sandbox/kg-exec-stub "no spare command sandboxes"
echo "installed: $(.venv/bin/kernel-gateway --version) in $(pwd)/.venv, $(bwrap --version)"
