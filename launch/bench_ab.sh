#!/usr/bin/env bash
# Two checkouts of pdserve at saturation, started alternately, so a code change is
# measured against the spread of this machine. Per run one JSON line (pdserve bench's)
# with "tree" added.
#   bash launch/bench_ab.sh BEFORE_DIR AFTER_DIR [ROUNDS=6] [MODEL_DIR]
# Each round starts BEFORE's cluster, measures twice, stops it, then does the same
# for AFTER. Both trees need their .venv (a link to this one's will do).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
before=${1:?BEFORE_DIR}; after=${2:?AFTER_DIR}; rounds=${3:-6}
model=${4:-$HOME/.cache/pdserve/tiny-qwen3-vs}
if [ ! -d "$model" ]; then   # the tiny Qwen3 launch/bench_vs.sh measures with
    (cd "$PDSERVE_ROOT" && "$PY" -c "import subprocess, sys; from launch.bench_vs import TINY_SHAPE; \
sys.exit(subprocess.run([sys.executable, '-m', 'launch.make_tiny_model', sys.argv[1], *TINY_SHAPE], stdout=sys.stderr).returncode)" "$model")
fi
port=27300
run_tree() {   # DIR
    local dir=$1 log; log=$(mktemp)
    (cd "$dir" && exec bash launch/start_cluster.sh --model "$model" --dtype float32 --max-model-len 2048 \
        --max-num-seqs 64 --base-port $port --http-port $((port + 80))) > "$log" 2>&1 &
    local pid=$!
    "$PY" -m frontend.client --endpoint tcp://127.0.0.1:$port --wait-ready 120 --wait-nodes 2 >/dev/null
    for seed in 1 2; do
        (cd "$dir" && "$PY" -m launch.bench_serving --endpoint tcp://127.0.0.1:$port --quiet --vocab-size 512 \
            --ignore-eos --seed $seed --input-len 430 --output-len 64 --num-prompts 128 --request-rate inf) \
            | "$PY" -c "import json,sys; r=json.loads(sys.stdin.readline()); r['tree']=sys.argv[1]; print(json.dumps(r))" "$dir"
    done
    kill -TERM $pid; wait $pid || true
    rm -f "$log"
}
for _ in $(seq "$rounds"); do
    run_tree "$before"
    run_tree "$after"
done
