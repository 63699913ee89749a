"""Offline generation in one process, through the same worker code the nodes use.

python -m launch.generate --model DIR --prompt TEXT [--prompt TEXT ...] --max-tokens N
"""

from __future__ import annotations

import argparse
import json

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker
from common.runtime.process import HelpFormat
from launch.tools.offline import generate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        ignore_eos=a.ignore_eos,
    )
    cfg = WorkerConfig(model=a.model, device=a.device, dtype=a.dtype, max_batch_size=len(a.prompt))
    try:
        with DeviceWorker(cfg) as worker:
            prompts = [tokenizer.encode(text) for text in a.prompt]
            results = generate(worker, prompts, [params] * len(prompts))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    for text, r in zip(a.prompt, results):
        r["text"] = tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        if a.json:
            print(json.dumps(r))
        else:
            print(
                f"prompt: {text!r}\ntext:   {r['text']!r}\ntoken_ids: {r['token_ids']}\n"
                f"finish: {r['finish_reason']}  ttft: {r['ttft_ms']:.1f} ms  "
                f"decode: {r['decode_ms_per_step']:.2f} ms/step\n"
            )


if __name__ == "__main__":
    main()
