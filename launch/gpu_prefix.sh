#!/usr/bin/env bash
# The shared-prefix figures for docs/BENCHMARKS.md: a Qwen3-0.6B-shaped model
# (random bf16 weights, made here), both nodes on one GPU, every prompt a shared
# 2,048-token prefix and 128 tokens of its own, 128 output tokens, Poisson
# arrivals; once with prefix caching on and once off, at the same rates.
#   bash launch/gpu_prefix.sh OUT_DIR [RATES=2,4,8,16] [NUM_PROMPTS=200]
# OUT_DIR gets prefix-<on|off>.json (per-request samples included) and the logs.
set -uo pipefail
out="${1:?OUT_DIR}"; rates="${2:-2,4,8,16}"; num="${3:-200}"
py="${PYTHON:-python3}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
model="${PDSERVE_BENCH_MODEL:-/tmp/pdserve-qwen3-0.6b-shape}"
if [ ! -f "$model/config.json" ]; then
    "$py" -m launch.make_tiny_model "$model" --layers 28 --hidden-size 1024 --intermediate-size 3072 \
        --heads 16 --kv-heads 8 --head-dim 128 --vocab-size 151936 --max-position-embeddings 40960 \
        --dtype bfloat16 --weight-std 0.02 >/dev/null || exit 1
fi
port=5600 rc=0
for mode in on off; do
    extra=(); [ $mode = off ] && extra=(--prefill-arg --no-prefix-caching)
    bash launch/start_cluster.sh --model "$model" --prefill-device cuda:0 --decode-device cuda:0 \
        --kv-cache-memory 12GiB --max-batch-size 128 --base-port $port --no-http --ready-timeout 300 \
        "${extra[@]}" > "$out/cluster-prefix-$mode.out" 2> "$out/cluster-prefix-$mode.log" &
    launcher=$!
    for _ in $(seq 600); do grep -q PDSERVE_ENDPOINT "$out/cluster-prefix-$mode.out" 2>/dev/null && break
        kill -0 $launcher 2>/dev/null || { echo "cluster failed to start" >&2; tail -20 "$out/cluster-prefix-$mode.log" >&2; exit 1; }
        sleep 0.5; done
    "$py" -m launch.bench_serving --endpoint "tcp://127.0.0.1:$port" --prefix-len 2048 --input-len 128 \
        --output-len 128 --num-prompts "$num" --request-rate "$rates" --quiet \
        --save-json "$out/prefix-$mode.json" || rc=1
    kill -TERM $launcher; wait $launcher
done
exit $rc
