#!/usr/bin/env bash
# pdserve against vLLM, side by side on this machine (launch/bench/vs.py --help).
#   bash launch/bench_vs.sh [--model DIR] [--runs 3] [--vllm-python PATH] [--workloads sat430,sat1000,rate4]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$PDSERVE_ROOT"
exec "$PY" -m launch.bench.vs "$@"
