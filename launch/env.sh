# Sourced by the launch scripts: create or reuse the project's virtual
# environment and install what is missing. Idempotent and quiet when done.
#   PDSERVE_VENV         where the environment lives (default: <repo>/.venv)
#   PDSERVE_TORCH_SPEC   the torch requirement used when no torch is importable
#                        (default: torch==2.13.0)
set -euo pipefail
PDSERVE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PDSERVE_VENV="${PDSERVE_VENV:-$PDSERVE_ROOT/.venv}"
_py="${PYTHON:-python3}"
# A step that may take minutes says so first and how long it took after.
_say_installing() {
    echo "[pdserve] installing $1 (may take a few minutes$2)..." >&2
    _t0=$SECONDS
}
_say_installed() { echo "[pdserve] ... done in $((SECONDS - _t0))s" >&2; }

if [ ! -x "$PDSERVE_VENV/bin/python" ]; then
    echo "[pdserve] creating $PDSERVE_VENV" >&2
    "$_py" -m venv "$PDSERVE_VENV"
    # A host that already has torch (a CUDA or Ascend image) keeps it: the new
    # environment sees the host interpreter's packages, also when that
    # interpreter is itself a virtual environment, and pip finds them satisfied.
    if "$_py" -c "import torch" >/dev/null 2>&1; then
        echo "[pdserve] reusing the host's torch ($("$_py" -c 'import torch; print(torch.__version__)'))" >&2
        _host_site=$("$_py" -c "import site, sysconfig; print('\n'.join(dict.fromkeys([sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], *site.getsitepackages()])))")
        _venv_site=$("$PDSERVE_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        echo "$_host_site" > "$_venv_site/_pdserve_host_packages.pth"
    fi
fi
PY="$PDSERVE_VENV/bin/python"
_stamp="$PDSERVE_VENV/.pdserve-installed"
if [ ! -f "$_stamp" ] || [ "$PDSERVE_ROOT/pyproject.toml" -nt "$_stamp" ]; then
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        _say_installing "${PDSERVE_TORCH_SPEC:-torch==2.13.0}" ": a download of up to a few GB"
        "$PY" -m pip install -q --disable-pip-version-check "${PDSERVE_TORCH_SPEC:-torch==2.13.0}"
        _say_installed
    fi
    # Only ask the registry for what is missing: a host with everything installed
    # (an offline accelerator image, say) needs no network.
    _core_modules="transformers, safetensors, numpy, zmq, msgpack, aiohttp, prometheus_client, pydantic"
    if ! "$PY" -c "import $_core_modules" >/dev/null 2>&1; then
        _say_installing "pdserve's dependencies (transformers, pyzmq, aiohttp, pydantic, ...)" ""
        "$PY" -m pip install -q --disable-pip-version-check -e "$PDSERVE_ROOT"
        _say_installed
    elif [ ! -x "$PDSERVE_VENV/bin/pdserve" ]; then
        # NOTE: offline this can fail; everything still runs as python -m launch.cli.
        "$PY" -m pip install -q --disable-pip-version-check --no-deps -e "$PDSERVE_ROOT" >/dev/null 2>&1 \
            || echo "[pdserve] could not install the pdserve command here; python -m launch.cli is the same" >&2
    fi
    # The nixl KV transfer is optional: without it, pdserve offers the other backends.
    if ! "$PY" -c "import nixl_cu12" >/dev/null 2>&1; then
        _say_installing "nixl-cu12, optional (the nixl KV transfer)" ""
        "$PY" -m pip install -q --disable-pip-version-check --retries 1 --timeout 15 "nixl-cu12>=1.5.1,<2" >/dev/null 2>&1 \
            || echo "[pdserve] nixl-cu12 could not be installed here: the nixl KV transfer is not offered" >&2
        _say_installed
    fi
    # Structured outputs compile with xgrammar. NOTE: its wheel asks for triton
    # (hundreds of MB, GPU kernels pdserve does not use): install it without
    # dependencies and its two light ones by hand. Without it, requests for
    # structured outputs get a clear error and everything else runs.
    if ! "$PY" -c "import xgrammar" >/dev/null 2>&1; then
        _say_installing "xgrammar, optional (structured outputs)" ""
        { "$PY" -m pip install -q --disable-pip-version-check "apache-tvm-ffi>=0.1.11" pydantic \
            && "$PY" -m pip install -q --disable-pip-version-check --no-deps "xgrammar==0.2.8"; } >/dev/null 2>&1 \
            || echo "[pdserve] xgrammar could not be installed here: structured outputs are not offered" >&2
        _say_installed
    fi
    touch "$_stamp"
fi
export PYTHONPATH="$PDSERVE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
