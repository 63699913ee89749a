"""A client's request turned into token ids and sampling parameters (or a
ValueError saying what is wrong, which the client gets as the request's error),
without stalling the frontend's loop.

Every client shares the one event loop, so what a request may cost it is bounded:
text longer than any prompt the model can take is refused unread (check_size);
a prompt of more than OFF_LOOP_CHARS characters is tokenized on a thread of its
own at the lowest CPU priority, with a tokenizer of its own (its length counted
before any list of ids is made), and so is a request with a grammar (compiled once in a
process of its own, killed at MAX_COMPILE_CPU_S of CPU and the grammar refused: nodes
compile it on their loops; frontend/grammar_check.py), clients taking turns there, each
with a bounded share of it (frontend/off_loop.py); everything else, the common case, at once.
"""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

from common.base.grammar import MAX_COMPILE_CPU_S
from common.base.log import get_logger
from common.base.model_spec import ModelSpec
from common.base.request import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    validate_prompt,
)
from common.base.threads import lower_this_thread
from common.wire.client import MAX_MESSAGES, MAX_PROMPT_IDS, MAX_STOP
from common.wire.protocol import GenerateRequest
from frontend import grammar_check
from frontend.chat_template import render, template_kwargs, tools_growth
from frontend.grammar_check import GrammarChecker, GrammarNotJudged
from frontend.off_loop import OffLoop

log = get_logger("frontend")

# NOTE: what a request costs the frontend's event loop is bounded: a prompt of more text
# than this is tokenized on a thread of its own (at low priority), and one of more text
# than any prompt the model can take (max_prompt_chars) is refused unread.
OFF_LOOP_CHARS = 64 * 2**10
MAX_STOP_CHARS = 16 * 2**10  # all stop strings of a request together
MAX_BAD_WORD_CHARS = 16 * 2**10  # all bad words together (each is tokenized twice, on the loop)
# The most items each list of a request may hold: what a ZeroMQ client's message is held to
# as it is decoded (common/wire/client.py); a request made here (HTTP) is held to it before
# any item is read (its models count them as they parse: frontend/openai_models.py).
MAX_ITEMS = {
    "prompt_token_ids": MAX_PROMPT_IDS,
    "messages": MAX_MESSAGES,
    "stop": MAX_STOP,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
    "logit_bias": MAX_LOGIT_BIAS,
    "allowed_token_ids": MAX_PROMPT_IDS,
    "bad_words": MAX_BAD_WORDS,
}


def text_len(req: GenerateRequest) -> int:
    """Characters of text the request's prompt holds as its chat template renders it (0 for
    token ids): every message whole (its content, an assistant's tool calls), the tools, and
    the template's variables (a template may print one: Llama 3's date_string, say)."""
    if req.prompt is not None:
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    return (
        sum(_json_len(m) for m in req.messages or ())
        + len(req.tools or "")
        + (_json_len(req.chat_template_kwargs) if req.chat_template_kwargs else 0)
    )


def _json_len(value) -> int:
    """The length of plain data as JSON text (what a client sent, about); past any limit
    for what is not plain data."""
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return 2**62


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """More text than this cannot fit in max_model_len tokens: no token's text is longer
    than its longest vocabulary entry (one character per byte, or longer), and the four
    covers a normalizer that composes characters."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 4 * max_model_len * max(longest, 1)


def _count_tokens(tokenizer, text: str, add_special_tokens: bool) -> int | None:
    """A long text's token count, counted without making a list of its ids (the fast
    tokenizer's encoding keeps them): None where the tokenizer cannot say."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or len(text) <= OFF_LOOP_CHARS:
        return None
    return len(_tokenized(backend.encode, text, "the text", add_special_tokens=add_special_tokens))


def _tokenized(encode, text: str, what: str, **kw):
    """encode(text, **kw); a fast tokenizer's TypeError (its word for text it cannot take,
    a lone surrogate) is the client's error."""
    try:
        return encode(text, **kw)
    except TypeError:
        raise ValueError(f"{what} cannot be tokenized (a lone surrogate?)") from None


def _check_count(n: int | None, max_model_len: int) -> None:
    if n is not None and n > max_model_len:
        raise ValueError(
            f"the prompt is {n} tokens: more than the model's maximum length {max_model_len}"
        )


def prompt_ids(tokenizer, req: GenerateRequest, max_model_len: int = 2**31) -> list[int]:
    given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
    if req.messages is None and (req.tools is not None or req.chat_template_kwargs is not None):
        raise ValueError("tools and chat_template_kwargs are the chat template's: give messages")
    if req.prompt is not None:
        _check_count(_count_tokens(tokenizer, req.prompt, True), max_model_len)
        return _tokenized(tokenizer.encode, req.prompt, "the prompt")
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    for m in req.messages:
        content = m.get("content")
        if not isinstance(m.get("role"), str) or not (
            isinstance(content, str) or (content is None and m.get("tool_calls"))
        ):
            raise ValueError(
                "each message needs a string role and string content (an assistant's "
                "tool calls may stand for it)"
            )
    kwargs = template_kwargs(req, tokenizer)
    if text_len(req) > OFF_LOOP_CHARS:
        text = render(tokenizer, req.messages, False, kwargs)
        _check_count(_count_tokens(tokenizer, text, False), max_model_len)
    ids = render(tokenizer, req.messages, True, kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # an encoding or a list


def check_size(req: GenerateRequest, max_chars: int) -> None:
    """What can be refused before any tokenizing: a list of too many items (counted before
    any is read), too much text (tools and tool calls count), too many stop or bad-word
    characters."""
    for name, limit in MAX_ITEMS.items():
        value = getattr(req, name)
        if value is not None and len(value) > limit:
            raise ValueError(f"'{name}' holds {len(value)} items: at most {limit} are taken")
    n = text_len(req)
    if n > max_chars:
        raise ValueError(
            f"the prompt is {n} characters (its messages, tool calls and tools): no "
            f"text of more than {max_chars} fits in the model's maximum length"
        )
    for name, limit in (("stop", MAX_STOP_CHARS), ("bad_words", MAX_BAD_WORD_CHARS)):
        if sum(len(s) if isinstance(s, str) else limit for s in getattr(req, name)) > limit:
            raise ValueError(f"the {name} strings hold more than {limit} characters together")


def prepare(
    req: GenerateRequest,
    tokenizer,
    spec: ModelSpec,
    max_model_len: int,
    is_processed_logprobs: bool = False,
    grammars=None,
) -> tuple[list[int], SamplingParams]:
    """max_tokens None (HTTP chat) means what the model length leaves; 0 (with
    prompt_logprobs) the prompt alone: one token is made and not shown."""
    if req.timeout_s is not None and not req.timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {req.timeout_s}")
    if "" in req.stop:  # it would match at once: an answer of nothing, surely not what was meant
        raise ValueError("a stop string must not be empty")
    if req.allowed_token_ids == []:  # NOTE: no token could be sampled; refused as over HTTP
        raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
    if req.max_tokens == 0 and req.prompt_logprobs is None:
        raise ValueError("max_tokens 0 (the prompt alone) needs prompt_logprobs")
    ids = prompt_ids(tokenizer, req, max_model_len)
    max_tokens = req.max_tokens if req.max_tokens is not None else max(max_model_len - len(ids), 1)
    params = SamplingParams(
        max_tokens=max(max_tokens, 1),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed if req.seed is not None else random.getrandbits(63),
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        num_logprobs=-1 if req.logprobs is None else req.logprobs,
        num_prompt_logprobs=-1 if req.prompt_logprobs is None else req.prompt_logprobs,
        is_processed_logprobs=is_processed_logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        min_p=req.min_p,
        min_tokens=req.min_tokens,
        **_logit_bias(req.logit_bias),
        allowed_token_ids=tuple(req.allowed_token_ids or ()),
        bad_words_ids=_bad_words(tokenizer, req.bad_words),
        grammar=_grammar(req, grammars),
        no_drafts=not req.speculative,
    )
    params.validate(spec.vocab_size)
    validate_prompt(ids, params.max_tokens, spec.vocab_size, max_model_len)
    return ids, params


def _grammar(req: GenerateRequest, grammars) -> tuple[str, ...]:
    """(kind, spec, whitespace), compiled once here so a bad one is a 400 naming its fault."""
    s = req.structured
    if s is None:
        return ()
    g = (s.kind, s.spec, s.whitespace)
    if grammars is None:
        raise ValueError("structured outputs are not available here")
    grammars().check(g)  # GrammarError: a ValueError saying what is wrong
    return g


def _logit_bias(bias: dict | None) -> dict:
    """OpenAI's {"token id": bias} -> SamplingParams' two tuples. NOTE: a key is ASCII
    digits (int() takes other scripts' too), and names its token once ("7" and "07" are
    one token: which bias would hold is no one's guess)."""
    ids, values = {}, []
    for key, value in (bias or {}).items():
        digits = key.strip().removeprefix("-")
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"logit_bias keys are token ids, got {key[:32]!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias values are numbers, got {value!r}")
        token = int(digits) * (-1 if key.strip().startswith("-") else 1)
        if token in ids:
            raise ValueError(f"logit_bias names token {token} twice ({ids[token]!r}, {key!r})")
        ids[token] = key
        values.append(float(value))
    return {"logit_bias_ids": tuple(ids), "logit_bias": tuple(values)}


def _bad_words(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens, as written and (as vLLM does) after a space: at the start of a
    text or after another word a tokenizer spells a word differently."""
    seqs: dict[tuple[int, ...], None] = {}
    for w in words:
        if not w.strip():
            raise ValueError("a bad word must not be empty")
        for text in dict.fromkeys((w, w if w.startswith(" ") else " " + w)):
            ids = tuple(_tokenized(tokenizer.encode, text, "a bad word", add_special_tokens=False))
            if ids:
                seqs[ids] = None
    return tuple(seqs)


class Prompts:
    def __init__(
        self,
        model: str,
        tokenizer,
        spec: ModelSpec,
        max_model_len: int,
        is_processed_logprobs: bool = False,
    ):
        self.model, self.tokenizer, self.spec, self.max_model_len = (
            model,
            tokenizer,
            spec,
            max_model_len,
        )
        self.is_processed_logprobs = is_processed_logprobs
        self._grammars = None  # made for the first request with a grammar
        self._start_poll: asyncio.Future | None = None  # while the checker starts
        self.max_chars = max_prompt_chars(tokenizer, max_model_len)
        self.tools_growth = tools_growth(tokenizer)
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="tokenize", initializer=lambda: lower_this_thread(19)
        )
        self.off_loop_jobs = OffLoop(self._pool)  # clients take turns on the thread
        self._own_tokenizer = None  # made on the thread: the loop's is never shared

    def grammars(self) -> GrammarChecker:
        """Asked from the loop's thread and the tokenizing thread alike (it takes one at a time)."""
        if self._grammars is None:
            self._grammars = GrammarChecker(self.model, self.spec.vocab_size, MAX_COMPILE_CPU_S)
        return self._grammars

    def is_off_loop(self, req: GenerateRequest) -> bool:
        """A long prompt (its tools counted as long as the template may write them), or a
        grammar (its compiling may take a while, for all its few bytes)."""
        grown = (self.tools_growth - 1) * len(req.tools or "")
        return text_len(req) + grown > OFF_LOOP_CHARS or req.structured is not None

    def now(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        """The common case, on the loop: ValueError says what is wrong."""
        check_size(req, self.max_chars)
        return prepare(
            req,
            self.tokenizer,
            self.spec,
            self.max_model_len,
            self.is_processed_logprobs,
            self.grammars,
        )

    async def off_loop(self, client, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        """A long prompt (or a grammar), on the tokenizing thread in client's turn; Busy (a
        ValueError) when client has its share of work there already."""
        check_size(req, self.max_chars)
        wait_for = self._checker_started if req.structured is not None else None
        return await self.off_loop_jobs.run(client, self._prepare_here, req, wait_for=wait_for)

    async def _checker_started(self) -> None:
        """The grammar checker's start (seconds of imports) waited for here, on the loop: on
        the thread it would hold every client's long prompts behind it. One poll for all the
        requests waiting; GrammarNotJudged (503) past START_WAIT_S."""
        if self._start_poll is None or self._start_poll.done():
            self._start_poll = asyncio.ensure_future(self._poll_checker(self.grammars()))
        try:
            await asyncio.wait_for(asyncio.shield(self._start_poll), grammar_check.START_WAIT_S)
        except asyncio.TimeoutError:
            raise GrammarNotJudged(
                "the grammar checker is still starting (a busy host): try again"
            ) from None

    @staticmethod
    async def _poll_checker(checker: GrammarChecker) -> None:
        while not checker.is_settled():
            await asyncio.sleep(0.05)

    def _prepare_here(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        return prepare(
            req,
            self._thread_tokenizer(),
            self.spec,
            self.max_model_len,
            self.is_processed_logprobs,
            self.grammars,
        )

    async def tokenize(self, client, req: GenerateRequest) -> list[int]:
        """A prompt's ids alone (/tokenize), by the same rules: a long one off the loop.
        Its length is not held against the model's (the caller compares)."""
        check_size(req, self.max_chars)
        if not self.is_off_loop(req):
            return prompt_ids(self.tokenizer, req)
        return await self.off_loop_jobs.run(client, self._ids_here, req)

    def _ids_here(self, req: GenerateRequest) -> list[int]:
        return prompt_ids(self._thread_tokenizer(), req)

    def _thread_tokenizer(self):
        """The tokenizing thread's own (the loop's is never shared), made there on first use."""
        if self._own_tokenizer is None:
            from transformers import AutoTokenizer

            self._own_tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self._own_tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._grammars is not None:
            self._grammars.close()
