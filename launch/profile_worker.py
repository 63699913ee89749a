"""Where a worker's time goes: torch.profiler over one prefill batch and some
decode steps, in this process, printing the top device kernels of each.

    python -m launch.profile_worker --shape qwen3-0.6b --device cuda:0 --batch 8 --prompt-len 1024
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from common.config import WorkerConfig, parse_bytes
from common.kv_cache import BlockAllocator, num_blocks_for
from common.process import HelpFormat
from common.sampling import SamplingParams
from common.worker import DeviceWorker, PrefillChunk


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--kv-cache-memory", default="8GiB")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    cfg = WorkerConfig(shape=a.shape, device=a.device, max_batch_size=a.batch,
                       max_model_len=a.prompt_len + a.decode_steps + 16,
                       kv_cache_memory=parse_bytes(a.kv_cache_memory))
    with DeviceWorker(cfg) as w:
        alloc = BlockAllocator(w.num_kv_blocks)
        params = SamplingParams(max_tokens=a.decode_steps + 2, ignore_eos=True)
        blocks = [alloc.allocate(num_blocks_for(a.prompt_len + a.decode_steps + 1, w.block_size))
                  for _ in range(a.batch)]
        ids = torch.randint(0, w.spec.vocab_size, (a.batch, a.prompt_len)).tolist()
        chunks = [PrefillChunk(ids[i], 0, blocks[i], params) for i in range(a.batch)]
        w.prefill(chunks)  # warm-up
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            firsts, _ = w.prefill(chunks)
        print(f"== prefill {a.batch} x {a.prompt_len}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top))
        for i, (b, t) in enumerate(zip(blocks, firsts)):
            w.add_decode_seq(str(i), t, a.prompt_len, b, params)
        w.decode_step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.decode_steps):
                w.decode_step()
        print(f"== decode batch {a.batch}, {a.decode_steps} steps (graphed: {bool(w.stats()['is_graphed'])})")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top))


if __name__ == "__main__":
    main()
