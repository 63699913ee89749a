"""python -m frontend --model DIR --clients tcp://127.0.0.1:5600 --nodes tcp://127.0.0.1:5601"""
import argparse
import asyncio
import dataclasses
import sys

from common.wire.channel import LinkError
from common.base.config import FrontendConfig, NodeLinks
from common.base.log import add_log_level_arg, set_level
from common.runtime.process import HelpFormat, add_thread_args, apply_threads, die_with_parent
from frontend.server import Frontend


# The flags' defaults are the config's own.
DEFAULT = {f.name: f.default for f in dataclasses.fields(FrontendConfig)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m frontend", description=__doc__,
                                formatter_class=HelpFormat)
    p.add_argument("--model", required=True, help="model directory (tokenizer and limits)")
    p.add_argument("--clients", required=True, help="endpoint clients connect to")
    p.add_argument("--nodes", required=True, help="endpoint nodes connect to")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens limit (default: the model's max_position_embeddings)")
    p.add_argument("--default-timeout", type=float, default=DEFAULT["default_timeout_s"],
                   help="seconds per request")
    p.add_argument("--dead-after", type=float, default=NodeLinks.dead_after_s,
                   help="seconds of node silence")
    p.add_argument("--hung-after", type=float, default=DEFAULT["hung_after_s"],
                   help="seconds a node's loop may go without turning before it counts as dead")
    p.add_argument("--forget-after", type=float, default=DEFAULT["forget_after_s"],
                   help="seconds after which a dead node leaves the node list")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT["drain_timeout_s"],
                   help="on SIGTERM, seconds running requests get to finish")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="CURVE keys (python -m launch.keys DIR): nodes must hold one")
    p.add_argument("--client-keys", action="store_true",
                   help="clients too must hold a key (DIR/clients/NAME)")
    p.add_argument("--max-requests-per-client", type=int, default=DEFAULT["max_requests_per_client"],
                   help="requests in flight per client connection; past it: overloaded")
    p.add_argument("--max-kv-tokens-per-client", type=int, default=DEFAULT["max_kv_tokens_per_client"],
                   help="prompt + max_tokens over a client's requests in flight; past it: overloaded")
    p.add_argument("--max-queued-tokens", type=int, default=DEFAULT["max_queued_tokens"],
                   help="prompt tokens sent to one prefill node and not yet prefilled; "
                        "the rest wait here, clients taking turns")
    p.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI API, /metrics and /health on this port (default: no HTTP)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="without --http-port: serve /metrics and /health alone on this port")
    p.add_argument("--http-host", default=None,
                   help="HTTP address (default: 127.0.0.1, or 0.0.0.0 with --allow-remote)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name HTTP clients use (default: the model directory's name)")
    p.add_argument("--allow-remote", action="store_true",
                   help="serve clients, nodes and HTTP beyond this machine")
    add_thread_args(p)
    add_log_level_arg(p)
    a = p.parse_args(argv)
    set_level(a.log_level)
    die_with_parent()
    try:
        apply_threads(a.threads, a.cpus, device="none")   # no device: one thread unless told
        cfg = FrontendConfig(model=a.model, client_endpoint=a.clients, node_endpoint=a.nodes,
                             max_model_len=a.max_model_len, default_timeout_s=a.default_timeout,
                             links=NodeLinks(dead_after_s=a.dead_after), allow_remote=a.allow_remote,
                             keys_dir=a.keys, is_client_auth=a.client_keys,
                             max_requests_per_client=a.max_requests_per_client,
                             max_kv_tokens_per_client=a.max_kv_tokens_per_client,
                             max_queued_tokens=a.max_queued_tokens, hung_after_s=a.hung_after,
                             forget_after_s=a.forget_after, drain_timeout_s=a.drain_timeout,
                             http_port=a.http_port, metrics_port=a.metrics_port,
                             http_host=a.http_host or ("0.0.0.0" if a.allow_remote else "127.0.0.1"),
                             served_model_name=a.served_model_name)
        frontend = Frontend(cfg)
    except ValueError as e:
        print(f"frontend: {e}", file=sys.stderr)
        return 2
    try:
        try:
            import uvloop
            return uvloop.run(frontend.run())
        except ImportError:
            return asyncio.run(frontend.run())
    except LinkError as e:
        print(f"frontend: {e}", file=sys.stderr)
        return 1

if __name__ == "__main__":
    sys.exit(main())
