"""What happens to logits between the model and the chosen token, beyond temperature,
top-p and top-k (sampling.py), and what is reported of them.

A request's penalties and masks (SamplingParams) live per row, on the device:
    blocked    [B, V] bool   never this token: outside allowed_token_ids, or a one-token bad word
                             (longer ones: a step mask, grammar_matcher.Matcher)
    stops      [B, V] bool   EOS (unless ignore_eos) and stop tokens: blocked while
                             num_output < min_tokens
    bias       [B, V] fp32   logit_bias
    seen       [B, V] bool   tokens of the prompt or the output so far (repetition_penalty)
    counts     [B, V] int32  how often each token was generated (frequency and presence penalties)
    presence, frequency, repetition, min_p [B] fp32; min_tokens, num_output [B] int32
In the order vLLM applies them: masks and bias, then the penalties; temperature,
min_p, top-k and top-p follow in sampling.py. A request that asks for none of it
never enters this module. Log-probabilities are of the model's raw logits (as
vLLM's default), or of the distribution sampled from when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.base.grammar import bits_to_mask
from common.base.request import SamplingParams, TokenLogprobs
from common.engine.sampling import sample

NEG_INF = float("-inf")
LOGPROB_FLOOR = -9999.0  # what -inf is reported as (JSON has no infinity)


@dataclass
class RowState:
    blocked: torch.Tensor
    stops: torch.Tensor
    bias: torch.Tensor
    seen: torch.Tensor
    counts: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    min_p: torch.Tensor
    min_tokens: torch.Tensor
    num_output: torch.Tensor

    @staticmethod
    def empty(num_rows: int, vocab_size: int, device) -> "RowState":
        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=device)

        return RowState(
            zeros(num_rows, vocab_size, dtype=torch.bool),
            zeros(num_rows, vocab_size, dtype=torch.bool),
            zeros(num_rows, vocab_size),
            zeros(num_rows, vocab_size, dtype=torch.bool),
            zeros(num_rows, vocab_size, dtype=torch.int32),
            zeros(num_rows),
            zeros(num_rows),
            torch.ones(num_rows, device=device),
            zeros(num_rows),
            zeros(num_rows, dtype=torch.int32),
            zeros(num_rows, dtype=torch.int32),
        )

    def rows(self, n: int) -> "RowState":
        """The first n rows (views)."""
        return RowState(*(getattr(self, f)[:n] for f in self.__dataclass_fields__))

    @torch.inference_mode()
    def set_row(
        self,
        row: int,
        p: SamplingParams,
        prompt_ids: list[int],
        output_ids: list[int],
        eos_ids: tuple[int, ...],
        to_device,
    ) -> None:
        """A request joins at row: its params, and the tokens it has (to_device(list,
        dtype) makes a device tensor: the one host-to-device copy, when it joins)."""
        self.blocked[row].fill_(bool(p.allowed_token_ids))
        if p.allowed_token_ids:
            self.blocked[row, to_device(list(p.allowed_token_ids), torch.int64)] = False
        singles = [w[0] for w in p.bad_words_ids if len(w) == 1]
        if singles:
            self.blocked[row, to_device(singles, torch.int64)] = True
        self.stops[row].fill_(False)
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        if stops and p.min_tokens:
            self.stops[row, to_device(stops, torch.int64)] = True
        self.bias[row].zero_()
        if p.logit_bias_ids:
            self.bias[row, to_device(list(p.logit_bias_ids), torch.int64)] = to_device(
                list(p.logit_bias), torch.float32
            )
        self.seen[row].fill_(False)
        self.counts[row].zero_()
        if p.repetition_penalty != 1.0 and prompt_ids + output_ids:
            self.seen[row, to_device(prompt_ids + output_ids, torch.int64)] = True
        if output_ids:
            ids = to_device(output_ids, torch.int64)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        for name, value in (
            ("presence", p.presence_penalty),
            ("frequency", p.frequency_penalty),
            ("repetition", p.repetition_penalty),
            ("min_p", p.min_p),
            ("min_tokens", p.min_tokens),
            ("num_output", len(output_ids)),
        ):
            getattr(self, name)[row].fill_(value)

    def copy_row(self, dst: int, src: int) -> None:
        for f in self.__dataclass_fields__:
            t = getattr(self, f)
            t[dst].copy_(t[src])

    def spread(self, drafts: torch.Tensor) -> "RowState":
        """A verify step's state: rows [0, n)'s each spread over its k + 1 positions
        (drafts [n, k], -1 none), position j's as if drafts 0..j-1 had been generated (its
        token counts only where they are accepted). -> n * (k + 1) rows, fresh tensors."""
        n, k = drafts.shape
        k1 = k + 1
        st = RowState(
            *(getattr(self, f)[:n].repeat_interleave(k1, 0) for f in self.__dataclass_fields__)
        )
        steps = torch.arange(k1, device=drafts.device)
        # draft i counts at positions j > i: [n, k1, k] (none where there is none)
        before = (steps[:, None] > steps[None, :k]) & (drafts >= 0)[:, None, :]
        rows = torch.arange(n * k1, device=drafts.device).view(n, k1, 1).expand(n, k1, k)
        cols = drafts.clamp(min=0)[:, None, :].expand(n, k1, k)
        _count_tokens(st.counts, st.seen, rows.reshape(-1), cols.reshape(-1), before.reshape(-1))
        st.num_output += steps.repeat(n).int()
        return st

    def observe_runs(self, tokens: torch.Tensor, num_made: torch.Tensor) -> None:
        """A verify step's tokens [n, k + 1], of which row i made its first num_made[i]
        [n], join what each row has generated."""
        n, k1 = tokens.shape
        made = torch.arange(k1, device=tokens.device)[None, :] < num_made[:, None]  # [n, k1]
        rows = torch.arange(n, device=tokens.device)[:, None].expand(n, k1)
        _count_tokens(self.counts[:n], self.seen[:n], rows, tokens, made)
        self.num_output[:n].add_(num_made.int())

    def observe(self, sampled: torch.Tensor) -> None:
        """The tokens just chosen [B] join what each row has generated."""
        rows = torch.arange(sampled.shape[0], device=sampled.device)
        self.counts.index_put_(
            (rows, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True
        )
        self.seen[rows, sampled] = True
        self.num_output.add_(1)


def _count_tokens(counts, seen, rows, cols, is_counted) -> None:
    """counts [R, V] and seen [R, V] in place: token cols[i] once more in row rows[i] where
    is_counted[i] (a row's token may come several times: summed, no host sync)."""
    added = torch.zeros_like(counts)
    added.index_put_((rows, cols), is_counted.int(), accumulate=True)
    counts += added
    seen |= added > 0


def process(
    logits: torch.Tensor, st: RowState, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [B, V] -> fp32 logits with every row's masks, bias and penalties applied;
    allowed [B, V] bool: this step's grammar masks (True where a token may come)."""
    x = logits.float() + st.bias
    blocked = st.blocked | (st.stops & (st.num_output < st.min_tokens)[:, None])
    if allowed is not None:
        blocked = blocked | ~allowed
    x = x.masked_fill(blocked, NEG_INF)
    rep = st.repetition[:, None]
    x = torch.where(st.seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = st.counts.float()
    return x - st.frequency[:, None] * counts - st.presence[:, None] * (counts > 0).float()


def choose(
    logits: torch.Tensor,
    rows: RowState | None,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    num_logprobs: int,
    is_processed: torch.Tensor,
    out: list[torch.Tensor],
    is_greedy: bool,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full path: logits [B, V] -> the chosen tokens [B], with rows' penalties and masks
    applied (rows None: none in the batch) and, if num_logprobs >= 0 (the most any row
    asked for), out = (the chosen token's log-probability [B], the likeliest [B, >= k]
    and their ids) filled, raw or (is_processed [B]) of the distribution sampled from.
    A row that asked for nothing gets the same token as on the plain path."""
    raw = logits.float()
    x = process(raw, rows, allowed) if rows is not None else raw
    want = num_logprobs >= 0
    sampled_logp = torch.empty_like(x) if want else None
    if is_greedy:
        chosen = x.argmax(dim=-1)
        if want:
            sampled_logp = torch.log_softmax(x, dim=-1)
    else:
        chosen = sample(
            x,
            temperature,
            top_p,
            top_k,
            seeds,
            positions,
            rows.min_p if rows is not None else None,
            sampled_logp,
        )
    if want:
        logp = torch.where(is_processed[:, None], sampled_logp, torch.log_softmax(raw, dim=-1))
        k = max(num_logprobs, 0)
        lp, top, ids = report(logp, chosen, k)
        out[0].copy_(lp)
        if k:
            out[1][:, :k].copy_(top)
            out[2][:, :k].copy_(ids)
    if rows is not None:
        rows.observe(chosen)
    return chosen


def report(
    logp: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logp [B, V] log-probabilities, chosen [B] -> (the chosen token's [B], the k likeliest
    [B, k] and their ids [B, k]), all on the device."""
    top = logp.topk(k, dim=-1) if k else None
    chosen_lp = logp.gather(1, chosen.long()[:, None])[:, 0]
    if top is None:
        return chosen_lp, logp.new_zeros(logp.shape[0], 0), chosen.new_zeros(logp.shape[0], 0)
    return chosen_lp, top.values, top.indices


def to_host(
    chosen_lp: list[float], top_lp: list[list[float]], top_ids: list[list[int]], ks: list[int]
) -> list[TokenLogprobs | None]:
    """Per row (ks[i] < 0: none asked): what is reported, -inf (and NaN: a row whose every
    token is masked) as LOGPROB_FLOOR: the wire refuses what is not finite."""
    out: list[TokenLogprobs | None] = []
    for lp, tops, ids, k in zip(chosen_lp, top_lp, top_ids, ks):
        if k < 0:
            out.append(None)
            continue
        out.append(TokenLogprobs(_floor(lp), list(ids[:k]), [_floor(v) for v in tops[:k]]))
    return out


def _floor(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NOTE: NaN too


def choose_first(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list,
    positions: list[int],
    eos_ids: tuple[int, ...],
    to_device,
    masks: list | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The prefill node's first tokens on the full path: logits [B, V] of the prompts'
    last positions; histories[i] = (prompt, outputs already streamed) where penalties
    need them; masks[i]: a grammar's mask ([W] int32 words) or None. -> (the tokens,
    what is reported of each)."""
    n, vocab = logits.shape
    rows = None
    if any(p.is_processing for p in params):
        rows = RowState.empty(n, vocab, logits.device)
        for i, (p, h) in enumerate(zip(params, histories)):
            prompt, outputs = h if h is not None else ([], [])
            rows.set_row(i, p, prompt, outputs, eos_ids, to_device)
    k = max(p.num_logprobs for p in params)
    out = [
        torch.zeros(n, device=logits.device),
        torch.zeros(n, max(k, 0), device=logits.device),
        torch.zeros(n, max(k, 0), dtype=torch.int64, device=logits.device),
    ]
    is_greedy = all(p.is_greedy for p in params)
    allowed = None
    if masks and any(m is not None for m in masks):
        words = next(m for m in masks if m is not None)
        bits = torch.stack([m if m is not None else torch.full_like(words, -1) for m in masks])
        allowed = bits_to_mask(to_device(bits, torch.int32), vocab)
    chosen = choose(
        logits,
        rows,
        to_device([p.temperature for p in params], torch.float32),
        to_device([p.top_p for p in params], torch.float32),
        to_device([p.top_k for p in params], torch.int32),
        to_device([p.seed for p in params], torch.int64),
        to_device(positions, torch.int64),
        k,
        to_device([p.is_processed_logprobs for p in params], torch.bool),
        out,
        is_greedy,
        allowed,
    )
    reported = (
        to_host(out[0].tolist(), out[1].tolist(), out[2].tolist(), [p.num_logprobs for p in params])
        if k >= 0
        else [None] * n
    )
    return chosen.tolist(), reported


PROMPT_ROWS = 256  # prompt positions whose logits are made at once ([rows, V] fp32 each)


def prompt_logprobs(
    compute_logits, hidden: torch.Tensor, targets: list[int], k: int, to_device
) -> list[TokenLogprobs]:
    """Of the model's raw logits at each prompt position [L, H]: the next prompt token's
    log-probability (targets[i]; -1 past the prompt's end: left out) and the k likeliest."""
    out: list[TokenLogprobs] = []
    for start in range(0, len(targets), PROMPT_ROWS):
        part = [t for t in targets[start : start + PROMPT_ROWS]]
        m = sum(t >= 0 for t in part)
        if not m:
            continue
        logp = torch.log_softmax(compute_logits(hidden[start : start + m]).float(), dim=-1)
        lp, top, ids = report(logp, to_device(part[:m], torch.int64), max(k, 0))
        out += to_host(lp.tolist(), top.tolist(), ids.tolist(), [k] * m)
    return out
