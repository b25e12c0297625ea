"""Decode CUDA graphs: bucketing, static-buffer padding, and graph == eager.

On the CPU (CI) the capture is replaced by an eager replay of the same static buffers, so what is
tested is everything around the graph: bucket choice, how a step's inputs are copied in, that
padding rows store nothing and that stale rows from a larger earlier step leak nothing. On a GPU the
real `torch.cuda.CUDAGraph` runs and is compared with eager execution.
"""

from __future__ import annotations

import pytest
import torch

from app.engine.runtime.cuda_graphs import DecodeGraphs, _Captured, graph_batch_sizes
from app.engine.types.sampling_params import SamplingParams
from app.kernels import AttentionMetadata
from tests.engine.core.test_engine import GREEDY, make_engine, prompts, run_all

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _EagerReplay:
    """Stands in for a CUDA graph on the CPU: re-runs the captured forward into the same output."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.hidden = graphs._forward(size)
        self.replays = 0

    @torch.inference_mode()
    def replay(self) -> None:
        self.hidden.copy_(self.graphs._forward(self.size))
        self.replays += 1


class EagerGraphs(DecodeGraphs):
    def _capture(self, size: int) -> _Captured:
        for meta in self.metas:
            meta.slot_mapping.fill_(-1)
        replay = _EagerReplay(self, size)
        return _Captured(replay, replay.hidden)

    def replays(self) -> dict[int, int]:
        return {size: c.graph.replays for size, c in self.graphs.items() if c.graph.replays}


def decode_meta(slots: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor) -> AttentionMetadata:
    cu_seqlens_q = torch.arange(len(slots) + 1, dtype=torch.int32)  # one query per sequence
    return AttentionMetadata(cu_seqlens_q, seq_lens, table, slots)


def with_eager_graphs(engine, max_num_seqs: int = 8):
    cfg = engine.config
    width = -(-engine.plan.max_model_len // cfg.block_size)
    runner = engine.worker.runner
    runner.graphs = EagerGraphs(engine.worker.model, runner.kv_caches, max_num_seqs, width, runner.layer_groups)
    engine.worker.runner.graphs.capture_all()
    return engine.worker.runner.graphs


@pytest.fixture(scope="module")
def model_path(tiny_gguf_factory):
    return tiny_gguf_factory("gemma3")


def test_batch_size_buckets():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_graph_decode_equals_eager(model_path):
    """Ragged prompts and lengths: the batch shrinks through the buckets (8 -> 4 -> 2 -> 1) as
    requests finish, so padding rows hold stale inputs of earlier, larger steps."""
    reqs = prompts(7, seed=3)
    lengths = [3, 6, 9, 12, 15, 18, 21]

    def run(engine):
        seqs = [engine.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in zip(reqs, lengths)]
        while engine.has_unfinished():
            engine.step()
        return [s.output_token_ids for s in seqs]

    eager = run(make_engine(model_path, enable_prefix_caching=False))
    engine = make_engine(model_path, enable_prefix_caching=False)
    graphs = with_eager_graphs(engine)
    assert run(engine) == eager
    used = graphs.replays()
    assert {8, 4, 2, 1} <= set(used), used  # 7 -> bucket 8, ..., 1 -> bucket 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_eager_buckets_equal_unpadded_steps(model_path):
    """--enforce-eager on CUDA: the same padded buckets, run op by op."""
    reqs = prompts(5, seed=5)
    alone = run_all(make_engine(model_path, enable_prefix_caching=False), reqs)
    engine = make_engine(model_path, enable_prefix_caching=False)
    engine.worker.runner.setup_decode_graphs(8, engine.plan.max_model_len, capture=False)
    assert engine.worker.runner.graphs.graphs == {}
    assert run_all(engine, reqs) == alone


def test_mixed_and_oversized_steps_run_eagerly(model_path):
    engine = make_engine(model_path, max_num_batched_tokens=16)
    graphs = with_eager_graphs(engine, max_num_seqs=2)
    reqs = prompts(3, seed=4, lo=20, hi=30)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=4, **GREEDY)) for p in reqs]
    engine.step()  # a prefill chunk: eager
    assert graphs.replays() == {}
    while engine.has_unfinished():
        engine.step()
    # Three decoding sequences exceed the largest bucket (2): those steps ran eagerly too.
    alone = [run_all(make_engine(model_path), [p], max_tokens=4)[0] for p in reqs]
    assert [s.output_token_ids for s in seqs] == alone


def test_padding_rows_write_no_kv(model_path):
    engine = make_engine(model_path, kv_cache_blocks=64)
    graphs = with_eager_graphs(engine)
    # A step of 8 leaves real rows behind; then a step of 3 (bucket 4) must store exactly 3 slots.
    table = torch.arange(8, dtype=torch.int32).view(8, 1)
    groups = engine.plan.kv_spec.num_groups  # every group stores into the same slots here
    graphs.run(torch.arange(8) + 5, torch.full((8,), 2),
               [decode_meta(torch.arange(8) * 4 + 2, torch.full((8,), 3, dtype=torch.int32), table)] * groups)
    before = [layer.k.clone() for layer in engine.worker.runner.kv_caches]
    slots = torch.tensor([40, 44, 48])
    table = torch.tensor([[10], [11], [12]], dtype=torch.int32)
    hidden = graphs.run(torch.tensor([7, 8, 9]), torch.tensor([0, 0, 0]),
                        [decode_meta(slots, torch.ones(3, dtype=torch.int32), table)] * groups)
    assert hidden.shape == (3, engine.plan.model_config.hidden_size)
    for layer, old in zip(engine.worker.runner.kv_caches, before):
        changed = (layer.k.flatten(0, 1) != old.flatten(0, 1)).flatten(1).any(1).nonzero().flatten()
        assert changed.tolist() == slots.tolist()  # the three real slots, nothing for the padding row


def test_enforce_eager_is_validated():
    from app.engine.types.engine_config import EngineConfig
    from app.engine.types.errors import LocalbatchError

    with pytest.raises(LocalbatchError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes").validate()


@pytest.mark.cuda
@needs_cuda
def test_cuda_graphs_captured_and_equal_eager(tiny_gguf_factory):
    """Graph replays and --enforce-eager run the same padded buckets: identical tokens and logprobs."""
    path = tiny_gguf_factory("gemma3")
    reqs = prompts(7, seed=3)

    def engine(**kw):
        return make_engine(path, device="cuda", dtype="bfloat16", block_size=16, kv_cache_blocks=128,
                           max_num_seqs=16, enable_prefix_caching=False, **kw)

    def run(e):
        seqs = [e.add_request(p, SamplingParams(max_tokens=20, logprobs=3, **GREEDY)) for p in reqs]
        while e.has_unfinished():
            e.step()
        return [(s.output_token_ids, s.logprobs) for s in seqs]

    eager, graphed = engine(enforce_eager=True), engine()
    assert eager.runner.graphs.graphs == {}
    assert sorted(graphed.runner.graphs.graphs) == [1, 2, 4, 8, 16]
    assert run(graphed) == run(eager)


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_replay_is_bitwise_eager(tiny_gguf_factory):
    """A replay and the same padded bucket run eagerly give identical hidden states."""
    engine = make_engine(tiny_gguf_factory("llama"), device="cuda", dtype="bfloat16", block_size=16,
                         kv_cache_blocks=64, max_num_seqs=8)
    graphs = engine.worker.runner.graphs
    n = 5  # bucket 8
    ids, pos = torch.arange(n) + 3, torch.arange(n) * 3  # sequence i: block i, positions < 16
    slots = torch.arange(n) * 16 + pos
    seq_lens = (pos + 1).to(torch.int32)
    table = torch.arange(n, dtype=torch.int32).view(n, 1)
    replayed = graphs.run(ids, pos, decode_meta(slots, seq_lens, table)).clone()
    eager = graphs._forward(8)[:n]  # the same static inputs, launched op by op
    assert torch.equal(replayed, eager)


def test_memory_probe_runs_the_biggest_step(model_path, monkeypatch):
    """The warm-up that sizes the CUDA pool: a full token budget spread over max_num_seqs prompts,
    so the peak it measures includes a full batch of logits and sampling."""
    from app.engine.runtime import model_runner

    engine = make_engine(model_path, max_num_batched_tokens=50, max_num_seqs=7)
    seen = []
    real_run = model_runner.ModelRunner.run
    monkeypatch.setattr(model_runner.ModelRunner, "run", lambda self, batch: seen.append(batch) or real_run(self, batch))
    engine.worker.profile_run()
    (batch,) = seen
    assert len(batch) == 7 and batch.total_tokens == 50
    assert batch.seqs[0].params.prompt_logprobs == 1  # one slice of prompt-logprob logits too
    blocks = [b for s in batch.seqs for table in s.block_tables for b in table]
    assert len(blocks) == len(set(blocks))  # no two warm-up prompts share a block


def test_memory_probe_prompts_fit_the_context(tiny_gguf_factory):
    engine = make_engine(tiny_gguf_factory("gemma3"), max_num_batched_tokens=2000, max_num_seqs=2)
    engine.worker.profile_run()  # two prompts of 1000 tokens would run past the 256-token RoPE table


def test_cli_enforce_eager_flag():
    from app.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["bench", "--enforce-eager"])
    assert engine_kwargs(args)["enforce_eager"] is True
    assert "enforce_eager" not in engine_kwargs(build_parser().parse_args(["bench"]))
