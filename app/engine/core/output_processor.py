"""Per-request output handling: incremental text, stop conditions, and the deltas to publish.

It writes only its own per-request state (the text so far and what was sent). The scheduler, which
appends a step's tokens, asks `check_token` whether one ends the request; `delta` reads the sequence.

Stop strings are not emitted: while a request runs, the last `len(longest stop) - 1` characters
are held back, since they could still turn out to be the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engine.core.sequence import Sequence
from app.engine.text.detokenizer import IncrementalDetokenizer
from app.engine.text.tokenizer import Tokenizer
from app.engine.types.outputs import StreamDelta


@dataclass
class _OutputState:
    detok: IncrementalDetokenizer | None  # None: no tokenizer (random weights), ids only
    stop_ids: set[int]
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    holdback: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len  # None: no context limit beyond a request's max_tokens
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

    def check_token(self, seq: Sequence, token: int) -> str | None:
        """Whether `token`, just appended to `seq` (and accepted by its grammar, if any), finishes
        the request: "stop" or "length"; None, it goes on. Adds the token's text to the request's;
        a stop string and what follows it are cut."""
        st = self.states[seq.request_id]
        reason = None
        if token in st.stop_ids:
            reason = "stop"
        elif st.detok is not None:
            st.text += st.detok.add([token])
            if seq.params.stop and self._find_stop(seq, st):
                reason = "stop"
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated:
            reason = "stop"  # the grammar is complete and took its stop token
        if reason is None and (seq.num_output_tokens >= seq.max_tokens or self._at_context_end(seq)):
            reason = "length"
        if reason == "length" and st.detok is not None:
            st.text += st.detok.flush()  # an unfinished UTF-8 character shows as U+FFFD, as decode() would
        return reason

    def _at_context_end(self, seq: Sequence) -> bool:
        return self.max_model_len is not None and seq.num_tokens >= self.max_model_len

    def _find_stop(self, seq: Sequence, st: _OutputState) -> bool:
        # Only the new text (plus a stop's length of overlap) can hold a stop string that was not there before.
        window_start = max(0, st.sent_chars - st.holdback - 1)
        hits = [i for s in seq.params.stop if (i := st.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        st.text = st.text[: min(hits)]
        return True

    def deltas(self, seqs: list[Sequence]) -> list[StreamDelta]:
        return [self.delta(seq) for seq in seqs]

    def delta(self, seq: Sequence) -> StreamDelta:
        """What `seq` produced since its last delta; the final one once it has finished (then its
        state is dropped). A request ended before it was added (or twice) gets an empty final one."""
        st = self.states.get(seq.request_id)
        if st is None:
            return StreamDelta(seq.request_id, "", [], seq.finish_reason or "abort", error=seq.error)
        done = seq.finish_reason is not None
        end = len(st.text) if done else max(st.sent_chars, len(st.text) - st.holdback)
        text = st.text[st.sent_chars : end]
        st.sent_chars = end
        new_ids = seq.token_ids[seq.num_prompt_tokens + st.sent_tokens :]  # not output_token_ids: O(new), not O(all)
        logprobs = seq.logprobs[st.sent_tokens :] if seq.params.logprobs is not None else None
        st.sent_tokens = seq.num_output_tokens
        if done:
            self.states.pop(seq.request_id, None)
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
            num_disk_cached_tokens=seq.num_disk_cached_tokens,
        )
