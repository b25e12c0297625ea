"""Per-request output handling: incremental text, stop conditions, and the deltas to publish.

Stop strings are not emitted: while a request runs, the last `len(longest stop) - 1` characters
are held back, since they could still turn out to be the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.core.sequence import Sequence
from app.engine.text.detokenizer import IncrementalDetokenizer
from app.engine.text.tokenizer import Tokenizer
from app.engine.types.outputs import StreamDelta, TopLogprobs


@dataclass
class _OutputState:
    detok: IncrementalDetokenizer | None  # None: no tokenizer (random weights), ids only
    stop_ids: set[int]
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    holdback: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _OutputState] = {}

    def add(self, seq: Sequence) -> None:
        p = seq.params
        stop_ids = set(p.stop_token_ids)
        detok = None
        if self.tokenizer is not None:
            if not p.ignore_eos:
                stop_ids |= set(self.tokenizer.stop_token_ids)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=seq.prompt_token_ids, skip_special_tokens=True)
        self.states[seq.request_id] = _OutputState(
            detok=detok,
            stop_ids=stop_ids,
            holdback=max((len(s) for s in p.stop), default=1) - 1,
        )

    def on_tokens(self, seq: Sequence, tokens: list[int], max_model_len: int,
                  logprobs: list[TopLogprobs] | None = None) -> StreamDelta:
        """Append a step's new tokens (one, or a speculating sequence's kept drafts and one more),
        with their logprobs if asked, up to the first that finishes the request; sets
        `seq.finish_reason` then. One delta for all."""
        st = self.states[seq.request_id]
        for i, token in enumerate(tokens):
            seq.append_token(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            self._account(seq, st, token, max_model_len)
            if seq.finish_reason is not None:
                break
        return self._delta(seq, st)

    def _account(self, seq: Sequence, st: _OutputState, token: int, max_model_len: int) -> None:
        if seq.grammar is not None and not seq.grammar.accept(token):
            return self._reject(seq, token)
        if token in st.stop_ids:
            seq.finish_reason = "stop"
        elif st.detok is not None:
            st.text += st.detok.add([token])
            if seq.params.stop and self._find_stop(seq, st):
                seq.finish_reason = "stop"
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_terminated:
            seq.finish_reason = "stop"  # the grammar is complete and took its stop token
        if seq.finish_reason is None and (seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason == "length" and st.detok is not None:
            st.text += st.detok.flush()  # an unfinished UTF-8 character shows as U+FFFD, as decode() would

    @staticmethod
    def _reject(seq: Sequence, token: int) -> None:
        # The mask allows only tokens the grammar accepts, so this means a grammar no token of the
        # vocabulary can continue: end the request rather than stream output that breaks it.
        seq.error = f"structured output: no token of this vocabulary continues the grammar (sampled {token})"
        seq.finish_reason = "error"

    def finish(self, seq: Sequence) -> StreamDelta:
        """The final delta of a request ended from outside (abort, engine error)."""
        seq.grammar = None
        st = self.states.get(seq.request_id)
        if st is None:
            return StreamDelta(seq.request_id, "", [], seq.finish_reason or "abort", error=seq.error)
        return self._delta(seq, st)

    def _find_stop(self, seq: Sequence, st: _OutputState) -> bool:
        # Only the new text (plus a stop's length of overlap) can hold a stop string that was not there before.
        window_start = max(0, st.sent_chars - st.holdback - 1)
        hits = [i for s in seq.params.stop if (i := st.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        st.text = st.text[: min(hits)]
        return True

    def _delta(self, seq: Sequence, st: _OutputState) -> StreamDelta:
        done = seq.finish_reason is not None
        end = len(st.text) if done else max(st.sent_chars, len(st.text) - st.holdback)
        text = st.text[st.sent_chars : end]
        st.sent_chars = end
        new_ids = seq.token_ids[seq.num_prompt_tokens + st.sent_tokens :]  # not output_token_ids: O(new), not O(all)
        logprobs = seq.logprobs[st.sent_tokens :] if seq.params.logprobs is not None else None
        st.sent_tokens = seq.num_output_tokens
        if done:
            self.states.pop(seq.request_id, None)
            seq.grammar = None  # a finished request's matcher is not needed again
        return StreamDelta(
            request_id=seq.request_id,
            text=text,
            token_ids=new_ids,
            finish_reason=seq.finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            error=seq.error,
            num_cached_tokens=seq.num_cached_tokens,
        )
