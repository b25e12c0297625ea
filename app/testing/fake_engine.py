"""The one fake `EngineClient` of the test suite (server and TUI tests) and the UI benchmark, and a
helper that runs the HTTP server in a background thread.

`FakeEngine` behaves like the real engine as its clients see it: requests queue, are admitted into
a running batch (`max_num_seqs`, KV blocks reserved for prompt + max_tokens), and advance one token
per step in a step loop on the caller's event loop; stop strings are held back and never emitted;
`max_tokens`, the context length, `seed`, `ignore_eos`, `stop_token_ids` and logprobs are honoured;
aborts free blocks at once.

Generated text is, by default, words from a fixed list spelled out one byte-token at a time, chosen
by an RNG seeded from the prompt (greedy), from seed + prompt (seeded), or at random. With
`script=echo_reply` a reply is instead a known list of pieces, one token each, ending as if on EOS
(the TUI tests check replies word for word).

Output constraints (`SamplingParams.json_object`, `json_schema`, `structural_tag`) are checked
crudely, as the engine's grammar compiler would refuse them (`RequestError` naming the field), and
honoured crudely: the reply is one fixed document valid for the schema (`example_instance`), or the first
tool call a structural tag demands, four characters a token. A triggered tag (tool_choice "auto")
leaves the reply free. `logit_bias` ids must be in the vocabulary. `ToolTemplateEngine` plays a
model whose chat template has Hermes-style tool support (it takes `tools`, renders tool turns).

The tokenizer is byte-level: token id = UTF-8 byte + 3 (0 pad, 1 BOS, 2 EOS), so token counts are
easy to compute in tests: `len(FakeTokenizer().encode(text))`. `fim=True` plays a code model: its
`fim_tokens` are ids 259-264, which decode to Qwen2.5-Coder's FIM texts. Deltas report as
`num_cached_tokens` the whole blocks a prompt shares with a recent one (a crude prefix cache; the
stats snapshot keeps 0).

For tests: `submitted` (`Submitted(prompt, params, request_id)` per accepted request), `aborted`
(ids aborted before finishing), `batch_sizes` (running-batch size of every step), `max_concurrent`,
`closed`. These and `stats()` may be read from any thread; everything else, including the controls
(`paused`, `hold_after`, `fail_next`, `frozen_stats`, `kill()`), belongs to the event loop that
streams.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self

from app.engine.api.engine_client import TOOLS_IN_PROMPT, Prompt
from app.engine.types.errors import EngineDeadError, QueueFullError, RequestError
from app.engine.types.fim import FimTokens
from app.engine.types.outputs import EngineStats, RequestStats, StreamDelta, TopLogprobs
from app.engine.types.sampling_params import SamplingParams

# A reply's pieces for a prompt, one token each (see `echo_reply`).
Script = Callable[[Prompt], list[str]]

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


# A code model's fill-in-the-middle tokens (`FakeEngine(fim=True)`), after the byte tokens, in
# Qwen2.5-Coder's order.
FIM_TEXTS = {259: "<|fim_prefix|>", 260: "<|fim_middle|>", 261: "<|fim_suffix|>", 262: "<|fim_pad|>",
             263: "<|repo_name|>", 264: "<|file_sep|>"}
FAKE_FIM = FimTokens(prefix=259, suffix=261, middle=260, pad=262, repo=263, sep=264)


class FakeTokenizer:
    """Byte-level tokenizer: id = byte + 3; 0, 1, 2 are PAD, BOS, EOS; `specials` ({id: text},
    ids from 259 on) decode to their text (they are never produced by `encode`)."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 256 + OFFSET

    def __init__(self, specials: dict[int, str] | None = None) -> None:
        self.specials = dict(specials or {})
        self.vocab_size = FakeTokenizer.vocab_size + len(self.specials)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})", param="tokens")
        if not self.specials:
            return bytes(t - self.OFFSET for t in token_ids if t >= self.OFFSET).decode("utf-8", errors="replace")
        out, run = [], bytearray()
        for t in token_ids:
            if t in self.specials:
                out += [run.decode("utf-8", errors="replace"), self.specials[t]]
                run.clear()
            elif t >= self.OFFSET:
                run.append(t - self.OFFSET)
        return "".join(out) + run.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, tool_template: bool = False) -> str:
        """Without `tool_template`, `tools` are ignored (as by a template without tool support)."""
        parts = []
        if tool_template and tools:
            names = ", ".join(t["function"]["name"] for t in tools)
            parts.append(f"<system>tools: {names}; call them as <tool_call>{{json}}</tool_call>\n")
        roles = ("system", "user", "assistant", "tool") if tool_template else ("system", "user", "assistant")
        for m in messages:
            if m.get("role") not in roles or not isinstance(m.get("content"), str):
                raise RequestError(f"bad chat message {m!r}", param="messages")
            calls = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>" for c in m.get("tool_calls") or [])
            parts.append(f"<{m['role']}>{m['content']}{calls}\n")
        return "".join(parts) + ("<assistant>" if add_generation_prompt else "")


def echo_reply(prompt: Prompt) -> list[str]:
    """'Reply to:' and the words of the last user message (or of a text prompt), one per token."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        users = [str(m.get("content", "")) for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        text = users[-1] if users else ""
    else:
        text = str(prompt)
    return ["Reply", " to:"] + [f" {w}" for w in text.split()]


# --- output constraints, crudely ---------------------------------------------------------------------

JSON_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def check_constraints(params: SamplingParams, vocab_size: int) -> None:
    """Refuse what the engine's grammar compiler would refuse (a crude subset)."""
    if params.logit_bias:
        params.check_token_ids(vocab_size)
    if params.json_schema is not None:
        _check_schema(_loaded(params.json_schema, "json_schema"), "json_schema")
    if params.structural_tag is not None:
        tag = _loaded(params.structural_tag, "structural_tag")
        if tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
            raise RequestError("structural_tag needs type 'structural_tag' and a format", param="structural_tag")
        for schema in _tag_schemas(tag["format"]):
            _check_schema(schema, "structural_tag")


def _loaded(value: Any, param: str) -> dict[str, Any]:
    try:
        loaded = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        raise RequestError(f"{param} is not valid JSON", param=param) from None
    if not isinstance(loaded, dict):
        raise RequestError(f"{param} must be a JSON object", param=param)
    return loaded


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise RequestError(f"invalid JSON schema: {schema!r} is not an object", param=param)
    kinds = schema.get("type", "object")
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind not in JSON_TYPES:
            raise RequestError(f"invalid JSON schema: unknown type {kind!r}", param=param)
    for sub in (schema.get("properties") or {}).values():
        _check_schema(sub, param)
    if isinstance(schema.get("items"), dict):
        _check_schema(schema["items"], param)


def _tag_schemas(fmt: dict[str, Any]) -> list[Any]:
    if fmt.get("type") == "json_schema":
        return [fmt.get("json_schema")]
    found = []
    for key in ("tags", "elements"):
        for sub in fmt.get(key) or []:
            found += _tag_schemas(sub)
    if isinstance(fmt.get("content"), dict):
        found += _tag_schemas(fmt["content"])
    return found


def constrained_reply(params: SamplingParams) -> str | None:
    """The fixed reply a constraint forces, or None where the output stays free."""
    if params.json_object:
        return '{"answer": "alpha"}'
    if params.json_schema is not None:
        return json.dumps(example_instance(_loaded(params.json_schema, "json_schema")))
    tag = params.structural_tag
    return _forced_call(_loaded(tag, "structural_tag")["format"]) if tag is not None else None


def _forced_call(fmt: dict[str, Any]) -> str | None:
    """The first tag of a format that must start with one (a call under "required" or a named choice)."""
    if fmt.get("type") == "or":
        return _forced_call(fmt["elements"][0])
    if fmt.get("type") == "tag":
        return fmt["begin"] + json.dumps(example_instance(fmt["content"]["json_schema"])) + fmt["end"]
    if fmt.get("at_least_one") and fmt.get("tags"):
        return _forced_call(fmt["tags"][0])
    return None


def example_instance(schema: dict[str, Any]) -> Any:
    """One document valid for the common JSON-schema keywords (the fake's 'grammar')."""
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example_instance(schema[key][0])
    kind = schema.get("type", "object")
    kind = next((k for k in kind if k != "null"), "null") if isinstance(kind, list) else kind
    if kind == "object":
        props = schema.get("properties") or {}
        keys = schema.get("required") or list(props)
        return {k: example_instance(props.get(k, {"type": "string"})) for k in keys}
    if kind == "array":
        return [example_instance(schema.get("items") or {"type": "string"})] * max(schema.get("minItems", 1), 1)
    simple = {"string": "alpha" + "a" * max(schema.get("minLength", 0) - 5, 0),
              "integer": max(schema.get("minimum", 1), 1), "number": 1.5, "boolean": True, "null": None}
    return simple.get(kind)


class Submitted(NamedTuple):
    prompt: Prompt
    params: SamplingParams
    request_id: str


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, or what fits when that is None
    rng: random.Random
    arrival: float
    queue: asyncio.Queue[StreamDelta] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TopLogprobs] = field(default_factory=list)
    pending: deque[int] = field(default_factory=deque)  # bytes of the word being spelled out
    script: deque[str] | None = None  # the pieces still to come, when the reply is scripted
    text: str = ""  # generated text (stop strings not yet cut)
    emitted: int = 0  # characters of `text` already sent
    done: bool = False
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # whole blocks of an earlier prompt it starts with

    @property
    def max_len(self) -> int:
        return len(self.prompt_ids) + self.max_tokens


class FakeEngine:
    """See the module docstring. `eos_after`: every request samples EOS after that many tokens
    (unless `ignore_eos`); `error_after`: every request fails with finish_reason "error" after that
    many tokens (to test error reporting); `script`: scripted replies instead of random words.

    Controls: `paused` holds every running request before its next token and `hold_after` holds
    those that have that many tokens (they stay in the batch, as a stalled step would leave them);
    `fail_next` is raised by the next `stream()` before anything is queued; `frozen_stats`, when
    set, is what `stats()` returns (deterministic panels). `chat_template=False` plays a base model
    (the TUI then sends plain-text prompts); the fake still accepts chat messages either way."""

    model_name: str
    max_model_len: int
    device: str
    dtype: str
    backend: str
    chat_template: bool
    fim_tokens: FimTokens | None
    is_remote = False
    stats_source = ""

    def __init__(self, *, model_name: str = "fake-model", max_model_len: int = 512, step_delay: float = 0.002,
                 max_num_seqs: int = 16, max_waiting: int = 64, num_blocks: int = 512, block_size: int = 16,
                 kv_bytes_per_token: int = 18432, device: str = "cpu", dtype: str = "bfloat16",
                 eos_after: int | None = None, error_after: int | None = None, script: Script | None = None,
                 frozen_stats: EngineStats | None = None, chat_template: bool = True, fim: bool = False) -> None:
        self.model_name = model_name
        self.chat_template = chat_template
        # fim: a code model, with FIM_TEXTS in its vocabulary (decoded to their text).
        self.fim_tokens = FAKE_FIM if fim else None
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.backend = ""  # the header then shows device and dtype only, as the snapshots have them
        self.tokenizer = FakeTokenizer(FIM_TEXTS if fim else None)
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.eos_after = eos_after
        self.error_after = error_after
        self.script = script
        self.frozen_stats = frozen_stats
        self.paused = False
        self.hold_after: int | None = None
        self.fail_next: Exception | None = None
        self.submitted: list[Submitted] = []
        self.aborted: list[str] = []
        self.batch_sizes: list[int] = []
        self.max_concurrent = 0
        self.closed = False
        self.speculation_enabled: bool | None = None  # the last set_speculation() call
        self.kv_disk_clears = 0  # clear_kv_disk_cache() calls
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._dead = False
        self._counter = 0
        self._recent_prompts: deque[list[int]] = deque(maxlen=64)  # the crude prefix cache
        self._totals = {"prompt": 0, "output": 0, "steps": 0}
        self._last_step_s = 0.0
        self._publish()

    # --- EngineClient ------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
        self.encoded = [*getattr(self, "encoded", [])[-50:], (text, parse_special)]
        return self.tokenizer.encode(text, add_bos)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)

    def stats(self) -> EngineStats:
        if self._dead:
            raise EngineDeadError("the fake engine was killed")
        return self.frozen_stats if self.frozen_stats is not None else self._snapshot

    def stream(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *,
               max_delay_s: float = 0.0, tools: list[dict[str, Any]] | None = None,
               tool_choice: str = "auto") -> AsyncIterator[StreamDelta]:
        """Validates and queues at once (errors are raised here, before any delta). Deltas are
        never held: `max_delay_s` is only recorded."""
        if tools:
            raise RequestError(TOOLS_IN_PROMPT, param="tools")
        self.last_max_delay_s = max_delay_s
        if self._dead or self.closed:
            raise EngineDeadError("the fake engine was killed" if self._dead else "the fake engine was closed")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        self._counter += 1
        request_id = request_id or f"fake-{self._counter}"
        ids = self._prompt_ids(prompt)
        max_tokens = self._check(request_id, ids, params)
        req = _Request(request_id, ids, params, max_tokens, self._rng(ids, params), time.perf_counter(),
                       num_cached_tokens=self._cached_prefix(ids))
        self._recent_prompts.append(ids)
        constrained = constrained_reply(params)
        if constrained is not None:
            req.script = deque(constrained[i:i + 4] for i in range(0, len(constrained), 4))
        elif self.script is not None:
            req.script = deque(self.script(prompt))
        self._waiting.append(req)
        self.submitted.append(Submitted(prompt, params, request_id))
        self.max_concurrent = max(self.max_concurrent, len(self._waiting) + len(self._running))
        self._publish()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        return self._deltas(req)

    def set_speculation(self, enabled: bool) -> bool:
        self.speculation_enabled = enabled
        return False

    async def clear_kv_disk_cache(self) -> str:
        self.kv_disk_clears += 1
        return "Cleared the KV disk cache: 0 files, 0.0 MB (fake)"

    def abort(self, request_id: str) -> None:
        req = self._find(request_id)
        if req is None:
            return
        self._finish(req, StreamDelta(request_id, "", [], finish_reason="abort",
                                      num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids)))
        self.aborted.append(request_id)
        self._publish()

    async def aclose(self) -> None:
        self.closed = True

    # --- test controls -----------------------------------------------------------------------

    def live_request_ids(self) -> list[str]:
        return [r.request_id for r in [*self._waiting, *self._running]]

    def kill(self) -> None:
        """Stop the engine: live requests end with an error, later calls raise EngineDeadError."""
        for req in [*self._waiting, *self._running]:
            self._finish(req, StreamDelta(req.request_id, "", [], finish_reason="error", error="engine stopped"))
        self._dead = True

    # --- internals ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.encode(self.apply_chat_template(prompt))  # type: ignore[arg-type]
        ids = [t for t in prompt if isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size]
        if len(ids) != len(prompt):
            raise RequestError(f"prompt token ids must be in 0..{self.tokenizer.vocab_size - 1}", param="prompt")
        return ids

    def _check(self, request_id: str, ids: list[int], params: SamplingParams) -> int:
        """Raise what the real engine raises; return the request's token budget."""
        p, ctx = len(ids), self.max_model_len
        if not ids:
            raise RequestError("prompt is empty", param="prompt")
        if p >= ctx:
            raise RequestError(f"prompt is {p} tokens, longer than the context length of {ctx}", param="prompt")
        m = params.max_tokens or min(ctx, self.num_blocks * self.block_size) - p
        if p + m > ctx:
            raise RequestError(f"prompt ({p} tokens) + max_tokens ({m}) = {p + m} exceeds the context length of {ctx}",
                               param="max_tokens")
        if self._blocks(p + m) > self.num_blocks:
            raise RequestError(f"prompt + max_tokens needs {self._blocks(p + m)} KV blocks; the pool has "
                               f"{self.num_blocks}", param="max_tokens")
        if params.n != 1:
            raise RequestError("the engine takes one sequence per request (n=1)", param="n")
        check_constraints(params, self.tokenizer.vocab_size)
        if self._find(request_id) is not None:
            raise RequestError(f"request id {request_id!r} is already in use")
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        return m

    def _rng(self, ids: list[int], params: SamplingParams) -> random.Random:
        prompt_key = zlib.crc32(b"".join(t.to_bytes(4, "little") for t in ids))
        if params.seed is not None:
            return random.Random(params.seed * 1_000_003 + prompt_key)
        if params.temperature == 0:
            return random.Random(prompt_key)
        return random.Random(os.urandom(8))

    def _cached_prefix(self, ids: list[int]) -> int:
        """Prompt tokens a prefix cache would serve: the whole blocks it shares with a recent
        prompt, leaving at least one token to compute (as the real engine's cache)."""
        best = 0
        for seen in self._recent_prompts:
            n = 0
            for a, b in zip(seen, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1) // self.block_size * self.block_size

    def _blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _find(self, request_id: str) -> _Request | None:
        return next((r for r in [*self._waiting, *self._running] if r.request_id == request_id), None)

    async def _deltas(self, req: _Request) -> AsyncIterator[StreamDelta]:
        try:
            while True:
                delta = await req.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not req.done:  # the consumer broke off or was cancelled
                self.abort(req.request_id)

    async def _step_loop(self) -> None:
        try:
            while self._waiting or self._running:
                start = time.perf_counter()
                await asyncio.sleep(self.step_delay)
                self._admit()
                if self._running:
                    self.batch_sizes.append(len(self._running))
                    self._totals["steps"] += 1
                    for req in [r for r in self._running if not self._holding(r)]:
                        self._advance(req)
                self._last_step_s = time.perf_counter() - start
                self._publish()
        except Exception as exc:  # like the real engine: fail the live requests, never leave them hanging
            for req in [*self._waiting, *self._running]:
                self._finish(req, StreamDelta(req.request_id, "", [], finish_reason="error", error=repr(exc)))
            raise

    def _admit(self) -> None:
        reserved = sum(self._blocks(r.max_len) for r in self._running)
        while self._waiting and len(self._running) < self.max_num_seqs:
            need = self._blocks(self._waiting[0].max_len)
            if reserved + need > self.num_blocks:
                return
            req = self._waiting.popleft()
            reserved += need
            self._running.append(req)
            self._totals["prompt"] += len(req.prompt_ids)

    def _holding(self, req: _Request) -> bool:
        return self.paused or (self.hold_after is not None and len(req.output_ids) >= self.hold_after)

    def _sample(self, req: _Request) -> tuple[int, str]:
        """The next token and its text."""
        n = len(req.output_ids)
        if self.eos_after is not None and n >= self.eos_after and not req.params.ignore_eos:
            return FakeTokenizer.EOS, ""
        if req.script is not None:
            if not req.script:
                return FakeTokenizer.EOS, ""
            piece = req.script.popleft()
            # One token stands for the whole piece; its id (the first byte's) only has to be valid.
            return (self.encode(piece, add_bos=False) or [FakeTokenizer.PAD])[0], piece
        if not req.pending:
            word = req.rng.choice(WORDS)
            req.pending.extend(self.encode(word if n == 0 else " " + word, add_bos=False))
        token = req.pending.popleft()
        return token, self.decode([token])

    def _advance(self, req: _Request) -> None:
        token, piece = self._sample(req)
        req.output_ids.append(token)
        self._totals["output"] += 1
        if req.params.logprobs is not None:
            req.logprobs.append(self._logprobs(token, req.params.logprobs))
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.text += piece
        finish, error = self._finish_reason(req, token)
        if finish is None:
            safe = len(req.text) - self._held_back(req)
            self._emit(req, req.text[req.emitted:safe], [token])
            req.emitted = max(req.emitted, safe)
            return
        text = self._cut_at_stop(req)
        delta = self._delta(req, text[req.emitted:], [token])
        delta.finish_reason, delta.error = finish, error
        self._finish(req, delta)

    def _finish_reason(self, req: _Request, token: int) -> tuple[str | None, str | None]:
        p, n = req.params, len(req.output_ids)
        if self.error_after is not None and n >= self.error_after:
            return "error", "fake engine failure"
        if (token == FakeTokenizer.EOS and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop", None
        if req.script is not None and not req.script and not p.ignore_eos:
            return "stop", None  # a script's last piece ends the reply, as EOS would right after it
        if any(s in req.text for s in p.stop or []):
            return "stop", None
        if n >= req.max_tokens or len(req.prompt_ids) + n >= self.max_model_len:
            return "length", None
        return None, None

    def _cut_at_stop(self, req: _Request) -> str:
        cuts = [req.text.find(s) for s in req.params.stop or [] if s in req.text]
        return req.text[:min(cuts)] if cuts else req.text

    def _held_back(self, req: _Request) -> int:
        """Characters at the end of the text that could be the start of a stop string."""
        longest = 0
        for stop in req.params.stop or []:
            for k in range(min(len(stop) - 1, len(req.text)), 0, -1):
                if req.text.endswith(stop[:k]):
                    longest = max(longest, k)
                    break
        return longest

    def _logprobs(self, token: int, k: int) -> TopLogprobs:
        dist = {(token + j) % self.tokenizer.vocab_size: -0.25 - 1.5 * j for j in range(1, k + 1)}
        dist[token] = -0.125
        return dist

    def _delta(self, req: _Request, text: str, token_ids: list[int]) -> StreamDelta:
        logprobs = req.logprobs[-len(token_ids):] if req.params.logprobs is not None and token_ids else None
        return StreamDelta(req.request_id, text, token_ids, logprobs=logprobs, num_prompt_tokens=len(req.prompt_ids),
                           num_output_tokens=len(req.output_ids), num_cached_tokens=req.num_cached_tokens)

    def _emit(self, req: _Request, text: str, token_ids: list[int]) -> None:
        req.queue.put_nowait(self._delta(req, text, token_ids))

    def _finish(self, req: _Request, delta: StreamDelta) -> None:
        req.done = True
        req.queue.put_nowait(delta)
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)

    def _publish(self) -> None:
        """Replace the stats snapshot (readers on other threads only ever see whole snapshots)."""
        now = time.perf_counter()
        decoding = sum(not self._holding(r) for r in self._running)
        requests = tuple(RequestStats(
            request_id=r.request_id,
            status="decode" if r.output_ids else ("prefill" if r in self._running else "waiting"),
            num_prompt_tokens=len(r.prompt_ids),
            num_output_tokens=len(r.output_ids),
            num_blocks=self._blocks(len(r.prompt_ids) + len(r.output_ids)),
            num_cached_tokens=0,
            ttft_s=None if r.first_token_time is None else r.first_token_time - r.arrival,
            itl_s=self._last_step_s if len(r.output_ids) > 1 else None,
            tokens_per_s=len(r.output_ids) / (now - r.arrival) if r.output_ids else None,
        ) for r in [*self._running, *self._waiting])
        self._snapshot = EngineStats(
            num_running=len(self._running), num_waiting=len(self._waiting), num_blocks_total=self.num_blocks,
            num_blocks_used=sum(self._blocks(len(r.prompt_ids) + len(r.output_ids)) for r in self._running),
            block_size=self.block_size, kv_bytes_per_token=self.kv_bytes_per_token,
            decode_tokens_per_s=decoding / self._last_step_s if decoding and self._last_step_s else 0.0,
            last_batch_size=self.batch_sizes[-1] if self.batch_sizes else 0,
            last_num_tokens=self.batch_sizes[-1] if self.batch_sizes else 0, last_step_time_s=self._last_step_s,
            num_steps=self._totals["steps"], total_prompt_tokens=self._totals["prompt"],
            total_output_tokens=self._totals["output"], requests=requests)


class ToolTemplateEngine(FakeEngine):
    """A fake whose chat template takes `tools` (as Qwen's and Hermes' do) and renders tool turns."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools, tool_template=True)


class ServerThread:
    """The HTTP server (`ApiServer`) on a loopback port, in a background thread with its own loop,
    for tests that drive it with blocking clients. Use as a context manager; `url` is the base URL."""

    def __init__(self, engine: Any, **server_kwargs: Any) -> None:
        self.engine = engine
        self.server_kwargs = server_kwargs
        self.port = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="api-server")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _main(self) -> None:
        from app.server import ApiServer

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            server = ApiServer(self.engine, "127.0.0.1", 0, **self.server_kwargs)
            await server.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self._error = exc
            self._ready.set()
            return
        self.port = server.port
        self._ready.set()
        await self._stop.wait()
        await server.stop()

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the test server did not start within 10 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
