"""LLMEngine: owns the model, the KV pool and the scheduler; `step()` advances every live request
by one packed forward pass. Single-threaded: `AsyncEngine` drives it from its own thread."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from app.engine.core.block_manager import BlockManager
from app.engine.core.metrics import EngineMetrics, KVCacheInfo, MemoryTraffic
from app.engine.core.output_processor import OutputProcessor
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence
from app.engine.core.speculator import Speculator
from app.engine.core.step_budget import PrefillBudget
from app.engine.gguf.loader import LoadedModel, load_gguf
from app.engine.runtime.decoder import DecoderLM
from app.engine.runtime.device import DeviceSetup, copy_bandwidth, kv_pool_blocks, resolve_device
from app.engine.runtime.kv_cache_spec import kv_cache_spec
from app.engine.runtime.kv_pool import kv_sizes, resolve_kv_cache_dtype
from app.engine.runtime.linear import takes_grids
from app.engine.runtime.model_runner import ModelRunner, StepOutput
from app.engine.runtime.threads import ThreadTuner
from app.engine.structured.compiler import ConstraintCompiler
from app.engine.text.tokenizer import Tokenizer
from app.engine.types.batch import ScheduledBatch
from app.engine.types.engine_config import EngineConfig
from app.engine.types.errors import LocalbatchError, RequestError
from app.engine.types.outputs import EngineStats, StreamDelta
from app.engine.types.progress import ProgressFn
from app.engine.types.prompt import Prompt
from app.engine.types.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        progress: ProgressFn | None = None,
        random_weights: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        unknown = set(engine_kwargs) - set(EngineConfig.names())
        if unknown:
            raise LocalbatchError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(**engine_kwargs)
        self.config.validate()
        self.setup: DeviceSetup = resolve_device(device, dtype)
        # Before loading weights: an impossible kv_cache_dtype (fp8 on a CPU) fails at once.
        self.kv_dtype = resolve_kv_cache_dtype(self.config.kv_cache_dtype, self.setup.dtype, self.setup.device)
        if self.config.num_threads is not None and self.setup.device.type == "cpu":
            torch.set_num_threads(self.config.num_threads)  # the step thread's count: the engine is built there
        adaptive = self.config.adaptive_threads and self.config.num_threads is None and self.setup.device.type == "cpu"
        self.thread_tuner: ThreadTuner | None = ThreadTuner() if adaptive else None
        if random_weights is not None:
            self._init_random(random_weights)
        else:
            self._init_from_file(model, progress)
        max_position = self.model_config.max_position
        self.max_model_len = min(self.config.max_model_len or max_position, max_position)
        if self.config.max_num_batched_tokens is None:
            self.config.max_num_batched_tokens = 8192 if self.setup.device.type == "cuda" else 512
        if progress:
            progress("sizing the KV pool", None)
        self._build_pool()
        if self.setup.device.type == "cuda":
            if progress and not self.config.enforce_eager:
                progress("capturing CUDA graphs", None)
            self.runner.setup_decode_graphs(self.config.max_num_seqs, self.max_model_len, not self.config.enforce_eager)

    def _init_from_file(self, model: str | None, progress: ProgressFn | None) -> None:
        from app.engine.gguf.catalog import catalog_name, resolve_model

        path = resolve_model(model, progress)  # a catalog name, a path, or None: the default
        if path is None:
            from app.engine.gguf.default_model import default_model_path

            path = default_model_path(progress=progress)
        loaded = self._read(path, progress)
        self.model_config = loaded.config
        self.model_name = catalog_name(loaded.path) or str(loaded.metadata.get("general.name") or loaded.path.stem)
        self.tokenizer: Tokenizer | None = Tokenizer.from_gguf_metadata(loaded.metadata)
        self.model = self._decoder(loaded)

    def _read(self, path: str, progress: ProgressFn | None) -> LoadedModel:
        """A GGUF's weights for this device and dtype (4/5-bit matrices as their blocks' groups where
        the kernels take them)."""
        grids = takes_grids(self.setup.device, self.setup.dtype)
        return load_gguf(path, self.setup.device, self.setup.dtype, progress, grids=grids)

    def _decoder(self, loaded: LoadedModel) -> DecoderLM:
        grids = loaded.grids if takes_grids(self.setup.device, self.setup.dtype) else None
        return DecoderLM(loaded.config, loaded.weights, self.setup.device, grids, self.kv_dtype)

    def _init_random(self, spec: str) -> None:
        from app.engine.gguf.random_weights import random_model

        cfg, weights = random_model(spec, self.setup.device, self.setup.dtype)
        self.model_config = cfg
        self.model_name = cfg.name
        self.tokenizer = None  # token-id prompts only
        self.model = DecoderLM(cfg, weights, self.setup.device, kv_dtype=self.kv_dtype)

    def _build_pool(self) -> None:
        cfg = self.config
        kv_dtype = self.kv_dtype
        self.kv_spec = kv_cache_spec(self.model_config, cfg.block_size, hybrid=not cfg.disable_hybrid_kv_cache_manager)
        self.kv_bytes_per_token = self.model_config.kv_bytes_per_token(**kv_sizes(kv_dtype))
        # A pool block holds block_size tokens of one group's layers (layers_per_block of them).
        page_bytes_per_token = self.kv_bytes_per_token * self.kv_spec.layers_per_block // self.model_config.num_layers
        # No more than every sequence at the full context can hold, in every group's blocks.
        max_needed = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size) * len(self.kv_spec.groups)
        num_blocks = kv_pool_blocks(cfg, self.setup, page_bytes_per_token, self._warmup, max_needed)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, self.kv_spec)
        self.speculator = self._build_speculator(num_blocks)
        target = None if cfg.itl_target_ms is None else cfg.itl_target_ms / 1e3
        self.prefill_budget = PrefillBudget(cfg.max_num_batched_tokens, target)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_waiting), self.block_manager,
            self.speculator.lookahead if self.speculator is not None else None, self.prefill_budget.cap,
        )
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, self.kv_spec)
        self.metrics = EngineMetrics(self._kv_info(), self._memory_traffic(kv_dtype))
        self._unfinished_since: float | None = None  # when the last step ended with requests left
        self.outputs = OutputProcessor(self.tokenizer)
        self.constraints = ConstraintCompiler(self.tokenizer, self.model_config.vocab_size)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()

    def _build_speculator(self, num_blocks: int) -> Speculator | None:
        config = self.config.speculative_config
        if config is None:
            return None
        if config.model is None:
            return Speculator(config, self.max_model_len)
        from app.engine.runtime.draft_model import DraftModel

        return Speculator(config, self.max_model_len, DraftModel(self._load_draft(config.model), num_blocks,
                                                                 self.config.block_size))

    def _load_draft(self, name: str) -> DecoderLM:
        """The draft model's weights; refused unless it shares the target's vocabulary (its token ids
        are verified as the target's) and block tables (the target has no sliding-window groups)."""
        from app.engine.gguf.catalog import resolve_model

        if self.kv_spec.is_hybrid:
            raise LocalbatchError(f"{self.model_name} has sliding-window layers: draft models need one block table; "
                                  "use {\"method\": \"ngram\"}")
        loaded = self._read(resolve_model(name, None), None)
        if loaded.config.vocab_size != self.model_config.vocab_size:
            raise LocalbatchError(f"draft model {name} has a vocabulary of {loaded.config.vocab_size} tokens, "
                                  f"{self.model_name} {self.model_config.vocab_size}: they must share one")
        draft_tokens = list(loaded.metadata.get("tokenizer.ggml.tokens") or [])
        if self.tokenizer is not None and draft_tokens[:4096] != self.tokenizer.tokens[:4096]:
            raise LocalbatchError(f"draft model {name} has another tokenizer than {self.model_name}")
        return self._decoder(loaded)

    @property
    def backend(self) -> str:
        """Which kernels compute, for people: the device's choice and what this model's plan left to torch."""
        return self.model.plan.describe(self.setup.backend)

    def _kv_info(self) -> KVCacheInfo:
        full_layers = sum(len(g.layers) for g in self.kv_spec.groups if g.sliding_window is None)
        past_window = self.kv_bytes_per_token * full_layers // self.model_config.num_layers if self.kv_spec.is_hybrid else 0
        return KVCacheInfo(str(self.kv_dtype).removeprefix("torch."), self.kv_bytes_per_token, past_window)

    def _memory_traffic(self, kv_dtype: torch.dtype) -> MemoryTraffic:
        return MemoryTraffic(
            weight_bytes_per_step=self.model.weight_bytes_per_step,
            copy_bandwidth=copy_bandwidth(self.setup.device),
            kv_bytes_read=functools.partial(self.model_config.kv_bytes_read, **kv_sizes(kv_dtype)),
        )

    def _warmup(self) -> None:
        """The CUDA memory probe: the biggest step the scheduler can make, on a throwaway pool:
        max_num_batched_tokens tokens over max_num_seqs prompts (none longer than the context), so
        the peak includes the activations of a full token budget, the logits and sampling of a full
        batch, and one slice of prompt-logprob logits."""
        bs = self.config.block_size
        n = self.config.max_num_batched_tokens
        num_seqs = min(self.config.max_num_seqs, n)
        lengths = [min(n // num_seqs + (i < n % num_seqs), self.max_model_len) for i in range(num_seqs)]
        batch = ScheduledBatch()
        next_block = 0
        for i, length in enumerate(lengths):
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1 if i == 0 else None)
            seq = Sequence(f"warmup-{i}", [0] * length, params, 1)
            for _ in range(self.kv_spec.num_groups):
                seq.block_tables.append(list(range(next_block, next_block + -(-length // bs))))
                next_block += len(seq.block_tables[-1])
            batch.add(seq, length)
        runner = ModelRunner(self.model, next_block, bs, self.kv_spec)
        runner.run(batch)
        del runner

    # ---- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty", param="prompt")
            return self.require_tokenizer().encode(prompt, add_bos=True)
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("the prompt must be a non-empty string, token id list or message list", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is out of range [0, {vocab})", param="prompt")
            return list(prompt)
        if all(isinstance(m, dict) for m in prompt):
            return self.require_tokenizer().encode_chat(prompt, add_generation_prompt=True)
        raise RequestError("the prompt must be a string, a list of token ids or a list of messages", param="prompt")

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError("this engine has random weights and no tokenizer: send token ids", param="prompt")
        return self.tokenizer

    def make_sequence(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and tokenize a request without touching engine state (safe from any thread).
        Raises RequestError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling params must be a SamplingParams", param="params")
        params.validate()
        params.check_token_ids(self.model_config.vocab_size)
        ids = self.tokenize_prompt(prompt)
        max_tokens = self._check_fits(len(ids), params)
        seq = Sequence(request_id or f"req-{next(self._ids)}", ids, params, max_tokens)
        seq.grammar = self.constraints.matcher_for(params)  # compiled here, off the step thread (cached)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a prepared sequence. Raises RequestError (id in use) or QueueFullError."""
        if seq.request_id in self.seqs:
            raise RequestError(f"request id {seq.request_id!r} is already in use", param="request_id")
        self.scheduler.add(seq)
        self.seqs[seq.request_id] = seq
        self.outputs.add(seq)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and queue a request. Raises RequestError / QueueFullError; nothing is queued then."""
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq

    def _check_fits(self, num_prompt: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise RequestError(
                f"the prompt has {num_prompt} tokens but the context holds {limit} (and at least one must be generated)",
                param="prompt",
            )
        # A prefill chunk holds its sliding-window blocks until the step ends: count the biggest.
        pool_tokens = self.kv_spec.max_tokens(self.block_manager.num_blocks, self.config.max_num_batched_tokens)
        if params.max_tokens is None:
            max_tokens = min(limit, pool_tokens) - num_prompt
            if max_tokens < 1:
                raise RequestError(
                    f"the prompt has {num_prompt} tokens but the KV pool holds {pool_tokens}; "
                    "raise --kv-cache-bytes / --kv-cache-blocks", param="prompt")
            return max_tokens
        max_tokens = params.max_tokens
        if num_prompt + max_tokens > limit:
            raise RequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"exceeds the context length {limit}",
                param="max_tokens",
            )
        if num_prompt + max_tokens > pool_tokens:
            raise RequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) can never fit the KV pool of "
                f"{pool_tokens} tokens; raise --kv-cache-bytes / --kv-cache-blocks or lower max_tokens",
                param="max_tokens",
            )
        return max_tokens

    def abort(self, request_id: str) -> StreamDelta | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        if not self.has_unfinished():  # idle until the next request: no gap to count
            self._unfinished_since = None
        return self.outputs.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -----------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[StreamDelta]:
        """One packed step. `on_launched`: see `ModelRunner.run` (not called for a step that runs
        no model, or once a failed step is retried one sequence at a time)."""
        start = time.perf_counter()
        gap = None if self._unfinished_since is None else start - self._unfinished_since
        batch = self.scheduler.schedule()
        propose_s = self.speculator.propose(batch) if self.speculator is not None else 0.0
        output = self._run(batch, on_launched)
        deltas = self._postprocess(batch, output)
        elapsed = time.perf_counter() - start
        self._unfinished_since = start + elapsed if self.has_unfinished() else None
        self.metrics.record_step(batch, output.sampled, elapsed, gap)
        self.prefill_budget.observe(batch.num_decode_tokens, batch.total_tokens - batch.num_decode_tokens, elapsed)
        if self.speculator is not None:
            self.speculator.observe(batch, elapsed, propose_s)
        if self.thread_tuner is not None and batch.seqs and all(n == 1 for n in batch.num_tokens):
            self.thread_tuner.observe(len(batch.seqs), elapsed)  # decode steps only: comparable
        return deltas

    def _run(self, batch: ScheduledBatch, on_launched: Callable[[], None] | None = None) -> StepOutput:
        if not batch.seqs:
            return StepOutput({}, {})
        try:
            return self.runner.run(batch, on_launched)
        except Exception:  # noqa: BLE001 - one bad request must not fail the others or the engine
            log.exception("step failed; retrying its sequences one by one")
            return self._run_isolated(batch)

    def _run_isolated(self, batch: ScheduledBatch) -> StepOutput:
        """Re-run each sequence of a failed step alone and fail only those that fail again.

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
                seq.error = f"engine error: {type(e).__name__}: {e}"
                self.scheduler.finish(seq, "error")
                continue
            merged.sampled.update(out.sampled)
            merged.logprobs.update(out.logprobs)
            merged.prompt_logprobs.update(out.prompt_logprobs)
        return merged

    def _postprocess(self, batch: ScheduledBatch, output: StepOutput) -> list[StreamDelta]:
        deltas = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.is_finished:
                deltas.append(self._finish(seq))
                continue
            seq.prompt_logprobs.extend(output.prompt_logprobs.get(seq.request_id, ()))
            tokens = output.sampled.get(seq.request_id)
            if tokens is None:  # mid-prompt chunk
                seq.num_computed_tokens += n
                self._commit_blocks(seq)
                continue
            drafts = len(seq.spec_token_ids)
            seq.num_computed_tokens += n - drafts + len(tokens) - 1  # the kept drafts' KV is the real tokens'
            delta = self.outputs.on_tokens(seq, tokens, self.max_model_len, output.logprobs.get(seq.request_id))
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)  # a stop among the kept drafts
            if drafts:
                self.speculator.on_verified(seq, drafts, len(tokens) - 1)
            if self.speculator is not None:  # slots reserved for drafts that were rejected or never drafted
                self.block_manager.free_rejected_blocks(seq)
            self._commit_blocks(seq)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
                self.seqs.pop(seq.request_id, None)
            deltas.append(delta)
        return deltas

    def _commit_blocks(self, seq: Sequence) -> None:
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free_skipped_blocks(seq)

    def _finish(self, seq: Sequence) -> StreamDelta:
        self.seqs.pop(seq.request_id, None)
        return self.outputs.finish(seq)

    def stats(self) -> EngineStats:
        spec = self.speculator.stats() if self.speculator is not None else None
        return self.metrics.snapshot(self.scheduler, self.block_manager, spec)
