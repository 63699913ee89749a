#!/usr/bin/env bash
# The shared-prefix figures for docs/BENCHMARKS.md: a Qwen3-0.6B-shaped model
# (random bf16 weights, made here), both nodes on one GPU, every prompt a shared
# 2,048-token prefix and 128 tokens of its own, 128 output tokens, Poisson
# arrivals; once with prefix caching on and once off, at the same rates.
#   bash launch/gpu_prefix.sh OUT_DIR [RATES=2,4,8,16] [NUM_PROMPTS=200]
# OUT_DIR gets prefix-<on|off>.json (per-request samples included) and the logs.
set -uo pipefail
out="${1:?OUT_DIR}"; rates="${2:-2,4,8,16}"; num="${3:-200}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
bench_model
bench=(--prefix-len 2048 --input-len 128 --output-len 128 --num-prompts "$num" --request-rate "$rates")
rc=0
bench_on_cluster "$out" prefix-on -- "${bench[@]}" || rc=1
bench_on_cluster "$out" prefix-off --no-prefix-caching -- "${bench[@]}" || rc=1
exit $rc
