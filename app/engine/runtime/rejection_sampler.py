"""Verification of drafted tokens: which of a sequence's k drafts the target keeps, plus one token
of its own (the correction where a draft was rejected, or the bonus token after all k).

Greedy rows keep the drafts that equal the target's argmax, so the tokens are those of decoding
without speculation. Sampled rows use rejection sampling with the draft as a point mass q = 1 at
its token (prompt lookup, and the greedy draft model): draft d at a row whose target distribution
is p is kept with probability p(d); otherwise the row draws from p without d, renormalised. Each
emitted token is then distributed exactly as p (Leviathan et al., 2023), whatever the drafts were.
"""

from __future__ import annotations

import torch

from app.engine.runtime.sampler import apply_logit_bias, is_greedy, mix_seed, sampling_probs
from app.engine.types.batch import ScheduledSequence
from app.kernels import cpu_ops

_ACCEPT_SALT = 0x5851F42D4C957F2D  # a seeded request's acceptance draws: another stream than its token draws


def verify(logits: torch.Tensor, seqs: list[ScheduledSequence], drafts: list[list[int]]) -> list[list[int]]:
    """`logits` holds 1 + len(drafts[i]) rows per sequence, in order -> each sequence's new tokens:
    its accepted drafts and one token of the target's."""
    logits = apply_logit_bias(logits, [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)])
    argmax = cpu_ops.argmax(logits).tolist()
    out: list[list[int]] = []
    row = 0
    for seq, draft in zip(seqs, drafts):
        rows = slice(row, row + len(draft) + 1)
        if is_greedy(seq):
            out.append(_verify_greedy(argmax[rows], draft))
        else:
            out.append(_verify_sampled(logits[rows], seq, draft))
        row = rows.stop
    return out


def _verify_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    kept = 0
    while kept < len(draft) and draft[kept] == argmax[kept]:
        kept += 1
    return draft[:kept] + [argmax[kept]]


def _verify_sampled(logits: torch.Tensor, seq: ScheduledSequence, draft: list[int]) -> list[int]:
    row_seqs = [seq] * logits.shape[0]
    probs = sampling_probs(logits, row_seqs).double()  # logit bias already added
    probs /= probs.sum(-1, keepdim=True)  # min-p leaves rows unnormalised
    gen = _generator(seq)
    uniform = torch.rand(len(draft) + 1, generator=gen, dtype=torch.float64).tolist()
    for j, token in enumerate(draft):
        if uniform[j] < float(probs[j, token]):
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        return draft[:j] + [_draw(residual, uniform[-1])]
    return draft + [_draw(probs[-1], uniform[-1])]


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw of one token from an unnormalised row."""
    cdf = probs.cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(index, probs.shape[0] - 1)


def _generator(seq: ScheduledSequence) -> torch.Generator | None:
    if seq.params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(mix_seed(seq.params.seed ^ _ACCEPT_SALT, seq.num_output_tokens))
    return gen
