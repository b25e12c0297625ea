"""The device side of the engine (vLLM's worker): the device and its threads, the model (and a
draft model) loaded onto it, the KV pool sized to the memory left and allocated in a `ModelRunner`,
and each scheduled step run there.

What the worker decides at load (the device, the step's token budget, the model and its context,
the KV layout) is its `WorkerPlan`, frozen; the `EngineConfig` it was given stays as the caller
wrote it.

A step reads the scheduler's sequences through `ScheduledSequence` and writes none of them: what it
computed, and which sequences failed even when run alone, come back in its `StepOutput`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.engine.gguf.loader import LoadedModel, load_gguf
from app.engine.gguf.model_config import ModelConfig
from app.engine.runtime.decoder import DecoderLM
from app.engine.runtime.device import DeviceSetup, kv_pool_blocks, resolve_device
from app.engine.runtime.draft_model import DraftModel
from app.engine.runtime.kv_cache_spec import KVCacheSpec, kv_cache_spec
from app.engine.runtime.kv_pool import kv_sizes, resolve_kv_cache_dtype
from app.engine.runtime.model_runner import ModelRunner, StepOutput
from app.engine.runtime.weight_forms import takes_groups
from app.engine.text.tokenizer import Tokenizer
from app.engine.types.batch import ScheduledBatch
from app.engine.types.engine_config import EngineConfig
from app.engine.types.errors import LocalbatchError
from app.engine.types.outputs import TopLogprobs
from app.engine.types.progress import ProgressFn
from app.engine.types.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """What the worker decided at load, read by the engine and its users."""

    setup: DeviceSetup
    kv_dtype: torch.dtype  # the KV cache's storage dtype
    max_num_batched_tokens: int  # the step's token budget: the config's, or the device's default
    long_prefill_token_threshold: int  # the config's, or a quarter of the budget
    model_name: str
    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None for random weights: token-id prompts only
    max_model_len: int  # the context: the config's cap on the model's
    kv_spec: KVCacheSpec
    kv_bytes_per_token: int  # in every layer


@dataclass
class ProbeSequence:
    """A prompt of the memory probe: the scheduler's sequences, as the runner reads them."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    block_tables: list[list[int]]
    num_computed_tokens: int = 0
    grammar: Any = None
    spec_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TopLogprobs | None] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return 0

    @property
    def output_token_ids(self) -> list[int]:
        return []


class Worker:
    """`Worker(config, device, dtype)` takes the device; then `load_model()` (which returns the
    `plan`), `determine_num_blocks()`, `initialize_kv_cache()` and `warm_up()`, in that order; then
    `execute_model()` every step."""

    def __init__(self, config: EngineConfig, device: str = "auto", dtype: str = "auto") -> None:
        self.config = config
        self.setup: DeviceSetup = resolve_device(device, dtype)
        # Before loading weights: an impossible kv_cache_dtype (fp8 on a CPU) fails at once.
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.setup.dtype, self.setup.device)
        if config.num_threads is not None and self.setup.device.type == "cpu":
            torch.set_num_threads(config.num_threads)  # the step thread's count: the engine is built there
        self.model: DecoderLM | None = None  # once loaded
        self.plan: WorkerPlan | None = None  # once loaded
        self.runner: ModelRunner | None = None  # once the pool is sized
        self.model_path = None  # the GGUF file loaded (None: random weights)

    # ---- loading ------------------------------------------------------------------------------
    def load_model(self, model: str | None, random_weights: str | None, progress: ProgressFn | None) -> WorkerPlan:
        """The model's weights and tokenizer: a catalog name, a path or None (the default model);
        or, with `random_weights`, a random model of that spec (token-id prompts only)."""
        if random_weights is not None:
            model_config, model_name, tokenizer = self._init_random(random_weights)
        else:
            model_config, model_name, tokenizer = self._init_from_file(model, progress)
        cfg = self.config
        budget = cfg.max_num_batched_tokens or (8192 if self.setup.device.type == "cuda" else 512)
        threshold = cfg.long_prefill_token_threshold
        max_position = model_config.max_position
        self.plan = WorkerPlan(
            setup=self.setup, kv_dtype=self.kv_dtype, max_num_batched_tokens=budget,
            long_prefill_token_threshold=budget // 4 if threshold is None else threshold,
            model_name=model_name, model_config=model_config, tokenizer=tokenizer,
            max_model_len=min(cfg.max_model_len or max_position, max_position),
            kv_spec=kv_cache_spec(model_config, cfg.block_size, hybrid=not cfg.disable_hybrid_kv_cache_manager),
            kv_bytes_per_token=model_config.kv_bytes_per_token(**kv_sizes(self.kv_dtype)),
        )
        return self.plan

    def _init_from_file(self, model: str | None,
                        progress: ProgressFn | None) -> tuple[ModelConfig, str, Tokenizer | None]:
        from app.engine.gguf.catalog import catalog_name, resolve_model

        path = resolve_model(model, progress)  # a catalog name, a path, or None: the default
        if path is None:
            from app.engine.gguf.default_model import default_model_path

            path = default_model_path(progress=progress)
        loaded = self._read(path, progress)
        self.model_path = loaded.path
        self.model = self._decoder(loaded)
        name = catalog_name(loaded.path) or str(loaded.metadata.get("general.name") or loaded.path.stem)
        return loaded.config, name, Tokenizer.from_gguf_metadata(loaded.metadata)

    def _read(self, path: str, progress: ProgressFn | None) -> LoadedModel:
        """A GGUF's weights for this device and dtype (4/5-bit matrices as their blocks' groups where
        the kernels take them)."""
        grids = takes_groups(self.setup.device, self.setup.dtype)
        return load_gguf(path, self.setup.device, self.setup.dtype, progress, grids=grids)

    def _decoder(self, loaded: LoadedModel) -> DecoderLM:
        grids = loaded.grids if takes_groups(self.setup.device, self.setup.dtype) else None
        return DecoderLM(loaded.config, loaded.weights, self.setup.device, grids, self.kv_dtype)

    def _init_random(self, spec: str) -> tuple[ModelConfig, str, Tokenizer | None]:
        from app.engine.gguf.random_weights import random_model

        cfg, weights = random_model(spec, self.setup.device, self.setup.dtype)
        self.model = DecoderLM(cfg, weights, self.setup.device, kv_dtype=self.kv_dtype)
        return cfg, cfg.name, None  # no tokenizer: token-id prompts only

    def load_draft_model(self, name: str, num_blocks: int) -> DraftModel:
        """A draft model for speculative decoding, with its own pool of `num_blocks` blocks; refused
        unless it shares the target's vocabulary (its token ids are verified as the target's) and
        block tables (the target has no sliding-window groups)."""
        from app.engine.gguf.catalog import resolve_model

        plan = self.plan
        if plan.kv_spec.is_hybrid:
            raise LocalbatchError(f"{plan.model_name} has sliding-window layers: draft models need one block table; "
                                  "use {\"method\": \"ngram\"}")
        loaded = self._read(resolve_model(name, None), None)
        if loaded.config.vocab_size != plan.model_config.vocab_size:
            raise LocalbatchError(f"draft model {name} has a vocabulary of {loaded.config.vocab_size} tokens, "
                                  f"{plan.model_name} {plan.model_config.vocab_size}: they must share one")
        draft_tokens = list(loaded.metadata.get("tokenizer.ggml.tokens") or [])
        if plan.tokenizer is not None and draft_tokens[:4096] != plan.tokenizer.tokens[:4096]:
            raise LocalbatchError(f"draft model {name} has another tokenizer than {plan.model_name}")
        return DraftModel(self._decoder(loaded), num_blocks, self.config.block_size)

    @property
    def backend(self) -> str:
        """Which kernels compute, for people: the device's choice and what this model's plan left to torch."""
        return self.model.plan.describe(self.setup.backend)

    # ---- the KV pool --------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        """Pool blocks for the KV cache: see `device.kv_pool_blocks` (on CUDA it runs `profile_run`)."""
        cfg, plan = self.config, self.plan
        # A pool block holds block_size tokens of one group's layers (layers_per_block of them).
        page_bytes_per_token = plan.kv_bytes_per_token * plan.kv_spec.layers_per_block // plan.model_config.num_layers
        # No more than every sequence at the full context can hold, in every group's blocks.
        max_needed = cfg.max_num_seqs * -(-plan.max_model_len // cfg.block_size) * len(plan.kv_spec.groups)
        return kv_pool_blocks(cfg, self.setup, page_bytes_per_token, self.profile_run, max_needed)

    def profile_run(self) -> None:
        """The CUDA memory probe: the biggest step the scheduler can make, on a throwaway pool:
        max_num_batched_tokens tokens over max_num_seqs prompts (none longer than the context), so
        the peak includes the activations of a full token budget, the logits and sampling of a full
        batch, and one slice of prompt-logprob logits."""
        bs, plan = self.config.block_size, self.plan
        n = plan.max_num_batched_tokens
        num_seqs = min(self.config.max_num_seqs, n)
        lengths = [min(n // num_seqs + (i < n % num_seqs), plan.max_model_len) for i in range(num_seqs)]
        batch = ScheduledBatch()
        next_block = 0
        for i, length in enumerate(lengths):
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1 if i == 0 else None)
            seq = ProbeSequence(f"warmup-{i}", [0] * length, params, [])
            for _ in range(plan.kv_spec.num_groups):
                seq.block_tables.append(list(range(next_block, next_block + -(-length // bs))))
                next_block += len(seq.block_tables[-1])
            batch.add(seq, length)
        runner = ModelRunner(self.model, next_block, bs, plan.kv_spec)
        runner.run(batch)
        del runner

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner = ModelRunner(self.model, num_blocks, self.config.block_size, self.plan.kv_spec)

    def warm_up(self, progress: ProgressFn | None) -> None:
        """On CUDA, decode steps on static buffers, captured as CUDA graphs unless `enforce_eager`."""
        if self.setup.device.type == "cuda":
            if progress and not self.config.enforce_eager:
                progress("capturing CUDA graphs", None)
            self.runner.setup_decode_graphs(self.config.max_num_seqs, self.plan.max_model_len,
                                            not self.config.enforce_eager)

    # ---- the step -----------------------------------------------------------------------------
    def execute_model(self, batch: ScheduledBatch, on_launched: Callable[[], None] | None = None) -> StepOutput:
        """The step's forward and sampling. `on_launched`: see `ModelRunner.run` (not called for a
        step that runs no model, or once a failed step is retried one sequence at a time)."""
        if not batch.seqs:
            return StepOutput({}, {})
        try:
            return self.runner.run(batch, on_launched)
        except Exception:  # noqa: BLE001 - one bad request must not fail the others or the engine
            log.exception("step failed; retrying its sequences one by one")
            return self._run_isolated(batch)

    def _run_isolated(self, batch: ScheduledBatch) -> StepOutput:
        """Re-run each sequence of a failed step alone; those that fail again are in `errors`.

        Safe because nothing was committed: a sequence's computed-token count only moves after a
        successful step, and re-writing its KV slots writes the same values."""
        merged = StepOutput({}, {})
        for seq, n in zip(list(batch.seqs), list(batch.num_tokens)):
            solo = ScheduledBatch()
            solo.add(seq, n)
            try:
                out = self.runner.run(solo)
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed", seq.request_id)
                merged.errors[seq.request_id] = f"engine error: {type(e).__name__}: {e}"
                continue
            merged.sampled.update(out.sampled)
            merged.logprobs.update(out.logprobs)
            merged.prompt_logprobs.update(out.prompt_logprobs)
        return merged
