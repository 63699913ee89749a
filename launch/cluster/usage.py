"""launch/start_cluster.sh's usage, as --help prints it (plan.py reads the options)."""

USAGE = """usage: pdserve serve [--demo] [--model DIR] [--host 127.0.0.1] [--advertise-host H]
     [--base-port 5600] [--name-prefix P] [--join NODE_ENDPOINT]
     [--prefill-devices D[,D...]] [--decode-devices D[,D...]]      one node per device listed
     [--num-prefill N] [--num-decode M]     N or M nodes on the one device given
                                            (default 1; 0: none here)
     [--kv-transfer auto|ipc|nixl|tcp|dist] [--kv-layerwise auto|on|off]
     [--disaggregate auto|always|never]
     [--dtype T] [--kv-cache-memory SIZE] [--max-batch-size N] [--max-model-len N]
     [--block-size N] [--token-budget N] [--kv-cache-fraction F] [--kv-cache-dtype auto|int8|fp8]
     [--kv-wire-dtype same|auto|int8]
     [--http-port 8000 | --no-http] [--no-access-log] [--served-model-name NAME] [--log-level LEVEL]
     [--no-prefix-caching] [--swap-space GIB] [--no-preemption] [--kv-verify]
     [--speculative-config JSON|auto|off]
     [--reasoning-parser qwen3] [--tool-call-parser qwen3|hermes|none] [--enable-auto-tool-choice]
     [--logprobs-mode raw_logprobs|processed_logprobs] [--allow-json-whitespace]
     [--keys DIR | --no-keys] [--no-restart-nodes] [--no-core-sharing] [--drain-timeout S]
     [--ready-timeout S] [--frontend-arg ARG]... [--prefill-arg ARG]... [--decode-arg ARG]...
     [--ray [auto|HOST:PORT] [--ray-cpus-per-node N] [--ray-ship-model]]
                                            on a Ray cluster (docs/ray.md)

bash launch/start_cluster.sh takes the same options. Endpoints derive from the base
port: clients connect to BASE, nodes to the frontend at BASE+1, and decode node i takes
KV handoffs at BASE+2+i. The frontend serves the OpenAI API, /metrics and /health at
--http-port (8000), with an access log (--no-access-log: none). vLLM's names work too:
--max-num-seqs, --max-num-batched-tokens, --gpu-memory-utilization, --max-model-len,
--block-size.
With no --model, a tiny random Qwen3 is made on first use (no download). --host 0.0.0.0
(or ::) binds every interface; decode nodes then tell prefill nodes to hand KV to
--advertise-host (default: this host's first address). Node links use CURVE keys: a
fresh set per cluster (removed at exit) unless --keys DIR names a kept one; --no-keys
leaves them open. Across hosts (docs/hosts.md): --name-prefix P names this host's nodes,
and --join tcp://A:PORT (the frontend host's BASE+1) starts only this host's nodes,
which register there; it prints PDSERVE_JOINED=ENDPOINT once they are. A node that
dies is restarted with backoff (1 s doubling to 30 s); if the frontend dies, everything
stops. SIGTERM/SIGINT drain: running requests get --drain-timeout seconds (30). The CPU nodes
started here share this host's cores, each owed its split (--no-core-sharing: fixed
threads per node)."""
