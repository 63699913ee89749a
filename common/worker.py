"""The device worker: the one owner of a node's device state.

prepare() loads the weights, allocates the KV cache as one tensor and every
persistent buffer, once; prefill() and decode_step() then run any number of
times; close() releases all of it.

Decode step state lives on the device in buffers sized for max_batch_size rows.
Rows [0, num_decode_seqs) are live and dense: a leaving row is filled by the
last live one (a device-side copy). A step computes slot_mapping from seq_lens
and the block table, runs the model, samples, writes the samples into the next
step's input_ids and advances seq_lens, all on the device. The host writes
into these buffers only when a sequence joins or crosses into a new block;
every host-to-device write goes through _h2d(), which counts it.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from common import qwen3
from common.config import WorkerConfig
from common.env import read_env
from common.kv_cache import NULL_BLOCK, kv_cache_blocks, num_blocks_for
from common.model_spec import ModelSpec, load_spec, preset_spec
from common.sampling import SamplingParams, sample


# Lane threads yield to the host's latency-bound work (decode steps, the frontend):
# prefill throughput takes the cores those leave, not a share fixed in advance.
LANE_NICE = 10


def _start_lane() -> None:
    torch.set_num_threads(1)
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:   # NOTE: Linux applies a thread id's priority to that thread alone
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           os.getpriority(os.PRIO_PROCESS, 0) + LANE_NICE)
        except OSError:
            pass


@dataclass
class PrefillChunk:
    token_ids: list[int]                 # this chunk's tokens
    context_len: int                     # tokens of the same prompt already in the cache
    block_ids: list[int]                 # blocks covering context_len + len(token_ids)
    params: SamplingParams | None = None  # set on a prompt's last chunk: sample its first token


@dataclass
class DecodeTicket:
    """A launched decode step: whose tokens it makes and where they land on the host."""
    keys: list[str]
    slot: int
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    copied: torch.cuda.Event | None = None


class DeviceWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        self.block_size = cfg.block_size
        self.is_prepared = False
        self.num_h2d_writes = 0
        self.num_h2d_bytes = 0
        self.num_block_writes = 0     # block-table entries at block crossings
        self.num_block_copies = 0     # the H2D copies that carried them (one per step at most)
        self.num_decode_steps = 0
        self.num_decode_rows = 0      # summed over steps: / num_decode_steps is the mean batch
        self.num_swap_bytes = 0       # moved by swap_out and swap_in, both ways
        self._swapped: dict[str, torch.Tensor] = {}   # preempted sequences' KV on the host
        self.swapped_bytes = 0        # held in _swapped now (an int: heartbeats read it)
        self.num_prefill_tokens = 0
        self.num_prefill_passes = 0
        self.num_prefill_chunks = 0   # summed over passes: / num_prefill_passes is the mean batch
        self.max_decode_batch = 0
        self.prefill_busy_s = 0.0
        self.device_busy_s = 0.0      # decode steps, measured on the device (CUDA only)
        self.device_idle_s = 0.0      # gaps between consecutive decode steps on the device
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._count_lock = threading.Lock()
        self.num_lanes = 1            # CPU prefill: a pass's chunks split over this many threads
        self._lane_pool: ThreadPoolExecutor | None = None

    # ---- life cycle -------------------------------------------------------

    def prepare(self) -> "DeviceWorker":
        if self.is_prepared:
            return self
        cfg = self.cfg
        if self.device.type == "npu":
            import torch_npu  # noqa: F401  (registers the npu device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.spec: ModelSpec = load_spec(cfg.model) if cfg.model else preset_spec(cfg.shape)
        if cfg.model:
            from common.loader import load_weights
            self.weights = load_weights(cfg.model, self.spec, self.device, self.dtype)
        else:
            self.weights = qwen3.random_weights(self.spec, self.device, self.dtype, cfg.seed)
        self.max_model_len = min(cfg.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        self.cos_sin = kernels.rotary_cos_sin(self.max_model_len, self.spec.head_dim,
                                              self.spec.rope_theta, self.device)
        budget = cfg.kv_cache_memory
        if budget is None and self.device.type == "cpu":
            budget = cfg.cpu_kv_cache_memory
        self.num_kv_blocks = kv_cache_blocks(self.spec, self.block_size, self.dtype, self.device,
                                             budget, cfg.kv_cache_fraction)
        s = self.spec
        shape = (s.num_layers, 2, self.num_kv_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        self.kv_shm = None   # the cache's shared-memory segment, when shared on CPU
        if cfg.is_kv_shared and self.device.type == "cpu":
            from common.transfer.ipc import allocate_shared_cpu_cache
            self.kv_cache, self.kv_shm = allocate_shared_cpu_cache(shape, self.dtype)
        else:
            # On CUDA any allocation can be shared through an IPC handle.
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._allocate_decode_state()
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            # NOTE: a lane runs whole forwards on one torch thread: no barrier per op waits
            # for a core another process holds, and a busy host just time-slices the lanes.
            self.num_lanes = torch.get_num_threads()
            self._lane_pool = ThreadPoolExecutor(self.num_lanes, thread_name_prefix="prefill-lane",
                                                 initializer=_start_lane)
            torch.set_num_threads(1)   # the loop's own ops are small: no pool to wait on
        self._warm_up()
        self._capture_graphs()
        self.is_prepared = True
        atexit.register(self.close)
        return self

    def close(self) -> None:
        if not self.is_prepared:
            return
        self.is_prepared = False
        atexit.unregister(self.close)
        for name in ("weights", "kv_cache", "cos_sin", "_input_ids", "_seq_lens", "_step_inc",
                     "_block_tables", "_slot_mapping", "_temperature", "_top_p", "_top_k",
                     "_seeds", "_sampled", "_sampled_host", "_graphs", "_last_end",
                     "_block_staging", "_block_updates"):
            self.__dict__.pop(name, None)
        self._slots, self._graphs, self._last_end, self._swapped = {}, {}, None, {}
        if self._lane_pool is not None:
            self._lane_pool.shutdown()
            self._lane_pool, self.num_lanes = None, 1
        self.swapped_bytes = 0
        if self.kv_shm is not None:
            from common.transfer.ipc import release_shared_cpu_cache
            release_shared_cpu_cache(self.kv_shm)
            self.kv_shm = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def __enter__(self) -> "DeviceWorker":
        return self.prepare()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def token_capacity(self) -> int:
        """Tokens the KV cache holds (the null block excluded)."""
        return (self.num_kv_blocks - 1) * self.block_size

    @property
    def max_blocks_per_seq(self) -> int:
        return num_blocks_for(self.max_model_len, self.block_size)

    def stats(self) -> dict:
        return {"num_h2d_writes": self.num_h2d_writes, "num_h2d_bytes": self.num_h2d_bytes,
                "num_block_writes": self.num_block_writes, "num_block_copies": self.num_block_copies,
                "num_decode_steps": self.num_decode_steps, "num_decode_rows": self.num_decode_rows,
                "num_swap_bytes": self.num_swap_bytes,
                "swapped_bytes": self.swapped_bytes,
                "device_busy_s": round(self.device_busy_s, 6),
                "device_idle_s": round(self.device_idle_s, 6),
                "is_graphed": bool(self._graphs), "prefill_busy_s": round(self.prefill_busy_s, 6),
                "num_prefill_tokens": self.num_prefill_tokens,
                "num_prefill_passes": self.num_prefill_passes, "num_prefill_chunks": self.num_prefill_chunks,
                "max_decode_batch": self.max_decode_batch,
                "num_kv_blocks": self.num_kv_blocks, "token_capacity": self.token_capacity}

    # ---- the one way host data reaches the device --------------------------

    def _h2d(self, dst: torch.Tensor, values) -> None:
        """Copy host values into the device tensor dst (same shape), counted. A pinned
        source is copied without waiting; the caller keeps it unchanged until the
        device has read it."""
        src = torch.as_tensor(values, dtype=dst.dtype).reshape(dst.shape)
        dst.copy_(src, non_blocking=src.is_pinned())
        with self._count_lock:   # prefill lanes count from several threads
            self.num_h2d_writes += 1
            self.num_h2d_bytes += src.numel() * src.element_size()

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A fresh device tensor from host values (prefill inputs), counted."""
        t = torch.empty(np.shape(values), dtype=dtype, device=self.device)
        self._h2d(t, values)
        return t

    # ---- prefill -----------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk], return_logits: bool = False,
                on_kv_written=None) -> tuple[list[int | None], torch.Tensor | None]:
        """Run prompt chunks as one batch; write their KV; sample the first token of
        every chunk that carries params. Returns (token or None per chunk, and the
        fp32 logits [num_sampled, V] of the sampled chunks when asked).
        on_kv_written(), if given, is called once every layer's KV write is queued
        on the device, before the sampling waits for it: work queued there (a KV
        transfer) starts right behind the forward pass."""
        t0 = time.perf_counter()
        out, logits = self._prefill(chunks, return_logits, on_kv_written)
        self.prefill_busy_s += time.perf_counter() - t0  # _prefill ends in a device sync
        return out, logits

    def _forward_chunks(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """One forward over the chunks, packed; their KV into the cache. -> the hidden
        state of each chunk's last token [len(chunks), H]."""
        bs = self.block_size
        ids, positions, slots = [], [], []
        width = max(len(c.block_ids) for c in chunks)
        tables = np.zeros((len(chunks), width), dtype=np.int32)
        for i, c in enumerate(chunks):
            end = c.context_len + len(c.token_ids)
            if len(c.block_ids) < num_blocks_for(end, bs):
                raise ValueError(f"chunk of {end} tokens given {len(c.block_ids)} blocks")
            ids += c.token_ids
            pos = np.arange(c.context_len, end)
            positions.append(pos)
            slots.append(np.asarray(c.block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs)
            tables[i, : len(c.block_ids)] = c.block_ids
        attn = qwen3.AttentionInputs(
            is_prefill=True, slot_mapping=self._to_device(np.concatenate(slots), torch.int64),
            block_tables=self._to_device(tables, torch.int32),
            query_lens=[len(c.token_ids) for c in chunks],
            context_lens=[c.context_len for c in chunks])
        starts = np.cumsum([0] + attn.query_lens[:-1])
        attn.prefill_meta = self._to_device(np.stack([starts, attn.query_lens, attn.context_lens]),
                                            torch.int32)
        hidden = qwen3.forward(self.spec, self.weights, self.kv_cache, self.cos_sin,
                               self._to_device(ids, torch.int64),
                               self._to_device(np.concatenate(positions), torch.int64), attn)
        return hidden[self._to_device(np.cumsum(attn.query_lens) - 1, torch.int64)]

    # A lone chunk shorter than this per thread runs on one lane: an op split over threads
    # waits at its end for every one of them, and on a shared host one may have no core.
    MIN_TOKENS_PER_THREAD = 1024

    @torch.inference_mode()   # NOTE: thread-local: a lane thread must enter it itself
    def _forward_lane(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        return self._forward_chunks(chunks)

    def _split_into_lanes(self, chunks: list[PrefillChunk]) -> list[list[int]]:
        """Chunk indices per lane, balanced by tokens (largest first); one lane unless
        this is a CPU worker with several threads and the pass has several chunks."""
        num_lanes = min(self.num_lanes, len(chunks))
        if num_lanes < 2:
            return [list(range(len(chunks)))]
        lanes: list[list[int]] = [[] for _ in range(num_lanes)]
        loads = [0] * num_lanes
        for i in sorted(range(len(chunks)), key=lambda i: -len(chunks[i].token_ids)):
            j = loads.index(min(loads))
            lanes[j].append(i)
            loads[j] += len(chunks[i].token_ids) + chunks[i].context_len // 4
        return [sorted(lane) for lane in lanes if lane]

    def _prefill(self, chunks: list[PrefillChunk], return_logits: bool, on_kv_written=None):
        lanes = self._split_into_lanes(chunks)
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if self._lane_pool is None:
            last_hidden = self._forward_chunks(chunks)
        elif len(lanes) == 1 and num_tokens >= self.MIN_TOKENS_PER_THREAD * self.num_lanes:
            torch.set_num_threads(self.num_lanes)   # every thread on one long chunk
            try:
                last_hidden = self._forward_chunks(chunks)
            finally:
                torch.set_num_threads(1)
        elif len(lanes) == 1:
            last_hidden = self._lane_pool.submit(self._forward_lane, chunks).result()
        else:
            # NOTE: lanes write disjoint blocks of the one cache; the sampling below waits for all.
            parts = list(self._lane_pool.map(self._forward_lane, [[chunks[i] for i in lane]
                                                                  for lane in lanes]))
            order = torch.tensor([i for lane in lanes for i in lane])
            packed = torch.cat(parts)            # lane order -> chunk order
            last_hidden = torch.empty_like(packed)
            last_hidden[order] = packed
        self.num_prefill_tokens += num_tokens
        self.num_prefill_passes += 1
        self.num_prefill_chunks += len(chunks)
        if on_kv_written is not None:
            on_kv_written()
        sampled_idx = [i for i, c in enumerate(chunks) if c.params is not None]
        out: list[int | None] = [None] * len(chunks)
        if not sampled_idx:
            return out, None
        logits = qwen3.compute_logits(self.weights, last_hidden[sampled_idx])
        ps = [chunks[i].params for i in sampled_idx]
        tokens = sample(logits,
                        self._to_device([p.temperature for p in ps], torch.float32),
                        self._to_device([p.top_p for p in ps], torch.float32),
                        self._to_device([p.top_k for p in ps], torch.int32),
                        self._to_device([p.seed for p in ps], torch.int64),
                        self._to_device([chunks[i].context_len + len(chunks[i].token_ids)
                                         for i in sampled_idx], torch.int64)).tolist()
        for i, t in zip(sampled_idx, tokens):
            out[i] = t
        return out, (logits if return_logits else None)

    # ---- preemption: a sequence's KV leaves the cache and comes back ----------

    @torch.inference_mode()
    def swap_out(self, key: str, block_ids: list[int]) -> None:
        """Copy the blocks to host memory (pinned on CUDA), held under key until
        swap_in or drop_swapped. Returns once the copy is done.
        NOTE: blocking on purpose: the caller frees the blocks at once, and a prefill
        node may write into them through the KV transfer right after."""
        idx = self._to_device(block_ids, torch.int64)
        s = self.kv_cache.shape
        host = torch.empty((s[0], s[1], len(block_ids), *s[3:]), dtype=self.dtype,
                           pin_memory=self.device.type == "cuda")
        host.copy_(self.kv_cache.index_select(2, idx))
        self._swapped[key] = host
        self.num_swap_bytes += host.numel() * host.element_size()
        self.swapped_bytes += host.numel() * host.element_size()

    @torch.inference_mode()
    def swap_in(self, key: str, block_ids: list[int]) -> None:
        """The swapped blocks of key back into the cache at block_ids (as many as were
        swapped out); the copy is queued ahead of the next step."""
        host = self._swapped.pop(key)
        idx = self._to_device(block_ids[: host.shape[2]], torch.int64)
        # NOTE: a pinned source is copied without waiting; the caching host allocator
        # keeps its memory from reuse until the copy is done.
        self.kv_cache.index_copy_(2, idx, self._to_device(host, self.dtype))
        self.num_swap_bytes += host.numel() * host.element_size()
        self.swapped_bytes -= host.numel() * host.element_size()

    def drop_swapped(self, key: str) -> None:
        host = self._swapped.pop(key, None)
        if host is not None:
            self.swapped_bytes -= host.numel() * host.element_size()

    def block_bytes(self) -> int:
        """One block of the cache across every layer, K and V."""
        return self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def recompute(self, token_ids: list[int], block_ids: list[int], chunk_len: int = 2048) -> None:
        """Write the KV of token_ids (positions 0..) into block_ids by prefilling them
        again, in chunks of chunk_len tokens; nothing is sampled."""
        for start in range(0, len(token_ids), chunk_len):
            chunk = token_ids[start:start + chunk_len]
            end = start + len(chunk)
            self._prefill([PrefillChunk(chunk, start, block_ids[:num_blocks_for(end, self.block_size)])],
                          False)

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of the blocks: [L, 2, n, block_size, Hk, D] (tests and tools)."""
        idx = torch.tensor(block_ids, dtype=torch.int64).to(self.device)
        return self.kv_cache.index_select(2, idx).to("cpu")

    # ---- decode: device-resident step state ---------------------------------

    def _allocate_decode_state(self) -> None:
        n, dev = self.cfg.max_batch_size, self.device
        self._input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._step_inc = torch.zeros(n, dtype=torch.int32, device=dev)
        self._block_tables = torch.full((n, self.max_blocks_per_seq), NULL_BLOCK,
                                        dtype=torch.int32, device=dev)
        self._slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self._temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self._top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self._top_k = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self._seeds = torch.zeros(n, dtype=torch.int64, device=dev)
        self._sampled = torch.zeros(n, dtype=torch.int64, device=dev)
        # Two host slots: a step may be collected while the next one is in flight.
        self._sampled_host = torch.zeros(2, n, dtype=torch.int64,
                                         pin_memory=self.device.type == "cuda")
        # Host mirrors, advanced without reading the device back.
        self.host_seq_lens = np.ones(n, dtype=np.int32)
        self._host_seq_lens_t = torch.from_numpy(self.host_seq_lens)   # the same memory
        self._host_num_blocks = np.zeros(n, dtype=np.int32)
        self._host_is_greedy = np.ones(n, dtype=bool)
        self._slots: dict[str, int] = {}
        self._keys: list[str] = []
        # Block-table entries waiting for the next launch; staged in two pinned slots
        # because one may still be read by the device while the other is filled.
        self._pending_blocks: list[tuple[int, int, int]] = []
        self._block_staging = torch.zeros(2, 3, n, dtype=torch.int32,
                                          pin_memory=self.device.type == "cuda")
        self._block_updates = torch.zeros(3, n, dtype=torch.int32, device=dev)

    @property
    def num_decode_seqs(self) -> int:
        return len(self._keys)

    def decode_keys(self) -> list[str]:
        """Live sequences in row order: decode_step()'s output order."""
        return list(self._keys)

    def _decode_row_buffers(self) -> tuple[torch.Tensor, ...]:
        return (self._input_ids, self._seq_lens, self._step_inc, self._block_tables,
                self._temperature, self._top_p, self._top_k, self._seeds)

    @torch.inference_mode()
    def add_decode_seq(self, key: str, token_id: int, num_cached: int, block_ids: list[int],
                       params: SamplingParams) -> None:
        """A sequence joins the batch: num_cached tokens are in the cache at
        block_ids, and token_id (at position num_cached) is its next input."""
        if key in self._slots:
            raise ValueError(f"sequence {key!r} is already decoding")
        row = self.num_decode_seqs
        if row >= self.cfg.max_batch_size:
            raise RuntimeError(f"decode batch is full ({self.cfg.max_batch_size} rows)")
        if len(block_ids) < num_blocks_for(num_cached + 1, self.block_size):
            raise ValueError(f"{num_cached + 1} tokens need more than {len(block_ids)} blocks")
        if len(block_ids) > self.max_blocks_per_seq:
            raise ValueError(f"{len(block_ids)} blocks exceed max_model_len {self.max_model_len}")
        self._h2d(self._input_ids[row], token_id)
        self._h2d(self._seq_lens[row], num_cached + 1)
        self._h2d(self._step_inc[row], 1)
        self._h2d(self._block_tables[row, : len(block_ids)], block_ids)
        self._h2d(self._temperature[row], params.temperature)
        self._h2d(self._top_p[row], params.top_p)
        self._h2d(self._top_k[row], params.top_k)
        self._h2d(self._seeds[row], params.seed)
        self.host_seq_lens[row] = num_cached + 1
        self._host_num_blocks[row] = len(block_ids)
        self._host_is_greedy[row] = params.is_greedy
        self._slots[key] = row
        self._keys.append(key)

    @torch.inference_mode()
    def remove_decode_seq(self, key: str) -> None:
        self._flush_block_writes(False)  # pending entries name rows that are about to move
        row = self._slots.pop(key)
        last = self.num_decode_seqs - 1
        if row != last:
            moved = self._keys[last]
            for buf in self._decode_row_buffers():
                buf[row].copy_(buf[last])
            for mirror in (self.host_seq_lens, self._host_num_blocks, self._host_is_greedy):
                mirror[row] = mirror[last]
            self._keys[row] = moved
            self._slots[moved] = row
        self._keys.pop()
        self._reset_row(last)

    def _reset_row(self, row: int) -> None:
        """Padding values: input 0, one token at the null block, never advancing."""
        self._input_ids[row].fill_(0)
        self._seq_lens[row].fill_(1)
        self._step_inc[row].fill_(0)
        self._block_tables[row].fill_(NULL_BLOCK)
        self._temperature[row].fill_(0.0)
        self.host_seq_lens[row] = 1
        self._host_num_blocks[row] = 0
        self._host_is_greedy[row] = True

    def keys_needing_block(self) -> list[str]:
        """Live sequences whose next token falls past their last block (from the host mirrors)."""
        n = self.num_decode_seqs
        rows = np.flatnonzero(self.host_seq_lens[:n] > self._host_num_blocks[:n] * self.block_size)
        return [self._keys[r] for r in rows]

    def next_position(self, key: str) -> int:
        """The position the sequence's next step writes."""
        return int(self.host_seq_lens[self._slots[key]]) - 1

    def num_blocks(self, key: str) -> int:
        return int(self._host_num_blocks[self._slots[key]])

    def append_block(self, key: str, block_id: int) -> None:
        """The sequence crosses into a new block: one block-table entry, written
        with the next launch."""
        row = self._slots[key]
        col = int(self._host_num_blocks[row])
        self._pending_blocks.append((row, col, block_id))
        self.num_block_writes += 1
        self._host_num_blocks[row] = col + 1

    def _flush_block_writes(self, is_queued_behind_step: bool) -> None:
        """All block-table entries since the last flush in one copy: (row, col, block)
        triples, scattered on the device. Queued behind a running step (at launch),
        they go from a pinned slot without waiting; a launch reuses a slot only after
        the step two launches back was collected, so that copy is done. Otherwise
        (between steps) the copy is a plain blocking one."""
        if not self._pending_blocks:
            return
        k = len(self._pending_blocks)
        triples = torch.tensor(self._pending_blocks, dtype=torch.int32).T
        if is_queued_behind_step:
            staged = self._block_staging[self.num_decode_steps % 2, :, :k]
            staged.copy_(triples)
            triples = staged
        dev = self._block_updates[:, :k]
        self._h2d(dev, triples)
        self.num_block_copies += 1
        self._block_tables.index_put_((dev[0].long(), dev[1].long()), dev[2])
        self._pending_blocks.clear()

    def decode_step(self) -> list[int]:
        """One token for every live sequence, in decode_keys() order."""
        ticket = self.launch_decode()
        return self.collect_decode(ticket) if ticket else []

    @torch.inference_mode()
    def launch_decode(self) -> DecodeTicket | None:
        """Queue one step on the device and the copy of its samples to the host;
        return without waiting. The next step may be launched before this one is
        collected: its inputs are already on the device. The batch must not change
        while a step is in flight."""
        n = self.num_decode_seqs
        if n == 0:
            return None
        short = self.keys_needing_block()
        if short:
            raise RuntimeError(f"sequences {short} need a block for their next position; "
                               f"call append_block first")
        self._flush_block_writes(True)
        is_greedy = bool(self._host_is_greedy[:n].all())
        ticket = DecodeTicket(self._keys[:n], self.num_decode_steps % 2)
        if self.device.type == "cuda":
            ticket.start, ticket.end, ticket.copied = (torch.cuda.Event(enable_timing=True),
                                                       torch.cuda.Event(enable_timing=True),
                                                       torch.cuda.Event())
            ticket.start.record()
        if self._graphs:
            bucket = next(b for b in self._graph_buckets if b >= n)
            self._graphs[(bucket, is_greedy)].replay()
        else:
            width = num_blocks_for(int(self.host_seq_lens[:n].max()), self.block_size)
            self._run_decode(n, width, is_greedy)
        if ticket.end is not None:
            ticket.end.record()
        self._sampled_host[ticket.slot, :n].copy_(self._sampled[:n], non_blocking=True)
        if ticket.copied is not None:
            ticket.copied.record()
        self.host_seq_lens[:n] += 1
        self.num_decode_steps += 1
        self.num_decode_rows += n
        self.max_decode_batch = max(self.max_decode_batch, n)
        return ticket

    def collect_decode(self, ticket: DecodeTicket, while_waiting=None) -> list[int]:
        """Wait for a launched step; its tokens, in the ticket's key order.
        while_waiting(), if given, is called repeatedly until the step is done
        (CUDA): host work that must not wait a whole step."""
        if self.device.type not in ("cpu", "cuda"):
            getattr(torch, self.device.type).synchronize(self.device)  # npu: no events used
        if ticket.copied is not None:
            if while_waiting is not None:
                while not ticket.copied.query():
                    while_waiting()
            ticket.copied.synchronize()
            self.device_busy_s += ticket.start.elapsed_time(ticket.end) / 1e3
            if self._last_end is not None:
                self.device_idle_s += max(self._last_end.elapsed_time(ticket.start), 0.0) / 1e3
            self._last_end = ticket.end
        return self._sampled_host[ticket.slot, : len(ticket.keys)].tolist()

    def mark_idle(self) -> None:
        """The node has nothing to run: the gap before the next step is not device idleness."""
        self._last_end = None

    def _warm_up(self) -> None:
        """Compile the device kernels now, not inside the first request: a node that
        stalls for seconds on it would look dead to the frontend. Writes go to the
        null block; the counters start from zero afterwards."""
        if self.device.type == "cpu":
            return
        bs = self.block_size
        self._prefill([PrefillChunk([0], 0, [NULL_BLOCK], SamplingParams()),
                       PrefillChunk([0] * (bs + 1), 0, [NULL_BLOCK] * 2, SamplingParams())], False)
        self.num_h2d_writes = self.num_h2d_bytes = 0

    # Batch sizes with a captured graph; a batch runs in the smallest bucket that holds it.
    GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

    def _capture_graphs(self) -> None:
        """One CUDA graph per (batch bucket, greedy or sampling) over the persistent
        buffers; rows past the live ones are padding rows writing to the null block."""
        self._last_end = None
        if self.device.type != "cuda":
            return
        from kernels import portable
        if not self.cfg.use_graphs or read_env().disable_graphs or \
                kernels.backend_for(self.kv_cache).decode_attention is portable.decode_attention:
            return  # portable attention reads the full table width: graphs would not pay
        max_b = self.cfg.max_batch_size
        self._graph_buckets = sorted({b for b in self.GRAPH_BUCKETS if b < max_b} | {max_b})
        width = self.max_blocks_per_seq
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():  # compile kernels, size workspaces
            for b in self._graph_buckets:
                for is_greedy in (True, False):
                    self._run_decode(b, width, is_greedy)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        with torch.inference_mode():
            for b in reversed(self._graph_buckets):
                for is_greedy in (True, False):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._run_decode(b, width, is_greedy)
                    pool = graph.pool()
                    self._graphs[(b, is_greedy)] = graph
            self._input_ids.zero_()  # the warm-up steps sampled into the padding rows
        torch.cuda.synchronize(self.device)

    def _run_decode(self, n: int, width: int, is_greedy: bool) -> None:
        """The device part of a step over rows [0, n) with block tables [n, width]."""
        seq_lens = self._seq_lens[:n]
        slot_mapping = self._slot_mapping[:n]
        block_tables = self._block_tables[:n, :width]
        kernels.compute_slot_mapping(seq_lens, block_tables, self.block_size, slot_mapping)
        # The host mirror rides along for kernels that take lengths on the host (Ascend);
        # a captured CUDA graph never reads it.
        host_lens = None if self._graphs else self._host_seq_lens_t[:n]
        attn = qwen3.AttentionInputs(is_prefill=False, slot_mapping=slot_mapping,
                                     block_tables=block_tables, seq_lens=seq_lens,
                                     host_seq_lens=host_lens)
        hidden = qwen3.forward(self.spec, self.weights, self.kv_cache, self.cos_sin,
                               self._input_ids[:n], torch.sub(seq_lens, 1, out=self._positions[:n]),
                               attn)
        logits = qwen3.compute_logits(self.weights, hidden)
        if is_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = sample(logits, self._temperature[:n], self._top_p[:n], self._top_k[:n],
                             self._seeds[:n], seq_lens.long())
        self._sampled[:n].copy_(sampled)
        kernels.advance_step(self._input_ids[:n], sampled, seq_lens, self._step_inc[:n])

