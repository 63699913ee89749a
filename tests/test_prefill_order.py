"""The order of a prefill pass (prefill_node/scheduler.py): short prompts go ahead of long
ones waiting and of long prompts part-way through, and a pass that holds one keeps the long
prompts' share small, so a short prompt's first token waits for no long prefill queued."""
import pytest

from common.base.request import SamplingParams
from common.kv.prefix import PrefixCache
from prefill_node.scheduler import SHORT_PASS_LONG_TOKENS, SHORT_PROMPT_LEN, PrefillJob, PrefillScheduler

pytestmark = pytest.mark.unit
BS = 16


def job(rid: str, n: int, is_reserved: bool = True) -> PrefillJob:
    j = PrefillJob(rid, [hash(rid) % 1000 + 1 + i % 7 for i in range(n)], SamplingParams(), 0.0, "d", "e")
    j.is_reserved = is_reserved
    return j


def scheduler(token_budget=4096, num_blocks=1025, max_batch_prompts=64):
    return PrefillScheduler(PrefixCache(num_blocks), BS, token_budget, max_batch_prompts)


def passes(s: PrefillScheduler):
    while s.waiting or s.prefilling:
        chunks = s.schedule()
        assert chunks, "a pass with nothing in it"
        yield [(c.job.request_id, c.start, c.end) for c in chunks]
        s.complete(chunks)


def test_a_short_prompt_goes_ahead_of_long_ones_waiting():
    s = scheduler()
    for j in [job("long0", 2048), job("long1", 2048), job("long2", 2048), job("short", 32)]:
        s.add(j)
    first = next(passes(s))
    # FIFO would have put two long prompts' 4,096 tokens in this pass and the short one in
    # the one after; now the short one is first and the long ones get a small share.
    assert first[0] == ("short", 0, 32)
    assert first[1:] == [("long0", 0, SHORT_PASS_LONG_TOKENS)]


def test_a_short_prompt_goes_ahead_of_a_long_one_part_way_through():
    s = scheduler(token_budget=1024)
    s.add(job("long", 4096))
    order = passes(s)
    assert next(order) == [("long", 0, 1024)]
    s.add(job("short", SHORT_PROMPT_LEN))
    assert next(order) == [("short", 0, SHORT_PROMPT_LEN), ("long", 1024, 1024 + SHORT_PASS_LONG_TOKENS)]
    rest = list(order)   # once no short prompt waits, the long one gets whole passes again
    assert rest == [[("long", 1536, 2560)], [("long", 2560, 3584)], [("long", 3584, 4096)]]


def test_long_prompts_keep_their_order_and_none_is_left_behind():
    s = scheduler(token_budget=2048)
    for i in range(3):
        s.add(job(f"long{i}", 1000 + i))
    s.add(job("short0", 100))
    s.add(job("longer", SHORT_PROMPT_LEN + 1))   # one token past short: waits its turn
    s.add(job("short1", 10))
    seen = list(passes(s))
    assert seen[0][:2] == [("short0", 0, 100), ("short1", 0, 10)]
    starts = [rid for p in seen for rid, start, _ in p if start == 0]
    assert starts == ["short0", "short1", "long0", "long1", "long2", "longer"]
    ends = {rid: end for p in seen for rid, _, end in p}
    assert ends == {"short0": 100, "short1": 10, "long0": 1000, "long1": 1001, "long2": 1002,
                    "longer": SHORT_PROMPT_LEN + 1}


def test_a_short_prompt_not_reserved_waits_like_any_other():
    s = scheduler()
    s.add(job("long", 2048))
    s.add(job("short", 32, is_reserved=False))
    assert s.schedule()[0].job.request_id == "long"   # no reservation, no early grant: passed
    assert [j.request_id for j in s.waiting] == ["short"]


def test_a_full_pool_holds_short_prompts_back_too():
    s = scheduler(num_blocks=5)   # 4 usable blocks of 16 tokens
    s.add(job("a", 64))
    s.add(job("short", 32))
    chunks = s.schedule()
    assert [c.job.request_id for c in chunks] == ["a"]   # "a" took every block
    assert [j.request_id for j in s.waiting] == ["short"]
