"""LLMEngine: puts the engine together (a `Worker` that holds the model and the KV pool, the
`InputProcessor` that makes requests into sequences, the `Scheduler` that owns them) and runs it:
`step()` advances every live request by one packed forward pass. Single-threaded: `AsyncEngine`
drives it from its own thread (`make_sequence` excepted: it is safe from any thread).

What the worker decided at load (device, model, context, KV layout, the step's token budget) is
`engine.plan`; the model and the KV pool are `engine.worker.model` and `engine.worker.runner`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from app.engine.core.block_manager import BlockManager
from app.engine.core.input_processor import InputProcessor
from app.engine.core.kv_disk_cache import open_disk_tier
from app.engine.core.metrics import EngineMetrics
from app.engine.core.output_processor import OutputProcessor
from app.engine.core.scheduler import Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence
from app.engine.core.speculator import Speculator
from app.engine.core.step_budget import PrefillBudget
from app.engine.runtime.model_runner import StepOutput
from app.engine.runtime.threads import ThreadTuner
from app.engine.runtime.worker import Worker
from app.engine.types.batch import ScheduledBatch
from app.engine.types.engine_config import EngineConfig
from app.engine.types.errors import LocalbatchError
from app.engine.types.outputs import EngineStats, StreamDelta
from app.engine.types.progress import ProgressFn
from app.engine.types.prompt import Prompt
from app.engine.types.sampling_params import SamplingParams

# A step with nothing to run while prompts wait on the disk tier waits this long for a read at most.
_IDLE_READ_WAIT_S = 0.02


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
        cfg = self.config = EngineConfig(**engine_kwargs)
        cfg.validate()
        self.worker = Worker(cfg, device, dtype)
        adaptive = cfg.adaptive_threads and cfg.num_threads is None and self.worker.setup.device.type == "cpu"
        self.thread_tuner: ThreadTuner | None = ThreadTuner() if adaptive else None
        plan = self.plan = self.worker.load_model(model, random_weights, progress)
        if progress:
            progress("sizing the KV pool", None)
        num_blocks = self.worker.determine_num_blocks()
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, plan.kv_spec)
        self.speculator = self._build_speculator(num_blocks)
        self.outputs = OutputProcessor(plan.tokenizer, plan.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(plan.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_waiting,
                                                   plan.long_prefill_token_threshold),
                                   self.block_manager, self.speculator, self._prefill_budget(), self.outputs)
        self.worker.initialize_kv_cache(num_blocks)
        self.block_manager.disk = open_disk_tier(cfg, self.worker)  # the prefix cache's disk tier
        self.metrics = EngineMetrics.of(self.worker)
        self._unfinished_since: float | None = None  # when the last step ended with requests left
        pool_tokens = plan.kv_spec.max_tokens(num_blocks, plan.max_num_batched_tokens)  # a chunk's window blocks too
        self.inputs = InputProcessor(plan.tokenizer, plan.model_config.vocab_size, plan.max_model_len, pool_tokens)
        self.worker.warm_up(progress)

    def _prefill_budget(self) -> PrefillBudget:
        """The prompt-token budget beside decodes, the scheduler's; by default on a CPU only (a GPU's
        decode steps take milliseconds: a 60 ms floor would cut its chunks for no gain measured)."""
        ms = self.config.itl_target_ms
        if ms is None and self.worker.setup.device.type != "cpu":
            ms = 0
        target = None if ms is None else ms / 1e3
        return PrefillBudget(self.plan.max_num_batched_tokens, target, min_chunk=self.config.block_size)

    def _build_speculator(self, num_blocks: int) -> Speculator | None:
        config = self.config.speculative_config
        if config is None:
            return None
        draft = self.worker.load_draft_model(config.model, num_blocks) if config.model is not None else None
        return Speculator(config, self.plan.max_model_len, draft)

    # ---- requests -----------------------------------------------------------------------------
    def make_sequence(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and tokenize a request without touching engine state (safe from any thread).
        Raises RequestError naming the problem."""
        return self.inputs.make_sequence(prompt, params, request_id)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a prepared sequence. Raises RequestError (id in use) or QueueFullError."""
        self.scheduler.add(seq)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate and queue a request. Raises RequestError / QueueFullError; nothing is queued then."""
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> StreamDelta | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        if not self.has_unfinished():  # idle until the next request: no gap to count
            self._unfinished_since = None
        return self.outputs.delta(seq)

    def close(self) -> None:
        """Write the disk tier's queued blocks (a clean exit keeps what was read this run)."""
        bm = self.block_manager
        bm.finish_reads()
        if bm.disk is not None:
            bm.disk.close()

    def clear_kv_disk_cache(self) -> str:
        """Remove the disk tier's files once its queued writes are done (so none lands after)."""
        disk = self.block_manager.disk
        if disk is None or disk.store is None:
            return f"The KV disk cache is off ({disk.reason if disk else 'not set up'}): nothing to clear"
        disk.flush()
        files, nbytes = disk.clear()
        return f"Cleared the KV disk cache: {files:,} files, {nbytes / 1e6:,.1f} MB ({disk.store.dir})"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def set_speculation(self, enabled: bool) -> bool:
        """Speculative decoding on or off from the next step on; False without a speculator."""
        if self.speculator is None:
            return False
        self.speculator.enabled = enabled
        return True

    # ---- the step -----------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[StreamDelta]:
        """One packed step. `on_launched`: see `Worker.execute_model`."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs and self.block_manager.num_pending_reads:
            self.block_manager.wait_reads(_IDLE_READ_WAIT_S)  # nothing to step but a read from disk
        output = self.worker.execute_model(batch, on_launched)
        deltas = self.outputs.deltas(self.scheduler.update_from_output(batch, output))
        self._observe(batch, output, start)
        return deltas

    def _observe(self, batch: ScheduledBatch, output: StepOutput, start: float) -> None:
        """A finished step's figures, for the stats and for what adapts to step times."""
        gap = None if self._unfinished_since is None else start - self._unfinished_since
        elapsed = time.perf_counter() - start
        self._unfinished_since = start + elapsed if self.has_unfinished() else None
        self.metrics.record_step(batch, output.sampled, elapsed, gap)
        self.scheduler.observe_step(batch, elapsed)
        if self.speculator is not None:
            self.speculator.observe(batch, elapsed)
        if self.thread_tuner is not None and batch.seqs and all(n == 1 for n in batch.num_tokens):
            self.thread_tuner.observe(len(batch.seqs), elapsed)  # decode steps only: comparable

    def stats(self) -> EngineStats:
        spec = self.speculator.stats() if self.speculator is not None else None
        return self.metrics.snapshot(self.scheduler, self.block_manager, spec)
