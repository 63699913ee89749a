"""python -m frontend --model DIR --clients tcp://127.0.0.1:5600 --nodes tcp://127.0.0.1:5601"""
import argparse
import asyncio

from common.config import FrontendConfig, NodeLinks
from common.process import die_with_parent
from frontend.server import Frontend


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m frontend", description=__doc__)
    p.add_argument("--model", required=True, help="model directory (tokenizer and limits)")
    p.add_argument("--clients", required=True, help="endpoint clients connect to")
    p.add_argument("--nodes", required=True, help="endpoint nodes connect to")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--default-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--dead-after", type=float, default=3.0, help="seconds of node silence")
    p.add_argument("--allow-remote", action="store_true")
    a = p.parse_args(argv)
    die_with_parent()
    cfg = FrontendConfig(model=a.model, client_endpoint=a.clients, node_endpoint=a.nodes,
                         max_model_len=a.max_model_len, default_timeout_s=a.default_timeout,
                         links=NodeLinks(dead_after_s=a.dead_after), allow_remote=a.allow_remote)
    try:
        import uvloop
        uvloop.run(Frontend(cfg).run())
    except ImportError:
        asyncio.run(Frontend(cfg).run())


if __name__ == "__main__":
    main()
