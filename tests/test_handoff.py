"""The KV blocks a decode worker holds for a request equal the prefill worker's,
after travelling through the wire encoding, and decoding goes on from them exactly."""
import torch

from common import protocol
from common.config import WorkerConfig
from common.kv_cache import BlockAllocator, num_blocks_for
from common.sampling import SamplingParams
from common.sequence import blocks_to_join
from common.worker import DeviceWorker, PrefillChunk
from decode_node.scheduler import DecodeScheduler
from launch.generate import generate


def test_decode_blocks_equal_prefill_blocks(tiny_model):
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    cfg = WorkerConfig(model=str(tiny_model), block_size=16, kv_cache_memory=2 * 2**20)
    with DeviceWorker(cfg) as pw, DeviceWorker(cfg) as dw:
        palloc = BlockAllocator(pw.num_kv_blocks)
        palloc.allocate(5)  # so the two nodes' block ids differ
        src = palloc.allocate(num_blocks_for(len(prompt), 16))
        (first,), _ = pw.prefill([PrefillChunk(prompt, 0, src, params)])
        msg = protocol.KVHandoff("r", len(prompt), first, params, {}, pw.export_blocks(src))
        received = protocol.decode([bytes(f) for f in protocol.encode(msg)])

        dalloc = BlockAllocator(dw.num_kv_blocks)
        sched = DecodeScheduler(dalloc, 16, 4, 4)
        sched.enqueue(received)
        seq = sched.start(sched.next_admissible())
        dw.import_blocks(seq.block_ids, received.kv)
        assert seq.block_ids != src
        assert torch.equal(dw.kv_cache[:, :, seq.block_ids], pw.kv_cache[:, :, src])
        assert dalloc.num_reserved == seq.num_reserved  # the rest of its blocks are promised

        blocks_to_join(seq, 16, dalloc)
        dw.add_decode_seq("r", first, len(prompt), seq.block_ids, params)
        tokens = [first]
        for _ in range(params.max_tokens - 1):
            if dw.next_position("r") // 16 >= dw.num_blocks("r"):
                dw.append_block("r", seq.take_reserved_block(dalloc))
            tokens += dw.decode_step()
        assert tokens == generate(pw, [prompt], [params])[0]["token_ids"]
        sched.finish("r")
        assert dalloc.num_free == dalloc.capacity and dalloc.num_reserved == 0
