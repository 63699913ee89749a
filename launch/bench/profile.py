"""Where a worker's time goes: torch.profiler over one prefill batch and some
decode steps, in this process, printing the top device kernels of each.

    python -m launch.bench.profile --shape qwen3-0.6b --device cuda:0 --batch 8 --prompt-len 1024
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from common.base.config import WorkerConfig, parse_bytes
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.runtime.process import HelpFormat
from launch.bench.common import fit_len, resolve


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="pdserve bench profile", description=__doc__, formatter_class=HelpFormat
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shape", default=None, help="a preset shape (default: qwen3-0.6b)")
    g.add_argument("--model", default=None, help="a Hugging Face Qwen3 directory")
    p.add_argument(
        "--device",
        default="cuda:0" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda:N or npu:N",
    )
    p.add_argument("--batch", type=int, default=8, help="prompts in the prefill and rows in decode")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="default: 1024, or what the model's length allows",
    )
    p.add_argument("--decode-steps", type=int, default=20, help="decode steps profiled")
    p.add_argument(
        "--kv-cache-memory", default=None, help="default: 8GiB on accelerators, 1GiB on cpu"
    )
    p.add_argument("--top", type=int, default=15, help="kernels listed")
    p.add_argument(
        "--dtype", default=None, help="default: bfloat16 on accelerators, float32 on cpu"
    )
    a = p.parse_args(argv)
    if a.model is None and a.shape is None:
        a.shape = "qwen3-0.6b"
    spec, _ = resolve(a)
    a.prompt_len = fit_len(
        a.prompt_len, 1024, spec.max_position_embeddings - a.decode_steps - 16, "--prompt-len"
    )
    memory = a.kv_cache_memory or ("1GiB" if a.device == "cpu" else "8GiB")
    cfg = WorkerConfig(
        model=a.model,
        shape=a.shape,
        device=a.device,
        max_batch_size=a.batch,
        max_model_len=a.prompt_len + a.decode_steps + 16,
        kv_cache_memory=parse_bytes(memory),
        **({"dtype": a.dtype} if a.dtype else {}),
    )
    # On CPU the profile is of host time; elsewhere of device kernels.
    is_cpu = a.device == "cpu"
    activities = [ProfilerActivity.CPU if is_cpu else ProfilerActivity.CUDA]
    sort_by = "cpu_time_total" if is_cpu else "cuda_time_total"
    with DeviceWorker(cfg) as w:
        alloc = BlockAllocator(w.num_kv_blocks)
        params = SamplingParams(max_tokens=a.decode_steps + 2, ignore_eos=True)
        blocks = [
            alloc.allocate(num_blocks_for(a.prompt_len + a.decode_steps + 1, w.block_size))
            for _ in range(a.batch)
        ]
        ids = torch.randint(0, w.spec.vocab_size, (a.batch, a.prompt_len)).tolist()
        chunks = [PrefillChunk(ids[i], 0, blocks[i], params) for i in range(a.batch)]
        w.prefill(chunks)  # warm-up
        with profile(activities=activities) as prof:
            firsts, _ = w.prefill(chunks)
        print(f"== prefill {a.batch} x {a.prompt_len}")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=a.top))
        for i, (b, t) in enumerate(zip(blocks, firsts)):
            w.decode.add(str(i), t, a.prompt_len, b, params)
        w.decode.step()
        with profile(activities=activities) as prof:
            for _ in range(a.decode_steps):
                w.decode.step()
        is_graphed = bool(w.stats()["is_graphed"])
        print(f"== decode batch {a.batch}, {a.decode_steps} steps (graphed: {is_graphed})")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=a.top))


if __name__ == "__main__":
    main()
