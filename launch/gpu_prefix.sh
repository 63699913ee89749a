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
port=5600 rc=0
for mode in on off; do
    extra=(); [ $mode = off ] && extra=(--prefill-arg --no-prefix-caching)
    start_bench_cluster "$out" "prefix-$mode" --base-port $port --no-http "${extra[@]}"
    "$py" -m launch.bench_serving --endpoint "tcp://127.0.0.1:$port" --prefix-len 2048 --input-len 128 \
        --output-len 128 --num-prompts "$num" --request-rate "$rates" --quiet \
        --save-json "$out/prefix-$mode.json" || rc=1
    kill -TERM $launcher; wait $launcher
done
exit $rc
