"""The device worker: the one owner of a node's device state.

prepare() loads the weights, allocates the KV cache as one tensor and every
persistent buffer, once; prefill() and the decode steps then run any number of
times; close() releases all of it. The worker is the model and its prefill
passes (their first tokens: first_tokens.py); the decode batch's step state (decode.py),
the captured graphs (graphs.py) and the swap space (swap.py) are its parts, and every device call
that differs by device type goes through its platform (platform.py).
"""

from __future__ import annotations

import atexit
import functools
import time

import numpy as np
import torch

import kernels
from common.base.config import WorkerConfig, clamp_model_len, parse_core_pool
from common.base.request import SamplingParams
from common.engine import first_tokens, qwen3
from common.engine import logits as logit_rules
from common.engine.cores import CorePool
from common.engine.decode import DecodeBatch
from common.engine.graphs import wants_graphs
from common.engine.h2d import HostToDevice
from common.engine.kv_cache import allocate_kv_cache
from common.engine.lanes import Lanes, run_on_own_thread
from common.engine.pass_size import pair_cost, threads_worth
from common.engine.platform import platform_for
from common.engine.prefill_job import PrefillChunk
from common.engine.swap import SwapSpace
from common.kv.blocks import (
    BLOCK_DIM,
    NULL_BLOCK,
    block_bytes,
    num_blocks_for,
)


class DeviceWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.platform = platform_for(cfg.device)
        self.device = self.platform.device
        self.dtype = cfg.torch_dtype if cfg.torch_dtype is not None else self.platform.default_dtype
        self.block_size = cfg.block_size
        self.is_prepared = False
        self.h2d = HostToDevice(self.device)
        self.swap: SwapSpace | None = None  # preempted sequences' KV, in host memory
        self.decode: DecodeBatch | None = None
        self.num_prefill_tokens = 0
        self.num_prefill_passes = 0
        self.num_prefill_chunks = 0  # summed over passes: / num_prefill_passes is the mean batch
        self.prefill_busy_s = 0.0
        # CPU prefill: a pass's chunks split over threads (lanes.py)
        self.lanes: Lanes | None = None
        self.cores: CorePool | None = None  # CPU: the host's cores, shared with its other nodes

    # ---- life cycle -------------------------------------------------------

    def prepare(self) -> "DeviceWorker":
        if self.is_prepared:
            return self
        cap = self.num_threads = torch.get_num_threads()  # what this node may use, all told
        if self.platform.is_host:
            # NOTE: an OpenMP pool lives as long as its thread: the load's, beside each pass's
            # (lanes.py), had libgomp sleep idle threads at once (more pooled than CPUs), each
            # op waiting for a wake-up (0.6B bf16, 128 tokens, 2 cores: 187-206 -> 154-157 ms)
            run_on_own_thread(functools.partial(self._load, cap), "load")
        else:
            self._load(cap)
        cfg, s = self.cfg, self.spec
        # On the host a step runs in its launch: nothing overlaps it.
        self.is_step_queued = not self.platform.is_host
        self._loop_threads = cap  # the calling thread's, given back at close
        # cores a step of n rows is worth: asked of a core table, or taken up to the cap
        self.decode.runner.threads_worth = functools.partial(threads_worth, s, self.dtype, 0)
        if cfg.core_pool and self.platform.is_host:
            name, budget, share = parse_core_pool(cfg.core_pool)
            self.cores = CorePool(name, budget, min(share, cap), cap, torch.set_num_threads)
            self.decode.runner.cores = self.cores
        if self.platform.is_host and cap > 1:
            # NOTE: a lane runs whole forwards on one torch thread: no barrier per op waits
            # for a core another process holds, and a busy host just time-slices the lanes.
            self.lanes = Lanes(
                cap,
                self._forward_chunks,
                pair_cost(s),
                lambda num_tokens: threads_worth(self.spec, self.dtype, num_tokens, 1),
            )
            torch.set_num_threads(1)  # the loop's own ops are small: no pool to wait on
            # NOTE: without a core table a step takes the threads it is worth (a tiny
            # model's step, one: an op split over threads waits at its end for all of them)
            self.decode.runner.num_threads = cap
        self._warm_up()
        if wants_graphs(self.platform, self.cfg.use_graphs, self.kv_cache):
            self.decode.capture_graphs()
        self.is_prepared = True
        atexit.register(self.close)
        return self

    def _load(self, num_threads: int) -> None:
        """The weights, the KV cache and the step state, on num_threads torch threads."""
        torch.set_num_threads(num_threads)  # NOTE: per thread; a new one takes the last set
        from common.engine.loader import load_model  # NOTE: safetensors: where needed

        cfg = self.cfg
        self.platform.activate()
        self.spec, self.weights = load_model(cfg, self.platform, self.dtype)
        s = self.spec
        self.max_model_len = clamp_model_len(cfg.max_model_len, s.max_position_embeddings)
        self.cos_sin = kernels.rotary_cos_sin(
            self.max_model_len, s.head_dim, s.rope_theta, self.device
        )
        self.kv_cache = allocate_kv_cache(self.platform, s, cfg, self.dtype)
        self.num_kv_blocks = self.kv_cache.shape[BLOCK_DIM]
        self.model = qwen3.Model(s, self.weights, self.cos_sin, self.kv_cache)
        self.swap = SwapSpace(self.kv_cache, self.h2d, self.platform.is_pinned)
        self.decode = DecodeBatch(
            self.model,
            self.block_size,
            cfg.max_batch_size,
            self.max_blocks_per_seq,
            self.platform,
            self.h2d,
            self.spec.eos_token_ids,
            cfg.speculative,
        )

    def close(self) -> None:
        if not self.is_prepared:
            return
        self.is_prepared = False
        atexit.unregister(self.close)
        if self.decode is not None:
            self.decode.graphs.clear()
        for name in ("weights", "kv_cache", "cos_sin", "model"):
            self.__dict__.pop(name, None)
        self.decode = None
        self.swap.clear()
        self.swap = None  # NOTE: it holds the cache
        if self.lanes is not None:
            self.lanes.close()
            self.lanes = None
        if self.cores is not None:
            self.cores.close()
            self.cores = None
        if self.platform.is_host:
            # NOTE: set to one for the loop's own ops: a worker made after this one in the
            # same process would otherwise take one thread for all its work
            torch.set_num_threads(self._loop_threads)
        self.platform.release()
        self.platform.release_memory()

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

    @property
    def kv_shm_name(self) -> str | None:
        """The shared-memory segment other processes on this host map (a CPU cache
        allocated with is_cache_in_shm), else None."""
        return (
            self.platform.share(self.kv_cache)
            if self.cfg.is_cache_in_shm and self.platform.is_host
            else None
        )

    def block_bytes(self) -> int:
        return block_bytes(self.kv_cache)

    def describe_kernels(self) -> str:
        """The device's kernels and the path each takes here, for a node's ready line."""
        return kernels.describe(self.device.type)

    def stats(self) -> dict:
        """The worker's figures and its parts' (host-to-device writes, decode steps, swap)."""
        return {
            **self.h2d.stats(),
            **self.decode.stats(),
            **self.swap.stats(),
            "prefill_busy_s": round(self.prefill_busy_s, 6),
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_prefill_passes": self.num_prefill_passes,
            "num_prefill_chunks": self.num_prefill_chunks,
            "num_kv_blocks": self.num_kv_blocks,
            "token_capacity": self.token_capacity,
            # threads computing on the host's cores (common/base/placement.py)
            "num_host_threads": self.num_threads if self.platform.is_host else 0,
            **(self.cores.stats() if self.cores is not None else {}),
        }

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return self.h2d.tensor(values, dtype)

    # ---- prefill -----------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        chunks: list[PrefillChunk],
        return_logits: bool = False,
        on_kv_queued=None,
        on_layers=None,
    ) -> tuple[list[int | None], torch.Tensor | None]:
        """Run prompt chunks as one batch; write their KV; sample the first token of
        every chunk that carries params. Returns (token or None per chunk, and the
        fp32 logits [num_sampled, V] of the sampled chunks when asked).
        on_kv_queued(), if given, is called once every layer's KV write is queued
        on the device, before the sampling waits for it: work queued there (a KV
        transfer) starts right behind the forward pass. on_layers(chunk indices, n), if
        given, is called on this thread during the pass, once the KV of those chunks' first
        n layers is queued (each layer's as its attention starts, the last layer's too)."""
        t0 = time.perf_counter()
        try:
            out, logits = self._prefill(chunks, return_logits, on_kv_queued, on_layers)
        finally:
            if self.cores is not None:
                self.cores.end()
        self.prefill_busy_s += time.perf_counter() - t0  # _prefill ends in a device sync
        return out, logits

    def _forward_pass(
        self, chunks: list[PrefillChunk], num_tokens: int, on_layers=None
    ) -> torch.Tensor:
        """The pass on this host's cores, shared with its other nodes where a pool is set.
        on_layers(chunk indices, n): as in prefill(), on this thread."""
        if self.lanes is not None:
            if self.cores is None:
                return self.lanes.forward(chunks, None, on_layers)
            want = threads_worth(self.spec, self.dtype, num_tokens, len(chunks))
            is_chunk_heavy = (
                threads_worth(self.spec, self.dtype, max(len(c.token_ids) for c in chunks), 1) > 1
            )
            return self.lanes.forward_shared(chunks, self.cores, want, is_chunk_heavy, on_layers)
        if self.cores is not None:
            self.cores.begin(1, num_tokens=num_tokens, num_seqs=len(chunks))
        every = list(range(len(chunks)))
        return self._forward_chunks(
            chunks, kv_written=on_layers and (lambda n: on_layers(every, n))
        )

    def _forward_chunks(
        self, chunks: list[PrefillChunk], between_layers=None, kv_written=None
    ) -> torch.Tensor:
        """One forward over the chunks, packed; their KV into the cache. -> the hidden
        state of each chunk's last token [len(chunks), H]; chunks that asked for prompt
        logprobs get them here, from every position's hidden state."""
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
            is_prefill=True,
            slot_mapping=self._to_device(np.concatenate(slots), torch.int64),
            block_tables=self._to_device(tables, torch.int32),
            query_lens=[len(c.token_ids) for c in chunks],
            context_lens=[c.context_len for c in chunks],
        )
        starts = np.cumsum([0] + attn.query_lens[:-1])
        attn.prefill_meta = self._to_device(
            np.stack([starts, attn.query_lens, attn.context_lens]), torch.int32
        )
        hidden = qwen3.forward(
            self.spec,
            self.weights,
            self.kv_cache,
            self.cos_sin,
            self._to_device(ids, torch.int64),
            self._to_device(np.concatenate(positions), torch.int64),
            attn,
            between_layers,
            kv_written,
        )
        for c, start in zip(chunks, starts):
            if c.prompt_targets is not None:
                c.prompt_logprobs = logit_rules.prompt_logprobs(
                    lambda h: qwen3.compute_logits(self.weights, h),
                    hidden[start : start + len(c.token_ids)],
                    c.prompt_targets,
                    c.num_prompt_logprobs,
                    self._to_device,
                )
        return hidden[self._to_device(np.cumsum(attn.query_lens) - 1, torch.int64)]

    def _prefill(
        self, chunks: list[PrefillChunk], return_logits: bool, on_kv_queued=None, on_layers=None
    ):
        num_tokens = sum(len(c.token_ids) for c in chunks)
        last_hidden = self._forward_pass(chunks, num_tokens, on_layers)
        self.num_prefill_tokens += num_tokens
        self.num_prefill_passes += 1
        self.num_prefill_chunks += len(chunks)
        if on_kv_queued is not None:
            on_kv_queued()
        sampled_idx = [i for i, c in enumerate(chunks) if c.params is not None]
        out: list[int | None] = [None] * len(chunks)
        if not sampled_idx:
            return out, None
        logits = qwen3.compute_logits(self.weights, last_hidden[sampled_idx])
        first_tokens.choose(
            logits, chunks, sampled_idx, out, self.spec.eos_token_ids, self._to_device
        )
        return out, (logits if return_logits else None)

    @torch.inference_mode()
    def copy_blocks(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Block dst_ids[k] of the cache becomes a copy of src_ids[k], in every layer
        (a fork's own copy of its prompt's partial last block)."""
        src = self._to_device(src_ids, torch.int64)
        self.kv_cache.index_copy_(
            BLOCK_DIM,
            self._to_device(dst_ids, torch.int64),
            self.kv_cache.index_select(BLOCK_DIM, src),
        )

    @torch.inference_mode()
    def recompute(self, token_ids: list[int], block_ids: list[int], chunk_len: int = 2048) -> None:
        """Write the KV of token_ids (positions 0..) into block_ids by prefilling them
        again, in chunks of chunk_len tokens; nothing is sampled."""
        for start in range(0, len(token_ids), chunk_len):
            chunk = token_ids[start : start + chunk_len]
            end = start + len(chunk)
            self._prefill(
                [PrefillChunk(chunk, start, block_ids[: num_blocks_for(end, self.block_size)])],
                False,
            )

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of the blocks: [L, 2, n, block_size, Hk, D] (tests and tools)."""
        idx = torch.tensor(block_ids, dtype=torch.int64).to(self.device)
        return self.kv_cache.index_select(2, idx).to("cpu")

    def _warm_up(self) -> None:
        """Compile the device kernels now, not inside the first request: a node that
        stalls for seconds on it would look dead to the frontend. Writes go to the
        null block; the counters start from zero afterwards."""
        if self.platform.is_host:
            return
        bs = self.block_size
        self._prefill(
            [
                PrefillChunk([0], 0, [NULL_BLOCK], SamplingParams()),
                PrefillChunk([0] * (bs + 1), 0, [NULL_BLOCK] * 2, SamplingParams()),
            ],
            False,
        )
        self.h2d.reset()
