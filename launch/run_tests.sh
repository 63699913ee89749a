#!/usr/bin/env bash
# Run the whole test suite, setting up the project's environment first.
#   bash launch/run_tests.sh [pytest args...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$PDSERVE_ROOT"
_test_modules="pytest, openai, matplotlib, lm_eval, tenacity, ray, kubernetes_validate, schemathesis"
if ! "$PY" -c "import $_test_modules" >/dev/null 2>&1; then
    echo "[pdserve] installing the test dependencies" >&2
    "$PY" -m pip install -q --disable-pip-version-check -e "$PDSERVE_ROOT[test]"
fi
exec "$PY" -m pytest -q "$@"
