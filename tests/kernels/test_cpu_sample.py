"""The C draw of the CPU sampler (app/kernels/cpu_sample.c) against its torch reference, and the
distribution it draws from against the sampler's torch path."""

from __future__ import annotations

import pytest
import torch

from app.kernels import cpu_sample

pytestmark = pytest.mark.skipif(
    cpu_sample._library() is None, reason="no C compiler or no AVX2/FMA/F16C here: the C kernels cannot build"
)

# (temperature, top_k, top_p, min_p): each filter alone, together, and none
SETTINGS = [(0.7, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (0.5, 40, 1.0, 0.0), (1.3, 0, 1.0, 0.1),
            (0.8, 20, 0.9, 0.05), (2.0, 0, 0.99, 0.0), (1.0, 1, 1.0, 0.0), (1e-4, 0, 0.5, 0.0)]


def grid_logits(rows: int, vocab: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    """Logits on a grid of 1/8: equal values tie exactly, distinct ones differ by far more than a
    rounding error, so C and torch see the same order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.round(torch.randn(rows, vocab, generator=gen) * spread * 8) / 8


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_c_draw_matches_the_reference(setting: tuple[float, int, float, float]) -> None:
    t, k, p, m = setting
    logits = grid_logits(6, 3000, seed=len(str(setting)))
    logits[1, ::3] = float("-inf")  # a grammar mask
    logits[2, 17] = float("inf")
    for draw in range(20):
        uniforms = torch.rand(6, generator=torch.Generator().manual_seed(draw), dtype=torch.float64)
        args = ([t] * 6, [k] * 6, [p] * 6, [m] * 6, uniforms)
        assert torch.equal(cpu_sample.sample(logits, *args), cpu_sample.sample_ref(logits, *args)), (setting, draw)


def test_masked_tokens_and_filtered_ones_are_never_drawn() -> None:
    logits = grid_logits(1, 500, seed=3, spread=1.0)
    logits[0, 1::2] = float("-inf")
    top = set(sorted(range(500), key=lambda i: (-float(logits[0, i]), i))[:5])  # equal logits: lower id first
    for u in torch.linspace(0, 0.999999, 200, dtype=torch.float64):
        token = int(cpu_sample.sample(logits, [1.0], [5], [1.0], [0.0], u.reshape(1)))
        assert token % 2 == 0 and token in top
        assert int(cpu_sample.sample(logits, [1.0], [0], [1.0], [0.0], u.reshape(1))) % 2 == 0


def test_a_row_draws_the_same_token_in_any_batch() -> None:
    logits = grid_logits(5, 2000, seed=7)
    uniforms = torch.rand(5, dtype=torch.float64)
    args = [[0.7] * 5, [0] * 5, [0.9] * 5, [0.0] * 5]
    batch = cpu_sample.sample(logits, *args, uniforms)
    for r in range(5):
        assert int(cpu_sample.sample(logits[r : r + 1], *(a[:1] for a in args), uniforms[r : r + 1])) == int(batch[r])


@pytest.mark.parametrize("setting", [(0.7, 0, 0.9, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 1.0, 0.2), (1.5, 0, 1.0, 0.0)])
def test_draws_follow_the_sampler_distribution(setting: tuple[float, int, float, float]) -> None:
    """Over many uniforms the C draw's frequencies are the sampler's probabilities (its torch path)."""
    from types import SimpleNamespace

    from app.engine.runtime.sampler import sampling_probs
    from app.engine.types.sampling_params import SamplingParams

    t, k, p, m = setting
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, float("-inf")]])
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    expected = sampling_probs(logits.clone(), [SimpleNamespace(params=params)])[0].double()
    expected /= expected.sum()
    n = 20000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # evenly spread: frequencies are exact to 1/n
    tokens = cpu_sample.sample(logits.expand(n, -1), [t] * n, [k] * n, [p] * n, [m] * n, uniforms)
    freq = torch.bincount(tokens, minlength=8).double() / n
    assert torch.allclose(freq, expected, atol=2e-4), (freq, expected)
