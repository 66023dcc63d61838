#!/usr/bin/env bash
# Installs the pinned OpenAI Codex CLI and exposes its native binary as
# `apply_patch` (the binary switches to apply_patch mode on that argv[0]) and
# as `codex` (the runner of codex background jobs, tests/test_codex_jobs.py).
set -euo pipefail

CODEX_VERSION="0.171.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PREFIX="$ROOT/.reference/codex"
LINK="$ROOT/.reference/bin/apply_patch"
CODEX_LINK="$ROOT/.reference/bin/codex"

if [ -x "$LINK" ] && [ -x "$CODEX_LINK" ] && [ -f "$PREFIX/.version" ] && [ "$(cat "$PREFIX/.version")" = "$CODEX_VERSION" ]; then
    echo "$LINK"
    exit 0
fi

mkdir -p "$PREFIX" "$(dirname "$LINK")"
npm install --prefix "$PREFIX" --no-audit --no-fund --no-save "@openai/codex@$CODEX_VERSION" >&2

# The native binary ships in a platform package (e.g. @openai/codex-linux-x64).
BIN="$(find "$PREFIX/node_modules/@openai" -path '*/vendor/*/bin/codex' -type f | head -n 1)"
if [ -z "$BIN" ]; then
    echo "no native codex binary found under $PREFIX" >&2
    exit 1
fi
ln -sfn "$BIN" "$LINK"
ln -sfn "$BIN" "$CODEX_LINK"
echo "$CODEX_VERSION" > "$PREFIX/.version"
echo "$LINK"
