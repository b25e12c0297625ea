"""The loader + packed paged forward agree with an independent plain torch implementation
(contiguous, one sequence, full recompute) on tiny random GGUFs of every architecture."""

from __future__ import annotations

import random

import pytest
import torch

from app.engine.gguf.loader import load_gguf
from app.engine.runtime.decoder import DecoderLM
from app.engine.runtime.kv_pool import allocate_kv_caches
from app.kernels import AttentionMetadata
from tests.support.reference_model import ReferenceModel
from tests.support.tiny_gguf import ARCHITECTURES

BLOCK = 4


@pytest.fixture(autouse=True)
def exact_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's math against an fp32 reference at 1e-4: weights as loaded, no fp16 or packed
    copies (their rounding is tested against the oracle and in the kernel tests)."""
    from app.engine.runtime import kernel_choice

    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "dense")


class PagedRun:
    """Drives DecoderLM by hand: a shuffled paged pool, prompts fed in chunks, logits everywhere."""

    def __init__(self, path, num_blocks: int = 64, kv_dtype: torch.dtype = torch.float32) -> None:
        loaded = load_gguf(path, "cpu", torch.float32)
        self.model = DecoderLM(loaded.config, loaded.weights, torch.device("cpu"), kv_dtype=kv_dtype)
        self.kv = allocate_kv_caches(loaded.config, num_blocks, BLOCK, kv_dtype, torch.device("cpu"))
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)  # block tables in shuffled order

    def step(self, seqs: list[dict], chunks: list[int]) -> list[torch.Tensor]:
        """Each seq: {"ids", "done", "table"}; computes the next `chunks[i]` tokens of each, packed."""
        ids, pos, slots, cu, lens = [], [], [], [0], []
        for s, n in zip(seqs, chunks):
            start, end = s["done"], s["done"] + n
            while len(s["table"]) * BLOCK < end:
                s["table"].append(self.free.pop())
            ids += s["ids"][start:end]
            pos += list(range(start, end))
            slots += [s["table"][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            cu.append(len(ids))
            lens.append(end)
            s["done"] = end
        width = max(len(s["table"]) for s in seqs)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_table=torch.tensor([s["table"] + [0] * (width - len(s["table"])) for s in seqs], dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        hidden = self.model.hidden_states(torch.tensor(ids), torch.tensor(pos), meta, self.kv, torch.arange(len(ids)))
        logits = self.model.compute_logits(hidden)
        return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))]


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= 1e-4 * max(scale, 1.0), f"max abs err {err} (logit scale {scale})"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_chunked_paged_forward_matches_reference(arch, tiny_gguf_factory):
    path = tiny_gguf_factory(arch)
    ref = ReferenceModel(path)
    run = PagedRun(path)
    vocab = run.model.cfg.vocab_size
    # 23 and 30 tokens: past gemma3's window of 8, across several 4-token blocks, not a multiple of 4.
    a = {"ids": _ids(23, vocab, 1), "done": 0, "table": []}
    b = {"ids": _ids(30, vocab, 2), "done": 0, "table": []}
    out_a, out_b = [], []
    for chunks in ([5, 8], [7, 13], [11, 9]):  # two prompts packed, ending mid-block and on a block boundary
        la, lb = run.step([a, b], chunks)
        out_a.append(la)
        out_b.append(lb)
    _close(torch.cat(out_a), ref.forward(a["ids"]))
    _close(torch.cat(out_b), ref.forward(b["ids"]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_steps_match_reference(arch, tiny_gguf_factory):
    """One-token steps (decode) after a prefill read the paged context correctly."""
    path = tiny_gguf_factory(arch)
    ref = ReferenceModel(path)
    run = PagedRun(path)
    ids = _ids(20, run.model.cfg.vocab_size, 3)
    s = {"ids": ids, "done": 0, "table": []}
    outs = run.step([s], [9])
    for _ in range(11):
        outs += run.step([s], [1])
    _close(torch.cat(outs), ref.forward(ids))


@pytest.mark.parametrize("weight_type", ["F16", "BF16", "Q8_0"])
def test_quantized_weights_match_reference(weight_type, tiny_gguf_factory):
    path = tiny_gguf_factory("qwen3", weight_type=weight_type)
    ref = ReferenceModel(path)
    run = PagedRun(path)
    ids = _ids(12, run.model.cfg.vocab_size, 4)
    s = {"ids": ids, "done": 0, "table": []}
    _close(run.step([s], [12])[0], ref.forward(ids))


def test_weight_bytes_per_step_is_counted_once_per_row_count(tiny_gguf_factory, monkeypatch):
    """Every stats snapshot asks for it; the kernels are fixed once loaded, so the count is kept."""
    model = PagedRun(tiny_gguf_factory("llama")).model
    counted = {rows: model._count_weight_bytes(rows) for rows in (1, 64)}
    assert [model.weight_bytes_per_step(rows) for rows in (1, 64)] == [counted[1], counted[64]]
    assert counted[1] > 0

    def recount(rows: int) -> int:
        raise AssertionError("counted again")

    monkeypatch.setattr(model, "_count_weight_bytes", recount)
    assert [model.weight_bytes_per_step(rows) for rows in (1, 64, 1)] == [counted[1], counted[64], counted[1]]
