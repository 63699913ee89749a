# Sourced by the launch scripts: create or reuse the project's virtual
# environment and install what is missing. Idempotent and quiet when done.
#   PDSERVE_VENV         where the environment lives (default: <repo>/.venv)
#   PDSERVE_TORCH_SPEC   the torch requirement used when no torch is importable
#                        (default: torch==2.13.0)
set -euo pipefail
PDSERVE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PDSERVE_VENV="${PDSERVE_VENV:-$PDSERVE_ROOT/.venv}"
_py="${PYTHON:-python3}"

if [ ! -x "$PDSERVE_VENV/bin/python" ]; then
    # A host that already has torch (a CUDA or Ascend image) keeps it: the venv
    # sees the system packages and pip then finds torch satisfied.
    if "$_py" -c "import torch" >/dev/null 2>&1; then
        echo "[pdserve] creating $PDSERVE_VENV (reusing the system torch)" >&2
        "$_py" -m venv --system-site-packages "$PDSERVE_VENV"
    else
        echo "[pdserve] creating $PDSERVE_VENV" >&2
        "$_py" -m venv "$PDSERVE_VENV"
    fi
fi
PY="$PDSERVE_VENV/bin/python"
_stamp="$PDSERVE_VENV/.pdserve-installed"
if [ ! -f "$_stamp" ] || [ "$PDSERVE_ROOT/pyproject.toml" -nt "$_stamp" ]; then
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "[pdserve] installing ${PDSERVE_TORCH_SPEC:-torch==2.13.0}" >&2
        "$PY" -m pip install -q --disable-pip-version-check "${PDSERVE_TORCH_SPEC:-torch==2.13.0}"
    fi
    # Only ask the registry for what is missing: a host with everything installed
    # (an offline accelerator image, say) needs no network.
    if ! "$PY" -c "import transformers, safetensors, numpy, zmq, msgpack, pytest" >/dev/null 2>&1; then
        echo "[pdserve] installing pdserve and its dependencies" >&2
        "$PY" -m pip install -q --disable-pip-version-check -e "$PDSERVE_ROOT[test]"
    fi
    touch "$_stamp"
fi
export PYTHONPATH="$PDSERVE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
