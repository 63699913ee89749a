#!/usr/bin/env bash
# Run the whole test suite, setting up the project's environment first.
#   bash launch/run_tests.sh [pytest args...]
# Sourced, it only sets up the environment with the test dependencies ($PY): .ci/run
# does so to run ruff before the tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$PDSERVE_ROOT"
_test_modules="pytest, openai, matplotlib, lm_eval, tenacity, ray, kubernetes_validate, schemathesis"
_test_modules="$_test_modules, ruff"
if ! "$PY" -c "import $_test_modules" >/dev/null 2>&1; then
    _say_installing "the test dependencies (pytest, openai, lm-eval, ray, schemathesis, ruff, ...)" ""
    "$PY" -m pip install -q --disable-pip-version-check -e "$PDSERVE_ROOT[test]"
    _say_installed
fi
# AIPerf, the goodput test's client (tests/cluster/test_goodput.py), in an environment of its own
# layered over this one (it sees these packages): its pins (pyzmq, huggingface-hub, pandas)
# would otherwise replace the versions pdserve runs with. Without a registry the test is skipped.
_aiperf="$PDSERVE_VENV/tools/aiperf"
_site_of() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
_install_aiperf() {
    "$PY" -m venv "$_aiperf" \
        && echo "import site; site.addsitedir('$(_site_of "$PY")')" \
            > "$(_site_of "$_aiperf/bin/python")/_pdserve_base.pth" \
        && "$_aiperf/bin/python" -m pip install -q --disable-pip-version-check "aiperf==0.13.0"
}
if [ ! -x "$_aiperf/bin/aiperf" ]; then
    _say_installing "aiperf, the goodput test's client, into $_aiperf" ""
    _install_aiperf >/dev/null 2>&1 || {
        rm -rf "$_aiperf"
        echo "[pdserve] aiperf could not be installed here: its test is skipped" >&2
    }
    _say_installed
fi
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    exec "$PY" -m pytest -q "$@"
fi
