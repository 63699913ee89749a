"""What every node process does at start: read worker options and turn SIGTERM/SIGINT
into a clean stop (its life is tied to its launcher's first: common/base/lifetime.py)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import signal
import sys
import threading

from common.base import placement
from common.base.config import WorkerConfig
from common.base.flags import add_flags, flagged
from common.base.log import add_log_level_arg, set_level, set_name
from common.wire.channel import LinkError


class HelpFormat(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's layout and shows every default (unless its help
    already says it, or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.default in (None, argparse.SUPPRESS, False):
            return text
        return super()._get_help_string(action)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Worker options (WorkerConfig's flags), then the process's threads and logging."""
    add_flags(p, WorkerConfig, "model and device")
    add_thread_args(p)
    add_log_level_arg(p)


def add_thread_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("host threads")
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads in this process (default: one per core it may run on for "
        "a cpu device, 1 for an accelerator, whose host work is launching); "
        "start_cluster.sh divides the host's cores among the processes it starts",
    )
    g.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="run only on these cores, e.g. 0-3 or 1,5 (Linux)",
    )


def parse_cpus(text: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}, or a ValueError."""
    try:
        return set(placement.parse_cpus(text))
    except ValueError as e:
        raise ValueError(f"--cpus takes core numbers such as 0-3 or 1,5 ({text!r}: {e})") from None


def apply_threads(threads: int | None, cpus: str | None, is_host_device: bool) -> None:
    """Pin and size this process's thread pool before any work: by default one thread per
    core it may run on where the device is the host (the forward runs here), else one.
    NOTE: call before torch's first parallel op: its pool is sized once."""
    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if cpus:
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("--cpus needs an OS that can pin threads (Linux)")
        try:
            os.sched_setaffinity(0, parse_cpus(cpus))
        except OSError as e:
            raise ValueError(f"--cpus {cpus}: {e.strerror}") from None
    num_cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    torch.set_num_threads(threads or (num_cores if is_host_device else 1))


def keep_freed_memory() -> None:
    """glibc: keep freed memory in the heap instead of returning each large block.
    NOTE: by default a tensor of more than a few MiB is a fresh mmap, page-faulted and
    zeroed on first touch, on every forward; a CPU node allocates many (8-13% of a step)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)


def describe_threads(num: int | None = None) -> str:
    """'2 threads on cores 0-1', for a process's start-up line. num: the threads its work
    may use where that is not torch's pool (a CPU node's lanes, or its cap in a core
    pool: the launcher's count for it)."""
    import torch

    num = torch.get_num_threads() if num is None else num
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
    where = f"cores {placement.format_cpus(cores)}" if cores else f"{os.cpu_count()} cores"
    return f"{num} thread{'s' * (num > 1)} on {where}"


def worker_config(a: argparse.Namespace, is_host_device: bool) -> WorkerConfig:
    """The worker config from parsed options (is_host_device: the device's memory is the
    host's, its platform says): ValueError names what is wrong. From here on the process's
    log lines carry the node's name (--name)."""
    set_level(a.log_level)
    set_name(getattr(a, "name", None))
    apply_threads(a.threads, a.cpus, is_host_device)
    if is_host_device:
        keep_freed_memory()
    return WorkerConfig(**flagged(WorkerConfig, a))


def run_node(prog: str, build, stop: threading.Event) -> int:
    """Build a node and run it; a bad option or an unusable device, model or port ends
    the process with one line on stderr (exit 2 for options, a model or KV budget the
    worker refuses as it loads included; 1 for the rest)."""
    try:
        node = build()
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except LinkError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    freeze_startup_objects()
    try:
        return node.run(stop)
    except LinkError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1


def freeze_startup_objects() -> None:
    """What starting made (modules, the model's records) lives as long as the process: out
    of the garbage collector's way. NOTE: else each full collection walks it all, a pause
    of ~60 ms in a serving step with torch loaded (measured while a drafter made tuples)."""
    gc.collect()
    gc.freeze()


class StopEvent(threading.Event):
    """Set to stop now. drain: set by the first SIGTERM, to stop once the node's
    requests have moved elsewhere or finished (common/runtime/node.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.drain = threading.Event()


def stop_event_on_signals() -> StopEvent:
    """The first SIGTERM asks for a drain, a second one (or SIGINT) stops at once; the
    node loop checks both each turn."""
    stop = StopEvent()

    def on_term(*_) -> None:
        (stop.set if stop.drain.is_set() else stop.drain.set)()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop
