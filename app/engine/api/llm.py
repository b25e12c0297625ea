"""Offline batch generation on the continuous-batching engine."""

from __future__ import annotations

from typing import Any

from app.engine.core.llm_engine import LLMEngine
from app.engine.types.outputs import RequestOutput
from app.engine.types.progress import ProgressFn
from app.engine.types.sampling_params import SamplingParams

PromptInput = str | list[int]


class LLM:
    """`LLM(model=None)` loads the default model (the first pulled chat model, else the embedded one).
    Keyword settings are `EngineConfig`'s."""

    def __init__(
        self, model: str | None = None, device: str = "auto", dtype: str = "auto",
        progress: ProgressFn | None = None, **engine_kwargs: Any,
    ) -> None:
        self.engine = LLMEngine(model, device=device, dtype=dtype, progress=progress, **engine_kwargs)
        self.tokenizer = self.engine.plan.tokenizer

    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs come back in prompt order.

        Constraints (`json_schema`, `json_object`, `regex`, `grammar`, `structural_tag`) and
        `logit_bias` ride on each prompt's SamplingParams; every request is validated, and its
        grammar compiled, before any runs, so a bad one raises `RequestError` and nothing runs."""
        prompts = _as_prompt_list(prompts)
        params = params if params is not None else SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        engine = self.engine
        seqs = [engine.make_sequence(p, sp) for p, sp in zip(prompts, param_list)]  # all validated first
        texts = {s.request_id: [] for s in seqs}
        pending = list(seqs)
        while pending or engine.has_unfinished():
            # Feed the queue as it drains, so a batch larger than max_waiting still runs.
            while pending and len(engine.scheduler.waiting) < engine.config.max_waiting:
                engine.add_sequence(pending.pop(0))
            for delta in engine.step():
                texts[delta.request_id].append(delta.text)
        return [
            RequestOutput(
                request_id=s.request_id,
                prompt_token_ids=s.prompt_token_ids,
                token_ids=s.output_token_ids,
                text="".join(texts[s.request_id]),
                finish_reason=s.finish_reason,
                prompt_logprobs=s.prompt_logprobs if s.params.prompt_logprobs is not None else None,
                logprobs=s.logprobs if s.params.logprobs is not None else None,
                error=s.error,
            )
            for s in seqs
        ]


def _as_prompt_list(prompts: PromptInput | list[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)
