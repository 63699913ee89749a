# Sourced by the GPU benchmark scripts (gpu_serving.sh, gpu_prefix.sh, gpu_preempt.sh): the model
# they share and how they start a cluster on it.
#   bench_model                      -> $model, a Qwen3-0.6B shape (random bf16 weights, made once)
#   start_bench_cluster OUT TAG ARGS -> a cluster on cuda:0 with ARGS; $launcher is its pid
#                                       (its output in OUT/cluster-TAG.{out,log})
#   bench_on_cluster OUT TAG [CLUSTER ARGS] -- [BENCH ARGS]
#                                    -> a cluster (no HTTP) with CLUSTER ARGS, one ZeroMQ
#                                       benchmark with BENCH ARGS into OUT/TAG.json, stopped
py="${PYTHON:-python3}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bench_model() {
    model="${PDSERVE_BENCH_MODEL:-/tmp/pdserve-qwen3-0.6b-shape}"
    if [ ! -f "$model/config.json" ]; then
        "$py" -m launch.make_tiny_model "$model" --layers 28 --hidden-size 1024 --intermediate-size 3072 \
            --heads 16 --kv-heads 8 --head-dim 128 --vocab-size 151936 --max-position-embeddings 40960 \
            --dtype bfloat16 --weight-std 0.02 >/dev/null || exit 1
    fi
}

start_bench_cluster() {  # start_bench_cluster OUT TAG [start_cluster args...]
    local out="$1" tag="$2"; shift 2
    bash launch/start_cluster.sh --model "$model" --prefill-device cuda:0 --decode-device cuda:0 \
        --kv-cache-memory 12GiB --max-batch-size 128 --ready-timeout 300 "$@" \
        > "$out/cluster-$tag.out" 2> "$out/cluster-$tag.log" &
    launcher=$!
    for _ in $(seq 600); do grep -q PDSERVE_ENDPOINT "$out/cluster-$tag.out" 2>/dev/null && return
        kill -0 $launcher 2>/dev/null || { echo "cluster failed to start" >&2; tail -20 "$out/cluster-$tag.log" >&2; exit 1; }
        sleep 0.5; done
    echo "cluster not ready after 300 s" >&2; exit 1
}

bench_on_cluster() {  # bench_on_cluster OUT TAG [start_cluster args...] -- [bench_serving args...]
    local out="$1" tag="$2" port=5600 rc=0
    local start=()
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do start+=("$1"); shift; done
    [ $# -gt 0 ] && shift   # the --
    start_bench_cluster "$out" "$tag" --base-port $port --no-http "${start[@]}"
    "$py" -m launch.bench.serving --endpoint "tcp://127.0.0.1:$port" --quiet --save-json "$out/$tag.json" \
        "$@" || rc=1
    kill -TERM $launcher; wait $launcher
    return $rc
}
