"""Both halves of a handoff in one process: a fake clock, an in-memory KV link
whose messages pass through the real codec, and real tcp frames between two
small CPU caches."""

from __future__ import annotations

from collections import deque

import torch

from common import transfer
from common.base.request import SamplingParams
from common.engine.prefill_job import PrefillJob
from common.handoff.receiver import Receiver
from common.handoff.sender import Sender
from common.handoff.states import Reservation
from common.kv.blocks import BlockAllocator, block_bytes
from common.wire import protocol
from common.wire.protocol import PREFILL_TO_DECODE, KVCommit, KVReserve, KVTransfer
from decode_node.scheduler import DecodeScheduler

PREFILL = b"prefill-0/1"
BLOCK_SIZE = 4


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class MemLink:
    """The prefill node's end of the KV link. is_cut: everything sent either way is
    lost (a frozen peer or a cut network), while sends still succeed."""

    def __init__(self):
        self.to_decode: deque[list[bytes]] = deque()
        self.to_prefill: deque[list[bytes]] = deque()
        self.sent: list = []  # every message the prefill side sent, in order
        self.num_bad = 0
        self.is_cut = False
        self.is_refusing = False  # sends fail (a link not connected): nothing queues
        self.is_closed = False
        self.num_reconnects = 0

    def send(self, msg, block: bool = True) -> bool:
        if self.is_refusing:
            return False
        self.sent.append(msg)
        if not self.is_cut:
            self.to_decode.append([bytes(f) for f in protocol.encode(msg)])
        return True

    def reset(self) -> None:
        """A middlebox resets the connection: what is on the way either way is lost, and
        the link is made again."""
        self.to_decode.clear()
        self.to_prefill.clear()
        self.num_reconnects += 1

    def take_reconnects(self) -> int:
        n, self.num_reconnects = self.num_reconnects, 0
        return n

    def has_message(self) -> bool:
        return bool(self.to_prefill)

    def recv(self, allowed: tuple):
        return b"decode", protocol.decode(self.to_prefill.popleft(), allowed)

    def close(self) -> None:
        self.is_closed = True


def receiver(
    pool: DecodeScheduler,
    send=None,
    clock=None,
    lease_s: float = 30.0,
    max_queue: int = 8,
    cache: torch.Tensor | None = None,
    epoch: str = "e1",
    backends=("tcp",),
    shm_name: str | None = None,
) -> Receiver:
    """A decode half over pool; without a cache, over a one-layer cache of its blocks."""
    if cache is None:
        cache = torch.zeros(1, 2, pool.prefix_cache.capacity + 1, pool.block_size, 1, 2)
    sink = transfer.KVSink(transfer.LocalCache(cache, "127.0.0.1", shm_name), list(backends))
    return Receiver(
        epoch=epoch,
        lease_s=lease_s,
        max_queue=max_queue,
        pool=pool,
        sink=sink,
        send=send or (lambda msg, to: True),
        vocab_size=100,
        max_model_len=1 << 16,
        **({"clock": clock} if clock else {}),
    )


def reserve(
    rx: Receiver, request_id: str, prompt_len: int, max_tokens: int, sender: bytes = b"p"
) -> Reservation:
    rx.receive(sender, KVReserve(request_id, prompt_len, max_tokens))
    return rx.held[request_id]


def commit(
    rx: Receiver, request_id: str, prompt_len: int, max_tokens: int, sender: bytes = b"p"
) -> None:
    """Its KV written (zeros, one tcp frame of every layer) and committed, as a prefill node
    does."""
    r = rx.held.get(request_id)
    name, num_layers = (r.name, rx.sink.cache.shape[0]) if r is not None else ("", 0)
    if r is not None:
        c = rx.sink.cache
        kv = torch.zeros(c.shape[0], 2, len(r.block_ids), *c.shape[3:], dtype=c.dtype)
        rx.receive(sender, KVTransfer(request_id, name, "tcp", {"first_layer": 0}, kv))
    rx.receive(
        sender,
        KVCommit(
            request_id,
            prompt_len,
            1,
            SamplingParams(max_tokens=max_tokens),
            {},
            "tcp",
            [1] * prompt_len,
            name,
            num_layers,
        ),
    )


class Pair:
    """A Sender and a Receiver joined by a MemLink, each on its own cache."""

    def __init__(
        self,
        num_decode_blocks: int = 12,
        lease_s: float = 30.0,
        handoff_lease_s: float = 10.0,
        max_queue: int = 8,
        is_preemptive: bool = True,
        layerwise: str = "off",
        backend: str = "tcp",
    ):
        """backend: tcp, or ipc (the decode cache in shared memory, copied into as a prefill
        node on its host does)."""
        self.clock = FakeClock()
        self.backend = backend
        self.lease_s, self.max_queue = lease_s, max_queue
        self.num_decode_blocks, self.is_preemptive = num_decode_blocks, is_preemptive
        self.src = torch.randn(2, 2, 17, BLOCK_SIZE, 1, 2)  # prefill cache, 16 usable blocks
        self.prefix = BlockAllocator(17)
        self.link = MemLink()
        self.data = MemLink()  # the link's data connection: tcp frames
        self.rx = self.start_decode("e1")
        self.failed: list[tuple[str, str]] = []
        self.retryable: set[str] = set()  # ids of failures the frontend may move elsewhere
        self.tx = Sender(
            name="prefill-0",
            handoff_lease_s=handoff_lease_s,
            block_size=BLOCK_SIZE,
            block_bytes=block_bytes(self.src),
            connect=lambda name, endpoint, suffix, max_queued: self.data if suffix else self.link,
            open_writer=self._open_writer,
            free_blocks=self.prefix.free,
            drop_job=self._drop_job,
            fail=self._failed,
            clock=self.clock,
            num_layers=self.src.shape[0],
            layerwise=layerwise,
        )

    def start_decode(self, epoch: str) -> Receiver:
        """A decode node (again, after a restart: a new epoch, cache and pool)."""
        self.pool = DecodeScheduler(
            BlockAllocator(self.num_decode_blocks + 1), BLOCK_SIZE, 4, self.is_preemptive
        )
        shape = (2, 2, self.pool.prefix_cache.capacity + 1, BLOCK_SIZE, 1, 2)
        shm_name = None
        if self.backend == "ipc":
            from common.engine.platform import CpuPlatform

            self.platform = CpuPlatform(torch.device("cpu"))
            self.dst = self.platform.allocate(shape, torch.float32, is_shared=True)
            shm_name = self.platform.share(self.dst)
        else:
            self.dst = torch.zeros(shape)
        self.rx = receiver(
            self.pool,
            self._to_prefill,
            self.clock,
            self.lease_s,
            self.max_queue,
            self.dst,
            epoch,
            backends=[self.backend],
            shm_name=shm_name,
        )
        return self.rx

    def _open_writer(self, welcome, send):
        writer = transfer.open_writer(self.backend, welcome, self.src, send)
        if hasattr(writer, "clock"):  # ipc stops itself at its deadline, on this clock
            writer.clock = self.clock
        return writer

    def close(self) -> None:
        self.tx.close()
        self.rx.close()
        if self.backend == "ipc":
            self.platform.release(self.dst)

    def _to_prefill(self, msg, to: bytes) -> bool:
        assert to == PREFILL
        if not self.link.is_cut:
            self.link.to_prefill.append([bytes(f) for f in protocol.encode(msg)])
        return True

    def _failed(self, request_id: str, error: str, is_retryable: bool) -> None:
        self.failed.append((request_id, error))
        if is_retryable:
            self.retryable.add(request_id)

    def _drop_job(self, job: PrefillJob) -> None:
        self.prefix.free(job.block_ids)
        job.block_ids = []

    def job(self, request_id: str, prompt_len: int = 10, max_tokens: int = 4) -> PrefillJob:
        j = PrefillJob(
            request_id,
            [1] * prompt_len,
            SamplingParams(max_tokens=max_tokens),
            0.0,
            "decode-0",
            "tcp://127.0.0.1:1",
        )
        j.block_ids = self.prefix.allocate((prompt_len + BLOCK_SIZE - 1) // BLOCK_SIZE)
        return j

    def pump(self, turns: int = 20) -> None:
        """Loop turns on both sides until no message is on the way."""
        for _ in range(turns):
            self.deliver_data()
            while self.link.to_decode:
                self.rx.receive(
                    PREFILL, protocol.decode(self.link.to_decode.popleft(), PREFILL_TO_DECODE)
                )
            self.rx.turn()
            self.tx.receive(self.link)
            self.tx.advance()
            if not self.link.to_decode and not self.link.to_prefill and not self.data.to_decode:
                return
        raise AssertionError("the two halves kept talking")

    def deliver_data(self) -> None:
        """What is on the data connection arrives (the decode node sees its "/kv" tag)."""
        while self.data.to_decode:
            self.rx.receive(
                PREFILL + b"/kv", protocol.decode(self.data.to_decode.popleft(), PREFILL_TO_DECODE)
            )

    def run_for(self, seconds: float, step_s: float = 0.5) -> None:
        """Time passes in steps, both loops turning after each."""
        for _ in range(round(seconds / step_s)):
            self.clock.advance(step_s)
            self.pump()

    def sent(self, kind: type) -> int:
        return sum(isinstance(m, kind) for m in self.link.sent)


def start_all(sched: DecodeScheduler, r: Reservation):
    """A committed reservation's sequences started and all admitted (rows to spare):
    (the sequences, the blocks to copy)."""
    started, copies = sched.start(r)
    return [sched.admit(j.seq) for j in started], copies
