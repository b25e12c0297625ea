"""Batched sampling: grammar masks, logit bias, penalties, temperature, top-k / top-p / min-p,
per-request seeds, logprobs.

One call per step over the rows that sample. Rows are independent: a seeded request draws its
noise from its own generator, seeded by (seed, output position), so its tokens do not depend on
what else is in the batch, nor on whether it was preempted and recomputed. Rows without a grammar
or a bias are not touched by those stages.

Order (vLLM's, with min-p last): grammar mask -> logit bias -> penalties -> temperature -> top-k ->
top-p -> min-p -> draw. Logprobs are those of the logits as the model made them, except that a
constrained row's forbidden tokens are -inf (vLLM's default "raw_logprobs", which it also takes
after the grammar mask).
"""

from __future__ import annotations

import torch

from app.engine.structured.bitmask import GrammarBitmask
from app.engine.types.batch import ScheduledSequence
from app.engine.types.outputs import TopLogprobs
from app.kernels import cpu_ops, cpu_sample

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the 63-bit seed space
# Top-k / top-p look at this many best tokens first; a full-vocabulary sort (slow on a large
# vocabulary) happens only when that shortlist holds less than a row's top-p mass.
_SHORTLIST = 1024


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.grammar_mask = GrammarBitmask(vocab_size)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSequence]) -> tuple[list[int], list[TopLogprobs | None]]:
        """logits `[len(seqs), vocab]` (fp32) -> one token id per row, and its top-k logprobs if asked.
        Constrained rows of `logits` are masked in place."""
        self.grammar_mask.apply(logits, seqs)
        raw = logits
        logits = apply_logit_bias(logits, seqs)
        logits = apply_penalties(logits, seqs)
        greedy_rows = [is_greedy(s) for s in seqs]
        tokens = cpu_ops.argmax(logits)
        if not all(greedy_rows):
            greedy = torch.tensor(greedy_rows, device=logits.device)
            tokens = torch.where(greedy, tokens, _draw(logits, seqs, greedy_rows))
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, seqs, token_list)

    def _logprobs(self, raw: torch.Tensor, seqs: list[ScheduledSequence], tokens: list[int]) -> list[TopLogprobs | None]:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[TopLogprobs | None] = [None] * len(seqs)
        if not rows:
            return result
        lp = torch.log_softmax(raw[rows], -1)
        for j, i in enumerate(rows):
            result[i] = top_logprobs(lp[j], seqs[i].params.logprobs, tokens[i])
        return result


def is_greedy(s: ScheduledSequence) -> bool:
    """Argmax sampling: temperature 0, or too small to divide by."""
    return s.params.greedy


def apply_logit_bias(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """Add each row's `logit_bias` in one scatter over every biased row. Returns `logits` itself
    when no row has a bias (so the raw logits stay untouched for logprobs), else a biased copy."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, s in enumerate(seqs):
        bias = s.params.logit_bias
        if bias:
            rows.extend([i] * len(bias))
            cols.extend(bias)
            values.extend(bias.values())
    if not rows:
        return logits
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    return logits.index_put(index, torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output tokens (divide positive logits, multiply
    negative ones), frequency (per occurrence) and presence (once) over output tokens only.
    Returns `logits` itself when no row has a penalty, else a penalised copy."""
    rows = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, s = seqs[i].params, seqs[i]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.token_ids)), device=row.device, dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and s.num_output_tokens:
            out = torch.tensor(s.output_token_ids, device=row.device, dtype=torch.long)
            counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def sampling_probs(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """The distribution each row draws from: (penalised) logits after temperature, top-k, top-p and
    min-p. Filtered-out tokens are exactly 0; rows are not renormalised after min-p (the draw does
    not need it). Greedy rows are computed at temperature 1 and ignored by the caller."""
    temps = torch.tensor([1.0 if is_greedy(s) else s.params.temperature for s in seqs], device=logits.device)
    logits = logits / temps.unsqueeze(1).to(logits.dtype)
    # An extreme penalty or temperature can push logits to +-inf, and softmax of inf is NaN.
    finfo = torch.finfo(logits.dtype)
    logits = logits.clamp(finfo.min, finfo.max)
    logits = _top_k_top_p(logits, seqs)
    probs = torch.softmax(logits, -1)
    min_ps = torch.tensor([s.params.min_p for s in seqs], device=logits.device, dtype=probs.dtype)
    if bool((min_ps > 0).any()):
        threshold = probs.max(-1, keepdim=True).values * min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def top_logprobs(logprobs_row: torch.Tensor, k: int, token_id: int | None) -> TopLogprobs:
    """{token_id: logprob} of the top-k tokens plus `token_id` (vLLM's shape)."""
    out: TopLogprobs = {}
    k = min(k, logprobs_row.shape[-1])
    if k > 0:
        vals, ids = logprobs_row.topk(k)
        out = dict(zip(ids.tolist(), vals.tolist()))
    if token_id is not None and token_id not in out:
        out[token_id] = float(logprobs_row[token_id])
    return out


def top_logprobs_rows(logprobs: torch.Tensor, k: int, token_ids: list[int]) -> list[TopLogprobs]:
    """`top_logprobs` for each row of `logprobs` `[n, vocab]` with its own `token_ids[i]`, reading
    the results back from the device once, not once per row."""
    k = min(k, logprobs.shape[-1])
    targets = torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)
    target_lps = logprobs.gather(1, targets).squeeze(1).tolist()
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], targets[:, :0])
    out = []
    for ids, vals, token_id, target_lp in zip(top_ids.tolist(), top_vals.tolist(), token_ids, target_lps):
        row = dict(zip(ids, vals))
        if token_id not in row:
            row[token_id] = target_lp
        out.append(row)
    return out


def _draw(logits: torch.Tensor, seqs: list[ScheduledSequence], greedy_rows: list[bool]) -> torch.Tensor:
    """A token per row from its filtered distribution (greedy rows are drawn at temperature 1 and
    ignored by the caller): in C for fp32 CPU rows (`cpu_sample`, several times faster than the
    torch path below), else in torch."""
    uniform = _uniforms(seqs)
    if not cpu_sample.takes(logits):
        return _inverse_cdf(sampling_probs(logits, seqs), uniform)
    params = [s.params for s in seqs]
    temps = [1.0 if greedy else p.temperature for greedy, p in zip(greedy_rows, params)]
    return cpu_sample.sample(logits, temps, [p.top_k for p in params], [p.top_p for p in params],
                             [p.min_p for p in params], uniform)


def _uniforms(seqs: list[ScheduledSequence]) -> torch.Tensor:
    """One uniform number per row: a seeded request's from its own generator, seeded by (seed,
    output position)."""
    uniform = torch.empty(len(seqs), dtype=torch.float64)
    for i, s in enumerate(seqs):
        gen = None
        if s.params.seed is not None:
            gen = torch.Generator()
            gen.manual_seed(mix_seed(s.params.seed, s.num_output_tokens))
        uniform[i] = torch.rand((), generator=gen, dtype=torch.float64)
    return uniform


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's uniform number located in its cumulative distribution: exact sampling from
    `probs` (unnormalised is fine) for the price of a cumsum, where drawing a noise value for every
    vocabulary entry cost far more on a large vocabulary."""
    cdf = probs.double().cumsum(-1)
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    # side="right": the first token whose cumulative mass passes the draw, never a zero-mass one.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def _has_penalty(s: ScheduledSequence) -> bool:
    p = s.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def mix_seed(seed: int, position: int) -> int:
    """A seeded request's generator seed at an output position: one stream per (seed, position)."""
    return ((seed * _SEED_MIX) ^ (position * 0xBF58476D1CE4E5B9)) & 0x7FFF_FFFF_FFFF_FFFF


def _top_k_top_p(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    top_ks = [s.params.top_k for s in seqs]
    # top_p = 1 must keep everything: the fp32 cumsum of a large vocab reaches 1.0 before its tail.
    top_ps = [p if p < 1.0 else float("inf") for p in (s.params.top_p for s in seqs)]
    if not any(top_ks) and all(p == float("inf") for p in top_ps):
        return logits
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    ps = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    width = min(vocab, max(_SHORTLIST, max(k for k in top_ks if k < vocab) if any(0 < k < vocab for k in top_ks) else 0))
    best, order = logits.topk(width, dim=-1)  # sorted, descending
    drop = torch.arange(width, device=logits.device).unsqueeze(0) >= ks.unsqueeze(1)
    # Probabilities after top-k: over the top-k tokens where k fits the shortlist, else the whole vocab.
    full_lse = torch.logsumexp(logits, -1, keepdim=True)
    short_lse = torch.logsumexp(best.masked_fill(drop, float("-inf")), -1, keepdim=True)
    lse = torch.where((ks <= width).unsqueeze(1), short_lse, full_lse)
    probs = torch.exp(best - lse).masked_fill(drop, 0.0)
    # Keep the smallest prefix whose mass reaches p (the top token always stays).
    before = probs.cumsum(-1) - probs
    filtered_rows = (ks < vocab) | torch.isfinite(ps)  # rows with top_k and top_p off keep everything
    beyond = ((before[:, -1] + probs[:, -1]) < ps) & (ks > width) & filtered_rows
    if width < vocab and bool(beyond.any()):
        return _top_k_top_p_sorted(logits, ks, ps)  # some row's top-p set reaches past the shortlist
    drop |= before >= ps.unsqueeze(1)
    short = torch.full_like(logits, float("-inf")).scatter_(-1, order, best.masked_fill(drop, float("-inf")))
    return torch.where(filtered_rows.unsqueeze(1), short, logits)


def _top_k_top_p_sorted(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(-1, descending=True)
    drop = torch.arange(vocab, device=logits.device).unsqueeze(0) >= ks.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    drop |= (probs.cumsum(-1) - probs) >= ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
