#!/usr/bin/env bash
# Quick start, step 2: install what is missing, then run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/test_gateway.py -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The reference apply_patch (the real Codex binary) for the parity suites.
# In CI it must be there; elsewhere the suites skip with a message if it cannot be had.
if [ "${CI:-}" = true ]; then
    bash tests/apply_patch/get_reference.sh
else
    bash tests/apply_patch/get_reference.sh || echo "warning: no reference apply_patch; parity suites will skip" >&2
fi
exec .venv/bin/python -m pytest "$@"
