"""Batched sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

One call per step over the rows that sample. Rows are independent: a seeded request draws its
noise from its own generator, seeded by (seed, output position), so its tokens do not depend on
what else is in the batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

import torch

from app.engine.outputs import TopLogprobs
from app.engine.sequence import Sequence

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the 63-bit seed space


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TopLogprobs | None]]:
        """logits `[len(seqs), vocab]` (fp32) -> one token id per row, and its top-k logprobs if asked."""
        raw = logits
        logits = self._apply_penalties(logits, seqs)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        tokens = logits.argmax(-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, seqs)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, seqs, token_list)

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
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

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        logits = _top_k_top_p(logits, seqs)
        probs = torch.softmax(logits, -1)
        min_ps = torch.tensor([s.params.min_p for s in seqs], device=logits.device)
        if bool((min_ps > 0).any()):
            threshold = probs.max(-1, keepdim=True).values * min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a normalised CDF.
        noise = torch.empty_like(probs)
        for i, s in enumerate(seqs):
            gen = None
            if s.params.seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(_mix(s.params.seed, s.num_output_tokens))
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(-1)

    def _logprobs(self, raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TopLogprobs | None]:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[TopLogprobs | None] = [None] * len(seqs)
        if not rows:
            return result
        lp = torch.log_softmax(raw[rows], -1)
        for j, i in enumerate(rows):
            result[i] = top_logprobs(lp[j], seqs[i].params.logprobs, tokens[i])
        return result


def top_logprobs(logprobs_row: torch.Tensor, k: int, token_id: int | None) -> TopLogprobs:
    """{token_id: logprob} of the top-k tokens plus `token_id` (vLLM's shape)."""
    out: TopLogprobs = {}
    if k > 0:
        vals, ids = logprobs_row.topk(k)
        out = dict(zip(ids.tolist(), vals.tolist()))
    if token_id is not None and token_id not in out:
        out[token_id] = float(logprobs_row[token_id])
    return out


def _has_penalty(s: Sequence) -> bool:
    p = s.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _mix(seed: int, position: int) -> int:
    return ((seed * _SEED_MIX) ^ (position * 0xBF58476D1CE4E5B9)) & 0x7FFF_FFFF_FFFF_FFFF


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    top_ks = [s.params.top_k for s in seqs]
    top_ps = [s.params.top_p for s in seqs]
    if not any(top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    ps = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    # Keep the smallest prefix whose mass reaches p (the top token always stays).
    drop |= (probs.cumsum(-1) - probs) >= ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
