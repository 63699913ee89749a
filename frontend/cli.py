"""pdserve client: send prompts to a frontend, or read its stats.

.venv/bin/pdserve client --endpoint tcp://127.0.0.1:5600 --prompt "Hello" [--json]
.venv/bin/pdserve client --stats
"""

from __future__ import annotations

import argparse
import json
import sys

from common.runtime.process import HelpFormat
from common.wire.protocol import StatsReply
from frontend.client import DEFAULT_MAX_TOKENS, Client, ServerError


def format_stats(stats: StatsReply) -> str:
    """Every node, one line each, and how many requests took each prefill -> decode route."""
    cols = (
        "node",
        "role",
        "alive",
        "device",
        "kv",
        "routed",
        "running",
        "waiting",
        "free blocks",
        "preempted",
        "drafts accepted",
    )
    rows = []
    for name, n in sorted(stats.nodes.items()):
        waiting = n.get("num_waiting", n.get("num_queued", ""))
        free = f"{n.get('num_free_blocks', '?')}/{n.get('num_usable_blocks', '?')}"
        rows.append(
            (
                name,
                n.get("role", "?"),
                "yes" if n.get("is_alive") else "NO",
                n.get("device", "?"),
                n.get("kv_transfer", "?"),
                n.get("num_routed", 0),
                n.get("num_running", n.get("num_prefilling", "")),
                waiting,
                free,
                n.get("num_preemptions", ""),
                _drafts_accepted(n),
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    lines = [
        "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (cols, *rows)
    ]
    fe = stats.frontend or {}
    lines.append(
        f"\nready: {stats.is_ready}; model {(stats.model or {}).get('name')}; "
        f"frontend: {fe.get('num_running', 0)} running, {fe.get('num_waiting', 0)} waiting, "
        f"{fe.get('num_served', 0)} served"
    )
    routes = fe.get("routes") or {}
    lines.append(
        "routes: " + (", ".join(f"{k}: {v}" for k, v in sorted(routes.items())) or "none yet")
    )
    return "\n".join(lines)


def _drafts_accepted(n: dict) -> str:
    """A speculating decode node's accepted drafts of those verified, and the mean tokens a
    row made per verify step; '' for other nodes."""
    drafted, accepted = n.get("num_drafted_tokens"), n.get("num_accepted_tokens")
    if not isinstance(drafted, int) or not isinstance(accepted, int):
        return ""
    return f"{accepted}/{drafted} ({n.get('mean_accepted_len', '?')} a step)"


def _add_link_args(p: argparse.ArgumentParser) -> None:
    """Where the frontend is and how to reach it: every command's options."""
    p.add_argument(
        "--endpoint", default="tcp://127.0.0.1:5600", help="the frontend's client endpoint"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds to wait for the frontend to answer at all",
    )
    p.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="for a frontend with --client-keys: the key directory ...",
    )
    p.add_argument("--key-name", default="client", help="... and this client's key in DIR/clients")


def _client(a: argparse.Namespace) -> Client:
    """ValueError: a bad endpoint or key."""
    return Client(a.endpoint, keys_dir=a.keys, key_name=a.key_name, connect_timeout_s=a.timeout)


def drain(argv: list[str] | None = None) -> int:
    """pdserve drain NODE: stop routing to a node, move its requests to other nodes, and
    let it exit once empty (a launcher restarts it). Refused (exit 1) unless the client
    endpoint is loopback or clients are keyed."""
    p = argparse.ArgumentParser(
        prog="pdserve drain", description=drain.__doc__, formatter_class=HelpFormat
    )
    p.add_argument("node", help="the node's name, as in pdserve client --stats")
    _add_link_args(p)
    a = p.parse_args(argv)
    try:
        with _client(a) as c:
            reply = c.drain(a.node, a.timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(drain_summary(reply))
    return 0


def drain_summary(reply) -> str:
    """What a drain does, as the frontend answered it (a DrainReply)."""
    stay = f", {reply.num_staying} finishing there" if reply.num_staying else ""
    alone = (
        ""
        if reply.has_peer
        else " (no other live node of its role: new requests are refused until one is ready)"
    )
    return (
        f"draining {reply.node}: {reply.num_moved} requests moving to other nodes{stay}"
        f"{alone}; it stops once empty"
    )


def _names(text: str | None) -> list[str] | None:
    """A comma-separated list of names; None: none given."""
    if text is None:
        return None
    return [n for n in text.split(",") if n]


def _ending(out) -> str:
    """How an output ended, as the CLI shows it: its finish reason, and its error if any."""
    if out.error:
        return f"{out.finish_reason}: {out.error}"
    return out.finish_reason


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every request finished normally; 1 when one failed or the frontend
    did not answer; 2 for bad options; 130 on Ctrl-C (the requests are aborted)."""
    p = argparse.ArgumentParser(
        prog="pdserve client", description=__doc__, formatter_class=HelpFormat
    )
    _add_link_args(p)
    p.add_argument("--prompt", action="append", default=[], help="repeat for several prompts")
    p.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate at most"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="-1: off")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed per request")
    p.add_argument("--stop", action="append", default=[], help="a stop string; repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens whatever comes")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may run on the cluster (default: the frontend's)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument(
        "--stats",
        action="store_true",
        help="print every node and the routing counts (with --json: everything, as JSON)",
    )
    p.add_argument(
        "--wait-ready",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wait until a prefill and a decode node are ready",
    )
    p.add_argument(
        "--wait-nodes",
        type=int,
        default=0,
        metavar="N",
        help="with --wait-ready: until N nodes in all are live",
    )
    p.add_argument(
        "--wait-names",
        default=None,
        metavar="A,B",
        help="with --wait-ready: until these nodes are live (no prefill and decode pair needed)",
    )
    p.add_argument(
        "--frontend-pid",
        type=int,
        default=None,
        help="with --wait-ready: the answer must come from this frontend process",
    )
    a = p.parse_args(argv)
    if not a.prompt and not a.stats and a.wait_ready is None:
        p.error(
            "nothing to do: give --prompt TEXT (repeat it for several), --stats or --wait-ready S"
        )
    try:
        client = _client(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rc = 0
    with client:
        try:
            if a.wait_ready is not None:
                client.wait_ready(
                    a.wait_ready,
                    a.wait_nodes,
                    a.frontend_pid,
                    _names(a.wait_names),
                )
            if a.stats:
                client.connect()
                stats = client.stats()
                print(json.dumps(vars(stats), indent=2) if a.json else format_stats(stats))
            if not a.prompt:
                return 0
            params = dict(
                max_tokens=a.max_tokens,
                temperature=a.temperature,
                top_p=a.top_p,
                top_k=a.top_k,
                seed=a.seed,
                stop=a.stop,
                ignore_eos=a.ignore_eos,
                timeout_s=a.request_timeout,
            )
            if a.json or len(a.prompt) > 1:
                results = client.complete_many([dict(prompt=t, **params) for t in a.prompt])
                for prompt, r in zip(a.prompt, results):
                    if a.json:
                        print(json.dumps(r.to_dict()))
                    else:
                        print(f"> {prompt}\n{r.text}\n[{_ending(r)}]\n")
                    rc |= r.finish_reason not in ("stop", "length")
            else:
                for out in client.generate(a.prompt[0], **params):  # stream as it comes
                    print(out.text, end="", flush=True)
                    if out.is_finished:
                        print(f"\n[{_ending(out)}]")
                        rc |= out.finish_reason not in ("stop", "length")
        except (TimeoutError, ServerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # leaving the with block aborts what is in flight
            print("\ninterrupted: requests aborted", file=sys.stderr)
            return 130
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
