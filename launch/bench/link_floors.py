"""The links a KV transfer backend has, measured as the transfer benchmark's floors:
one ZeroMQ frame on loopback TCP (tcp), TCP streams between two simulated hosts, one gloo
send between two ranks (dist on CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import torch
import zmq


def link_floor_GBps(num_bytes: int, tries: int = 3) -> float:
    """One num_bytes frame over ZeroMQ on loopback TCP, best of tries: the link the tcp
    backend has."""
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    payload = torch.empty(
        num_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
    ).numpy()
    best = float("inf")
    for _ in range(tries):
        t = threading.Thread(target=lambda: rx.recv(copy=False))
        t.start()
        t0 = time.perf_counter()
        tx.send(payload, copy=False)
        t.join()
        best = min(best, time.perf_counter() - t0)
    rx.close(0), tx.close(0), ctx.term()
    return num_bytes / best / 1e9


def hosts_floor_GBps(num_bytes: int, place: dict, num_streams: int, tries: int = 3) -> float:
    """num_bytes split over num_streams TCP connections to a receiver on the decode node's
    host that answers each share whole, best of tries: the link between the hosts."""
    share = num_bytes // num_streams
    sink = subprocess.Popen(
        [
            *place["prefix"],
            sys.executable,
            "-c",
            STREAM_SINK,
            place["decode_host"],
            str(tries),
            str(share),
            str(num_streams),
        ],
        cwd=os.getcwd(),
        stdout=subprocess.PIPE,
    )
    port = int(sink.stdout.readline())
    conns = [socket.create_connection((place["decode_host"], port)) for _ in range(num_streams)]
    payload = memoryview(bytearray(share))

    def one(c: socket.socket) -> None:
        c.sendall(payload)
        c.recv(1)

    best = float("inf")
    for _ in range(tries):
        threads = [threading.Thread(target=one, args=(c,)) for c in conns]
        t0 = time.perf_counter()
        [t.start() for t in threads]
        [t.join() for t in threads]
        best = min(best, time.perf_counter() - t0)
    [c.close() for c in conns]
    sink.wait(30)
    return share * num_streams / best / 1e9


# Run on the decode node's host: print a port, take each share whole on every
# connection (a thread each) and answer one byte.
STREAM_SINK = """import socket, sys, threading
host, tries, share, num_streams = sys.argv[1], *map(int, sys.argv[2:])
ls = socket.create_server((host, 0))
print(ls.getsockname()[1], flush=True)
conns = [ls.accept()[0] for _ in range(num_streams)]

def serve(conn):
    buf = memoryview(bytearray(share))
    for _ in range(tries):
        n = 0
        while n < share:
            n += conn.recv_into(buf[n:])
        conn.sendall(b"x")
threads = [threading.Thread(target=serve, args=(c,)) for c in conns]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def gloo_floor_GBps(num_bytes: int, tries: int = 3) -> float:
    """One num_bytes send between two ranks of a gloo group on loopback TCP, best of
    tries: the link the dist backend has on CPU."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [None, None]

    def join(rank):  # rank 1 joins through a client of its own, as a prefill node does
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, is_master=False)
        groups[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("floor", client), rank, 2, timedelta(seconds=30)
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    src, dst = torch.ones(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    best = float("inf")
    for i in range(tries):
        t0 = time.perf_counter()
        recv = groups[0].recv([dst], 1, i)
        groups[1].send([src], 0, i).wait()
        recv.wait()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best / 1e9
