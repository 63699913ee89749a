"""A request's prompt turned into token ids without stalling the frontend's loop.

Every client shares the one event loop, so what a request may cost it is bounded:
text longer than any prompt the model can take is refused unread (check_size);
a prompt of more than OFF_LOOP_CHARS characters is tokenized on a thread of its
own at the lowest CPU priority, with a tokenizer of its own (its length counted
before any list of ids is made); everything else, the common case, at once.
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from common.base.log import get_logger
from common.base.model_spec import ModelSpec
from common.base.request import SamplingParams
from common.wire.protocol import GenerateRequest
from frontend.request import OFF_LOOP_CHARS, check_size, max_prompt_chars, prepare, text_len

log = get_logger("frontend")


def _lower_priority() -> None:
    """The tokenizing thread yields the CPU to every other thread and process here."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


class Prompts:
    def __init__(self, model: str, tokenizer, spec: ModelSpec, max_model_len: int):
        self.model, self.tokenizer, self.spec, self.max_model_len = model, tokenizer, spec, max_model_len
        self.max_chars = max_prompt_chars(tokenizer, max_model_len)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize", initializer=_lower_priority)
        self._own_tokenizer = None          # made on the thread: the loop's is never shared
        self.pending: dict[tuple, bool] = {}   # (client, request id) -> cancelled while tokenized
        self.num_off_loop = 0

    def is_off_loop(self, req: GenerateRequest) -> bool:
        return text_len(req) > OFF_LOOP_CHARS

    def now(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        """The common case, on the loop: ValueError says what is wrong."""
        check_size(req, self.max_chars)
        return prepare(req, self.tokenizer, self.spec, self.max_model_len)

    async def off_loop(self, key: tuple, req: GenerateRequest) -> tuple[list[int], SamplingParams] | None:
        """A long prompt, on the tokenizing thread; None if it was cancelled meanwhile."""
        check_size(req, self.max_chars)
        self.pending[key] = False
        self.num_off_loop += 1
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare_here, req)
        finally:
            is_cancelled = self.pending.pop(key, False)
        return None if is_cancelled else out

    def _prepare_here(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        if self._own_tokenizer is None:
            from transformers import AutoTokenizer
            self._own_tokenizer = AutoTokenizer.from_pretrained(self.model)
        return prepare(req, self._own_tokenizer, self.spec, self.max_model_len)

    def cancel(self, key: tuple) -> bool:
        """A request still being tokenized is dropped once it is; False if none is."""
        if key not in self.pending:
            return False
        self.pending[key] = True
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
