"""The `pdserve` command, installed into the project's environment:

    pdserve serve [start_cluster options]     start a cluster (launch/start_cluster.sh)
    pdserve client [options]                  send prompts, read stats (frontend.cli)
    pdserve bench [KIND] [options]            a benchmark (launch/bench/): serving (the default:
                                              a running cluster), prefill, decode, transfer,
                                              migration, vs, profile, layerwise, mixed, ray-start,
                                              attention, linear, spec, kv, answer
    pdserve scale --endpoint E --num-prefill N --num-decode M
                                              add or drain nodes of a cluster on Ray (serve --ray)
    pdserve drain NODE [--endpoint ...]       move a node's requests elsewhere; it stops once empty
    pdserve keys DIR --nodes ...              make CURVE keys (launch.keys)
    pdserve make-tiny-model DIR               a tiny random Qwen3 checkpoint

`pdserve COMMAND --help` shows each command's options and defaults.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _serve(argv: list[str]) -> int:
    if "--ray" in argv:  # Ray's environment on each machine runs the processes: no set-up here
        from launch.ray.cluster import serve

        return serve(argv)
    # The launcher is a shell script (it supervises processes); it runs in this
    # interpreter's virtual environment, or the project's .venv.
    env = dict(os.environ)
    if sys.prefix != sys.base_prefix:
        env.setdefault("PDSERVE_VENV", sys.prefix)
    os.execvpe("bash", ["bash", str(ROOT / "launch" / "start_cluster.sh"), *argv], env)
    return 1  # not reached


def _module(name: str, function: str = "main"):
    def run(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(name), function)(argv) or 0

    return run


BENCHMARKS = (
    "serving",
    "prefill",
    "decode",
    "transfer",
    "migration",
    "vs",
    "profile",
    "layerwise",
    "mixed",
    "ray-start",
    "attention",
    "linear",
    "spec",
    "kv",
    "answer",
)


def _bench(argv: list[str]) -> int:
    """pdserve bench KIND [options]; without a KIND, the serving benchmark."""
    kind, argv = (argv[0], argv[1:]) if argv and argv[0] in BENCHMARKS else ("serving", argv)
    return _module(f"launch.bench.{kind.replace('-', '_')}")(argv)


COMMANDS = {
    "serve": _serve,
    "client": _module("frontend.cli"),
    "drain": _module("frontend.cli", "drain"),
    "scale": _module("launch.ray.cluster", "scale"),
    "bench": _bench,
    "keys": _module("launch.keys"),
    "make-tiny-model": _module("launch.make_tiny_model"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(
            f"pdserve: unknown command {argv[0]!r}; one of {', '.join(COMMANDS)}", file=sys.stderr
        )
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
