#!/usr/bin/env bash
# Run the whole test suite, setting up the project's environment first.
#   bash launch/run_tests.sh [pytest args...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$PDSERVE_ROOT"
exec "$PY" -m pytest -q "$@"
