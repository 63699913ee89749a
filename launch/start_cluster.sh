#!/usr/bin/env bash
# Start a pdserve cluster: the frontend, prefill nodes and decode nodes (xPyD).
#
#   bash launch/start_cluster.sh [--demo] [--model DIR] [--host 127.0.0.1] [--advertise-host H]
#        [--base-port 5600] [--name-prefix P] [--join NODE_ENDPOINT]
#        [--prefill-devices D[,D...]] [--decode-devices D[,D...]]      one node per device listed
#        [--num-prefill N] [--num-decode M]     N or M nodes on the one device given (default 1; 0: none here)
#        [--kv-transfer auto|ipc|nixl|tcp|dist] [--dtype T] [--kv-cache-memory SIZE] [--max-batch-size N]
#        [--max-model-len N] [--block-size N] [--token-budget N] [--kv-cache-fraction F]
#        [--http-port 8000 | --no-http] [--served-model-name NAME] [--log-level LEVEL]
#        [--no-prefix-caching] [--swap-space GIB] [--no-preemption] [--kv-verify]
#        [--reasoning-parser qwen3] [--tool-call-parser qwen3|hermes|none] [--enable-auto-tool-choice]
#        [--logprobs-mode raw_logprobs|processed_logprobs] [--allow-json-whitespace]
#        [--keys DIR | --no-keys] [--no-restart-nodes] [--drain-timeout S]
#        [--ready-timeout S] [--frontend-arg ARG]... [--prefill-arg ARG]... [--decode-arg ARG]...
#
# Endpoints derive from the base port: clients connect to BASE, nodes to the
# frontend at BASE+1, and decode node i takes KV handoffs at BASE+2+i. The
# frontend serves the OpenAI API, /metrics and /health at --http-port (8000).
# vLLM's names work too: --max-num-seqs, --max-num-batched-tokens,
# --gpu-memory-utilization (see the nodes' --help), --max-model-len, --block-size.
# --prefill-device / --decode-device are the one-device spellings.
# With no --model, a tiny random Qwen3 is made on first use (no download).
# --host 0.0.0.0 (or ::) binds every interface; decode nodes then tell prefill nodes
# to hand KV to --advertise-host (default: this host's first address, hostname -I).
# Node links use CURVE keys: a fresh set per cluster (removed at exit, by the frontend even when this script is killed) unless
# --keys DIR names a kept one (python -m launch.keys DIR); --no-keys leaves them open.
# Across hosts (README, "Across hosts"): make the keys once for every node name
# (pdserve keys KEYS --nodes a-prefill-0,b-decode-0) and copy KEYS to each host;
# --name-prefix P names this host's nodes P+prefill-0, ..., P+decode-0, ...; a host
# with --join tcp://A:PORT (the frontend host's BASE+1) starts no frontend, only its
# nodes, which register there (restarted here when they die) and take handoffs at
# BASE+2+i on --host; it prints PDSERVE_JOINED=ENDPOINT once they are registered.
# A node that dies is restarted with backoff (1 s doubling to 30 s); if the
# frontend dies, everything stops. SIGTERM/SIGINT drain: no new requests, running
# ones get --drain-timeout seconds (default 30) to finish, then every process stops.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

MODEL="" PREFILL_DEVICES=cpu DECODE_DEVICES=cpu NUM_PREFILL="" NUM_DECODE="" HOST=127.0.0.1 ADVERTISE_HOST=""
BASE_PORT=5600 DEMO=0 DTYPE="" KV_MEM="" MAX_BATCH=64 READY_TIMEOUT=300 KV_TRANSFER=auto
KEYS="" USE_KEYS=1 RESTART=1 DRAIN_TIMEOUT=30 HTTP_PORT=8000 SERVED_NAME="" LOG_LEVEL="" PREFIX="" JOIN=""
MAX_MODEL_LEN="" BLOCK_SIZE="" TOKEN_BUDGET="" KV_FRACTION=""
FRONTEND_EXTRA=() PREFILL_EXTRA=() DECODE_EXTRA=()
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "start_cluster: $*" >&2; exit 2; }
value() {  # value OPTION "$@": the option's argument, or a one-line error
    [ $# -ge 2 ] && [ -n "$2" ] && [[ "$2" != --* ]] || die "$1 needs a value"
    printf '%s' "$2"
}
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL="$(value "$@")"; shift 2 ;;
        --prefill-device|--prefill-devices) PREFILL_DEVICES="$(value "$@")"; shift 2 ;;
        --decode-device|--decode-devices) DECODE_DEVICES="$(value "$@")"; shift 2 ;;
        --num-prefill) NUM_PREFILL="$(value "$@")"; shift 2 ;;
        --num-decode) NUM_DECODE="$(value "$@")"; shift 2 ;;
        --kv-transfer) KV_TRANSFER="$(value "$@")"; shift 2 ;;
        --host) HOST="$(value "$@")"; shift 2 ;;
        --advertise-host) ADVERTISE_HOST="$(value "$@")"; shift 2 ;;
        --base-port) BASE_PORT="$(value "$@")"; shift 2 ;;
        --name-prefix) PREFIX="$(value "$@")"; shift 2 ;;
        --join) JOIN="$(value "$@")"; shift 2 ;;
        --dtype) DTYPE="$(value "$@")"; shift 2 ;;
        --kv-cache-memory) KV_MEM="$(value "$@")"; shift 2 ;;
        --max-batch-size|--max-num-seqs) MAX_BATCH="$(value "$@")"; shift 2 ;;
        --max-model-len) MAX_MODEL_LEN="$(value "$@")"; shift 2 ;;
        --block-size) BLOCK_SIZE="$(value "$@")"; shift 2 ;;
        --token-budget|--max-num-batched-tokens) TOKEN_BUDGET="$(value "$@")"; shift 2 ;;
        --kv-cache-fraction|--gpu-memory-utilization) KV_FRACTION="$(value "$@")"; shift 2 ;;
        --http-port) HTTP_PORT="$(value "$@")"; shift 2 ;;
        --no-http) HTTP_PORT=""; shift ;;
        --served-model-name) SERVED_NAME="$(value "$@")"; shift 2 ;;
        --log-level) LOG_LEVEL="$(value "$@")"; shift 2 ;;
        --ready-timeout) READY_TIMEOUT="$(value "$@")"; shift 2 ;;
        --keys) KEYS="$(value "$@")"; shift 2 ;;
        --no-keys) USE_KEYS=0; shift ;;
        --no-restart-nodes) RESTART=0; shift ;;
        --restart-nodes) RESTART=1; shift ;;
        --drain-timeout) DRAIN_TIMEOUT="$(value "$@")"; shift 2 ;;
        --frontend-arg) [ $# -ge 2 ] || die "$1 needs a value"; FRONTEND_EXTRA+=("$2"); shift 2 ;;
        --prefill-arg) [ $# -ge 2 ] || die "$1 needs a value"; PREFILL_EXTRA+=("$2"); shift 2 ;;
        --decode-arg) [ $# -ge 2 ] || die "$1 needs a value"; DECODE_EXTRA+=("$2"); shift 2 ;;
        --no-prefix-caching|--no-enable-prefix-caching) PREFILL_EXTRA+=(--no-prefix-caching); shift ;;
        --swap-space) DECODE_EXTRA+=(--swap-space "$(value "$@")"); shift 2 ;;
        --no-preemption) DECODE_EXTRA+=(--no-preemption); shift ;;
        --kv-verify) PREFILL_EXTRA+=(--kv-verify); DECODE_EXTRA+=(--kv-verify); shift ;;
        --reasoning-parser|--tool-call-parser|--logprobs-mode) FRONTEND_EXTRA+=("$1" "$(value "$@")"); shift 2 ;;
        --enable-auto-tool-choice|--allow-json-whitespace) FRONTEND_EXTRA+=("$1"); shift ;;
        --demo) DEMO=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "start_cluster: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
[[ "$BASE_PORT" =~ ^[0-9]+$ ]] && [ "$BASE_PORT" -ge 1 ] && [ "$BASE_PORT" -le 65000 ] \
    || die "--base-port needs a port number, got '$BASE_PORT'"
[ -z "$HTTP_PORT" ] || { [[ "$HTTP_PORT" =~ ^[0-9]+$ ]] && [ "$HTTP_PORT" -ge 1 ] && [ "$HTTP_PORT" -le 65535 ]; } \
    || die "--http-port needs a port number, got '$HTTP_PORT'"
[[ "$READY_TIMEOUT" =~ ^[0-9]+$ ]] || die "--ready-timeout needs whole seconds, got '$READY_TIMEOUT'"
[[ "$DRAIN_TIMEOUT" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--drain-timeout needs seconds, got '$DRAIN_TIMEOUT'"

# One device per node: a list gives one node each; a count repeats the one device.
devices_for() {  # devices_for LIST COUNT ROLE -> one device per line
    local list="$1" count="$2" role="$3" d
    IFS=, read -r -a d <<< "$list"
    if [ -n "$count" ]; then
        if [ "${#d[@]}" != 1 ]; then
            echo "start_cluster: give --num-$role with one --$role-devices device, not ${#d[@]}" >&2; exit 2
        fi
        if ! [[ "$count" =~ ^[0-9]+$ ]]; then
            echo "start_cluster: --num-$role needs a whole number, got '$count'" >&2; exit 2
        fi
        for _ in $(seq "$count"); do echo "${d[0]}"; done
    else
        printf '%s\n' "${d[@]}"
    fi
}
mapfile -t PREFILL_DEVS < <(devices_for "$PREFILL_DEVICES" "$NUM_PREFILL" prefill)
mapfile -t DECODE_DEVS < <(devices_for "$DECODE_DEVICES" "$NUM_DECODE" decode)
[[ "$PREFIX" =~ ^[A-Za-z0-9._-]*$ ]] || die "--name-prefix takes letters, digits, '.', '_' and '-', got '$PREFIX'"
if [ -n "$JOIN" ]; then
    [[ "$JOIN" =~ ^tcp://[^/]+:[0-9]+$ ]] || die "--join needs the frontend's node endpoint tcp://HOST:PORT, got '$JOIN'"
    [ $((${#PREFILL_DEVS[@]} + ${#DECODE_DEVS[@]})) -gt 0 ] || die "--join with no node to start (--num-prefill 0 --num-decode 0)"
    [ $DEMO = 0 ] || die "--demo needs a frontend here: not with --join"
    [ $USE_KEYS = 0 ] || [ -n "$KEYS" ] || die "--join needs --keys DIR, the cluster's key directory copied from the frontend's host (or --no-keys, as the frontend)"
fi

if [ -z "$MODEL" ]; then
    MODEL="${PDSERVE_HOME:-$HOME/.cache/pdserve}/tiny-qwen3"
    if [ ! -f "$MODEL/config.json" ]; then
        echo "[pdserve] making a tiny random Qwen3 at $MODEL" >&2
        "$PY" -m launch.make_tiny_model "$MODEL" >/dev/null
    fi
fi

if [[ "$HOST" == *:* ]]; then ADDR="[$HOST]"; else ADDR="$HOST"; fi
CLIENTS="tcp://$ADDR:$BASE_PORT"
NODES="${JOIN:-tcp://$ADDR:$((BASE_PORT + 1))}"
COMMON=(--model "$MODEL" --max-batch-size "$MAX_BATCH" --kv-transfer "$KV_TRANSFER")
[ -n "$DTYPE" ] && COMMON+=(--dtype "$DTYPE")
[ -n "$KV_MEM" ] && COMMON+=(--kv-cache-memory "$KV_MEM")
[ -n "$MAX_MODEL_LEN" ] && COMMON+=(--max-model-len "$MAX_MODEL_LEN")
[ -n "$BLOCK_SIZE" ] && COMMON+=(--block-size "$BLOCK_SIZE")
[ -n "$KV_FRACTION" ] && COMMON+=(--kv-cache-fraction "$KV_FRACTION")
[ -n "$LOG_LEVEL" ] && COMMON+=(--log-level "$LOG_LEVEL")
[ -n "$TOKEN_BUDGET" ] && PREFILL_EXTRA=(--token-budget "$TOKEN_BUDGET" "${PREFILL_EXTRA[@]}")
FRONTEND_OPTS=()
[ -n "$HTTP_PORT" ] && FRONTEND_OPTS+=(--http-port "$HTTP_PORT")
[ -n "$SERVED_NAME" ] && FRONTEND_OPTS+=(--served-model-name "$SERVED_NAME")
[ -n "$MAX_MODEL_LEN" ] && FRONTEND_OPTS+=(--max-model-len "$MAX_MODEL_LEN")
[ -n "$LOG_LEVEL" ] && FRONTEND_OPTS+=(--log-level "$LOG_LEVEL")
REMOTE=()
case "$HOST" in 127.*|localhost|::1) ;; *) REMOTE=(--allow-remote) ;; esac
case "$NODES" in tcp://127.*|tcp://localhost:*|"tcp://[::1]:"*) ;; *) REMOTE=(--allow-remote) ;; esac
ADVERTISE=""   # a wildcard names no address a peer can reach: say which one
case "$HOST" in
    0.0.0.0|::|"*")
        ADVERTISE="${ADVERTISE_HOST:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
        ADVERTISE="${ADVERTISE:-127.0.0.1}"
        [[ "$ADVERTISE" == *:* ]] && ADVERTISE="[$ADVERTISE]" ;;
esac

# Every port this cluster binds must be free now: a port in use means another
# cluster, which must not answer our readiness check or receive our nodes.
PORTS=("$BASE_PORT" "$((BASE_PORT + 1))" $HTTP_PORT)
[ -n "$JOIN" ] && PORTS=()   # no frontend here: only the KV ports
for i in "${!DECODE_DEVS[@]}"; do PORTS+=("$((BASE_PORT + 2 + i))"); done
if ! "$PY" - "$HOST" "${PORTS[@]}" <<'PYEOF'
import socket, sys
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
family = socket.AF_INET6 if ":" in host else socket.AF_INET
for port in ports:
    with socket.socket(family) as s:
        # As ZeroMQ binds: past connections lingering in TIME_WAIT do not hold the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            sys.exit(f"start_cluster: port {port} on {host} is in use ({e.strerror}): another "
                     f"cluster? choose another --base-port (or --http-port)")
PYEOF
then exit 1; fi

# The thread budget: this host's cores divided among the processes started here. A
# decode node (latency-bound) gets an even share of the cores among the CPU nodes;
# a prefill node's lanes run at low priority and take what the others leave, so the
# CPU prefill nodes divide every core among themselves; the frontend and accelerator
# nodes, whose host work is messages and launches, get one thread each. A --threads
# given with --prefill-arg / --decode-arg / --frontend-arg comes later and wins.
NUM_CORES=$(nproc 2>/dev/null || echo 1)
count_cpu() { local n=0 d; for d in "$@"; do [ "$d" = cpu ] && n=$((n + 1)); done; echo $n; }
NUM_CPU_PREFILL=$(count_cpu "${PREFILL_DEVS[@]}") NUM_CPU_DECODE=$(count_cpu "${DECODE_DEVS[@]}")
share() { local n=$(( $1 / ($2 > 0 ? $2 : 1) )); echo $(( n > 0 ? n : 1 )); }
PREFILL_THREADS=$(share "$NUM_CORES" "$NUM_CPU_PREFILL")
DECODE_THREADS=$(share "$NUM_CORES" $((NUM_CPU_PREFILL + NUM_CPU_DECODE)))
threads_for() {  # threads_for DEVICE ROLE -> --threads N
    if [ "$1" != cpu ]; then echo "--threads 1"
    elif [ "$2" = prefill ]; then echo "--threads $PREFILL_THREADS"
    else echo "--threads $DECODE_THREADS"; fi
}
echo "[pdserve] $NUM_CORES cores: each cpu prefill node $PREFILL_THREADS low-priority lane(s), each cpu decode node $DECODE_THREADS thread(s), $([ -n "$JOIN" ] && echo "no frontend here" || echo "the frontend 1")" >&2

# The node list: name, role, device, and the command that starts it.
NAMES=() ROLES=() DEVS=() KVS=()
for i in "${!DECODE_DEVS[@]}"; do
    NAMES+=("${PREFIX}decode-$i") ROLES+=(decode) DEVS+=("${DECODE_DEVS[$i]}") KVS+=("tcp://$ADDR:$((BASE_PORT + 2 + i))")
done
for i in "${!PREFILL_DEVS[@]}"; do
    NAMES+=("${PREFIX}prefill-$i") ROLES+=(prefill) DEVS+=("${PREFILL_DEVS[$i]}") KVS+=("")
done
NUM_NODES=${#NAMES[@]}

# What killed launchers left (their pid, in the name, is gone): their temporary keys and ready files.
for d in "${TMPDIR:-/tmp}"/pdserve-keys-* "${TMPDIR:-/tmp}"/pdserve-ready-*; do
    pid="${d##*/pdserve-}"; pid="${pid#*-}"; pid="${pid%%-*}"
    { [ -d "$d" ] && [ -O "$d" ] && [[ "$pid" =~ ^[0-9]+$ ]] && ! kill -0 "$pid" 2>/dev/null && rm -rf "$d"; } || true
done
KEY_ARGS=() TMP_KEYS="" LINKS="open node links"
if [ $USE_KEYS = 1 ] && [ -n "$JOIN" ]; then   # the frontend's host made them: use, never make
    for file in frontend.key "${NAMES[@]/%/.key_secret}"; do
        [ -f "$KEYS/$file" ] || die "$KEYS has no $file: make the keys once for every node name (pdserve keys KEYS --nodes ...) and copy the directory to each host"
    done
    KEY_ARGS=(--keys "$KEYS") LINKS="CURVE keys in $KEYS"
elif [ $USE_KEYS = 1 ]; then
    # Made for this cluster alone: the frontend removes them as it exits (and a launch, those
    # of launchers killed with their frontend: below).
    if [ -z "$KEYS" ]; then TMP_KEYS="$(mktemp -d -t "pdserve-keys-$$-XXXXXX")"; KEYS="$TMP_KEYS"; fi
    "$PY" -m launch.keys "$KEYS" --nodes "$(IFS=,; echo "${NAMES[*]}")" >/dev/null
    KEY_ARGS=(--keys "$KEYS") LINKS="CURVE keys in $KEYS"
fi
# NOTE: each process gets a session of its own, so a terminal's Ctrl-C reaches this
# script alone and the cluster drains in order; PDEATHSIG still ties them to it.
SETSID=(); command -v setsid >/dev/null && SETSID=(setsid)

FRONTEND_PID="" NODE_PIDS=() STARTED_AT=() BACKOFF=() RESTART_AT=()
READY_DIR="$(mktemp -d -t "pdserve-ready-$$-XXXXXX")"   # each node writes READY_DIR/NAME once accepted
cleanup() {  # stop everything: the frontend drains first, then the nodes stop
    trap - INT TERM
    if [ -n "$FRONTEND_PID" ] && kill -0 "$FRONTEND_PID" 2>/dev/null; then
        kill -TERM "$FRONTEND_PID" 2>/dev/null || true
        local limit=$(( ${DRAIN_TIMEOUT%.*} * 10 + 100 ))   # the drain and 10 s more
        for _ in $(seq "$limit"); do kill -0 "$FRONTEND_PID" 2>/dev/null || break; sleep 0.1; done
    fi
    local pid all=("$FRONTEND_PID" "${NODE_PIDS[@]}")
    for pid in "${all[@]}"; do [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 100); do  # up to 10 s for a graceful stop
        local alive=0
        for pid in "${all[@]}"; do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    for pid in "${all[@]}"; do [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ -n "$TMP_KEYS" ] && rm -rf "$TMP_KEYS"
    rm -rf "$READY_DIR"
    return 0
}
trap 'echo "[pdserve] stopping (draining for up to ${DRAIN_TIMEOUT}s)" >&2; cleanup; exit 130' INT
trap 'echo "[pdserve] stopping (draining for up to ${DRAIN_TIMEOUT}s)" >&2; cleanup; exit 143' TERM

start_node() {  # start_node INDEX
    local i=$1
    rm -f "$READY_DIR/${NAMES[$i]}"
    export PDSERVE_READY_FILE="$READY_DIR/${NAMES[$i]}"
    if [ "${ROLES[$i]}" = decode ]; then
        "${SETSID[@]}" "$PY" -m decode_node "${COMMON[@]}" --device "${DEVS[$i]}" --name "${NAMES[$i]}" \
            $(threads_for "${DEVS[$i]}" decode) \
            --frontend "$NODES" --kv-bind "${KVS[$i]}" "${KEY_ARGS[@]}" "${REMOTE[@]}" \
            ${ADVERTISE:+--kv-advertise "tcp://$ADVERTISE:${KVS[$i]##*:}"} \
            "${DECODE_EXTRA[@]}" &
    else
        "${SETSID[@]}" "$PY" -m prefill_node "${COMMON[@]}" --device "${DEVS[$i]}" --name "${NAMES[$i]}" \
            $(threads_for "${DEVS[$i]}" prefill) \
            --frontend "$NODES" "${KEY_ARGS[@]}" "${REMOTE[@]}" "${PREFILL_EXTRA[@]}" &
    fi
    NODE_PIDS[$i]=$!
    STARTED_AT[$i]=$SECONDS
}

if [ -z "$JOIN" ]; then
    PDSERVE_TEMP_KEYS="$TMP_KEYS" "${SETSID[@]}" "$PY" -m frontend --model "$MODEL" --clients "$CLIENTS" --nodes "$NODES" "${KEY_ARGS[@]}" \
        --threads 1 --drain-timeout "$DRAIN_TIMEOUT" "${REMOTE[@]}" "${FRONTEND_OPTS[@]}" "${FRONTEND_EXTRA[@]}" &
    FRONTEND_PID=$!
fi
for i in $(seq 0 $((NUM_NODES - 1))); do start_node "$i"; BACKOFF[$i]=1; RESTART_AT[$i]=""; done

DEAD=""
find_dead() {  # sets DEAD to "NAME (pid P) exited with code C" for a process that exited
    local i rc   # NOTE: not in a subshell: only this shell can wait for its children
    DEAD=""
    if [ -n "$FRONTEND_PID" ] && ! kill -0 "$FRONTEND_PID" 2>/dev/null; then
        rc=0; wait "$FRONTEND_PID" || rc=$?; DEAD="the frontend (pid $FRONTEND_PID) exited with code $rc"; return
    fi
    for i in "${!NODE_PIDS[@]}"; do
        if ! kill -0 "${NODE_PIDS[$i]}" 2>/dev/null; then
            rc=0; wait "${NODE_PIDS[$i]}" || rc=$?; DEAD="${NAMES[$i]} (pid ${NODE_PIDS[$i]}) exited with code $rc"; return
        fi
    done
}

# Ready means our frontend has heard from every node started here (nodes of other
# hosts may join later), or, joining, that every node here was accepted by the
# frontend there: a handshake, not a sleep.
is_ready() {
    if [ -n "$JOIN" ]; then
        local name
        for name in "${NAMES[@]}"; do [ -f "$READY_DIR/$name" ] || return 1; done
    else
        "$PY" -m frontend.cli --endpoint "$CLIENTS" --wait-ready 2 --wait-names "$(IFS=,; echo "${NAMES[*]}")" \
            --frontend-pid "$FRONTEND_PID" >/dev/null 2>&1
    fi
}
deadline=$((SECONDS + READY_TIMEOUT))
until is_ready; do
    [ -n "$JOIN" ] && sleep 0.2
    find_dead
    if [ -n "$DEAD" ]; then
        echo "[pdserve] $DEAD during start-up (its error is above); stopping" >&2
        cleanup; exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
        if [ -n "$JOIN" ]; then
            echo "[pdserve] the frontend at $JOIN did not accept every node here within ${READY_TIMEOUT}s (unreachable, or other keys?); stopping" >&2
        else
            echo "[pdserve] not ready after ${READY_TIMEOUT}s; stopping" >&2
        fi
        cleanup; exit 1
    fi
done
if [ -n "$JOIN" ]; then
    echo "[pdserve] joined the frontend at $JOIN: ${NAMES[*]} registered (node pids ${NODE_PIDS[*]}; KV at $ADDR from port $((BASE_PORT + 2)); $LINKS)" >&2
    echo "PDSERVE_JOINED=$JOIN"
else
    HTTP_NOTE=""; [ -n "$HTTP_PORT" ] && HTTP_NOTE=", OpenAI API at http://$ADDR:$HTTP_PORT/v1"
    echo "[pdserve] ready: ${#PREFILL_DEVS[@]} prefill + ${#DECODE_DEVS[@]} decode nodes; clients connect to $CLIENTS$HTTP_NOTE (frontend pid $FRONTEND_PID, node pids ${NODE_PIDS[*]}; $LINKS)" >&2
    echo "PDSERVE_ENDPOINT=$CLIENTS"
fi

if [ $DEMO = 1 ]; then
    rc=0
    "$PY" -m frontend.cli --endpoint "$CLIENTS" --max-tokens 24 --ignore-eos \
        --prompt "The prefill node computes the prompt" \
        --prompt "Hello, world! How are you?" \
        --prompt "café naïve résumé" || rc=$?
    "$PY" -m frontend.cli --endpoint "$CLIENTS" --max-tokens 24 --temperature 0.8 --seed 7 \
        --prompt "A streamed, sampled answer:" || rc=$?
    echo "[pdserve] demo done; stopping" >&2
    cleanup
    exit $rc
fi

# Serve until a signal arrives or the frontend exits. A node that exits is started
# again after its backoff (which resets once a node has run for a minute).
while true; do
    sleep 0.2
    if [ -n "$FRONTEND_PID" ] && ! kill -0 "$FRONTEND_PID" 2>/dev/null; then
        rc=0; wait "$FRONTEND_PID" || rc=$?
        echo "[pdserve] the frontend (pid $FRONTEND_PID) exited with code $rc; stopping the cluster" >&2
        FRONTEND_PID=""
        cleanup; exit 1
    fi
    for i in $(seq 0 $((NUM_NODES - 1))); do
        if [ -n "${RESTART_AT[$i]}" ]; then
            if [ $SECONDS -ge "${RESTART_AT[$i]}" ]; then
                echo "[pdserve] restarting ${NAMES[$i]}" >&2
                RESTART_AT[$i]=""; start_node "$i"
            fi
        elif ! kill -0 "${NODE_PIDS[$i]}" 2>/dev/null; then
            rc=0; wait "${NODE_PIDS[$i]}" || rc=$?
            if [ $RESTART = 0 ]; then
                echo "[pdserve] ${NAMES[$i]} (pid ${NODE_PIDS[$i]}) exited with code $rc; stopping the cluster" >&2
                cleanup; exit 1
            fi
            [ $((SECONDS - STARTED_AT[$i])) -ge 60 ] && BACKOFF[$i]=1
            echo "[pdserve] ${NAMES[$i]} (pid ${NODE_PIDS[$i]}) exited with code $rc; restarting in ${BACKOFF[$i]}s" >&2
            RESTART_AT[$i]=$((SECONDS + BACKOFF[$i]))
            BACKOFF[$i]=$(( BACKOFF[$i] * 2 > 30 ? 30 : BACKOFF[$i] * 2 ))
        fi
    done
done
