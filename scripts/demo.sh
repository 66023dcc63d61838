#!/usr/bin/env bash
# Quick start, step 1: install everything, then run the gateway in the
# foreground with the embedded defaults (agents in ./var/agents, state in
# ./var/state) and a ready agent called "demo".  Stop it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/kernel-gateway serve --demo
