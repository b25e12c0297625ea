"""An `EngineClient` over any OpenAI-compatible server (another localbatch, vLLM, SGLang,
llama-server) through httpx streaming: the same chat tabs on a bigger deployment.

Stats come from the server's Prometheus `/metrics` when it has one (localbatch:, vllm:, sglang: or
llamacpp: names), polled once a second in the background; otherwise from what this client sees
(running requests, tokens/s, time to first token)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from app.clients.prometheus_text import parse_metrics
from app.engine.api.engine_client import Prompt
from app.engine.types.errors import LocalbatchError, QueueFullError, RequestError
from app.engine.types.fim import FimTokens
from app.engine.types.outputs import EngineStats, RequestStats, StreamDelta
from app.engine.types.sampling_params import SamplingParams
from app.engine.types.timing import ReplyClock

_TIMEOUT = httpx.Timeout(10.0, read=600.0)  # a queued request may wait long for its first token
_RATE_WINDOW_S = 2.0
# Fractional KV usage without block figures is shown in per-mille "blocks" (block_size 0 says so).
_USAGE_RESOLUTION = 1000


class RemoteError(LocalbatchError):
    """The remote backend cannot be reached or answered something unusable."""


@dataclass
class _Live(ReplyClock):
    num_prompt_tokens: int = 0  # from the usage chunk, when the server sends one


@dataclass
class _MetricsState:
    available: bool | None = None  # None: not tried yet
    values: dict[str, float] = field(default_factory=dict)
    prefill_rate: float = 0.0
    decode_rate: float = 0.0
    last: tuple[float, float, float] | None = None  # (time, prompt_total, generation_total)


class RemoteEngine:
    """`EngineClient` over HTTP. Build it with `RemoteEngine.connect(url)` (blocking: run it in a
    thread), then use it from one event loop."""

    model_name: str
    max_model_len: int
    device: str
    is_remote = True
    chat_template = True  # the server serves chat completions and applies its own template
    fim_tokens: FimTokens | None = None  # OpenAI-compatible servers do not say (and build FIM prompts themselves)
    dtype = ""  # OpenAI-compatible servers do not say
    backend = ""

    def __init__(
        self,
        base_url: str,
        model_name: str,
        max_model_len: int = 0,
        *,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        metrics_interval: float = 1.0,
    ) -> None:
        self.base_url = _normalize(base_url)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.device = f"remote {urlsplit(self.base_url).netloc}"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._live: dict[str, _Live] = {}
        self._aborted: set[str] = set()
        self._token_times: deque[float] = deque()  # arrival of each token in the rate window
        self._ttfts: deque[float] = deque(maxlen=32)
        self._metrics = _MetricsState()
        self._metrics_interval = metrics_interval
        self._metrics_task: asyncio.Task | None = None
        self._prompt_tokens_seen = 0  # totals for servers without /metrics
        self._output_tokens_seen = 0

    @classmethod
    def connect(
        cls,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> RemoteEngine:
        """Ask `{base_url}/models` which model it serves (the first, or `model`); raises RemoteError."""
        url = _normalize(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            with httpx.Client(transport=transport, timeout=_TIMEOUT, headers=headers) as client:
                resp = client.get(f"{url}/models")
        except httpx.HTTPError as e:
            raise RemoteError(f"cannot reach {url}: {e}") from None
        if resp.status_code != 200:
            raise _http_error(resp.status_code, resp.content, f"{url}/models")
        try:
            cards = resp.json()["data"]
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"{url}/models did not answer an OpenAI model list; is the address right (…/v1)?") from None
        card = _pick_model(cards, model, url)
        max_len = card.get("max_model_len") or (card.get("meta") or {}).get("n_ctx_train") or 0
        return cls(url, str(card["id"]), int(max_len), api_key=api_key, transport=async_transport)

    # EngineClient

    async def stream(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *, max_delay_s: float = 0.0,
        tools: list[dict[str, Any]] | None = None, tool_choice: str = "auto",
    ) -> AsyncIterator[StreamDelta]:
        """`tools` (OpenAI entries, with chat messages) go in the request's `tools` field; the
        calls the server streams back come as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
        text, as a local model writes them (`ToolCallParser` reads both)."""
        # max_delay_s: the server's SSE events arrive as it sends them; holding them here would
        # not spare a wake-up.
        request_id = request_id or f"remote-{uuid.uuid4().hex[:12]}"
        path, body = self._request_body(prompt, params)
        if tools:
            body["tools"], body["tool_choice"] = tools, tool_choice
        live = _Live(started=time.monotonic())
        self._live[request_id] = live
        self._ensure_metrics_task()
        try:
            async for delta in self._stream(path, body, request_id, live):
                yield delta
        finally:
            self._live.pop(request_id, None)
            self._aborted.discard(request_id)

    async def _stream(self, path: str, body: dict[str, Any], request_id: str, live: _Live) -> AsyncIterator[StreamDelta]:
        finish: str | None = None
        calls = _CallText()
        try:
            async with self._http().stream("POST", f"{self.base_url}{path}", json=body) as resp:
                if resp.status_code != 200:
                    raise _http_error(resp.status_code, await resp.aread(), f"{self.base_url}{path}")
                async for chunk in _sse_chunks(resp):
                    if request_id in self._aborted:
                        finish = "abort"
                        break
                    if "error" in chunk:
                        yield self._final(request_id, live, "error", _error_message(chunk))
                        return
                    text, reason = _chunk_text(chunk)
                    text += calls.feed(chunk, reason is not None)
                    self._observe_usage(chunk, live)
                    finish = reason or finish
                    if text:
                        self._observe_token(live)
                        yield StreamDelta(request_id, text, [], None, num_prompt_tokens=live.num_prompt_tokens,
                                          num_output_tokens=live.num_tokens)
        except httpx.HTTPError as e:
            if live.first_token_at is None:
                raise RemoteError(f"remote backend {self.base_url}: {e}") from None
            yield self._final(request_id, live, "error", f"connection to {self.base_url} lost: {e}")
            return
        self._prompt_tokens_seen += live.num_prompt_tokens
        yield self._final(request_id, live, finish or "stop", None)

    def _final(self, request_id: str, live: _Live, reason: str, error: str | None) -> StreamDelta:
        return StreamDelta(request_id, "", [], reason, num_prompt_tokens=live.num_prompt_tokens,
                           num_output_tokens=live.num_tokens, error=error)

    def abort(self, request_id: str) -> None:
        # Takes effect at the next chunk; the caller cancelling its iteration closes the
        # connection at once, which the server treats as an abort.
        if request_id in self._live:
            self._aborted.add(request_id)

    def set_speculation(self, enabled: bool) -> bool:
        return False  # the remote server's own setting

    async def clear_kv_disk_cache(self) -> str:
        url = f"{_root(self.base_url)}/kv_disk_cache/clear"
        try:
            resp = await self._http().post(url, json={})
        except httpx.HTTPError as e:
            return f"Could not reach {_root(self.base_url)} to clear its KV disk cache: {e}"
        if resp.status_code in (404, 405):
            return f"The server at {_root(self.base_url)} has no KV disk cache to clear (only localbatch serve has)"
        if resp.status_code != 200:
            return f"The server at {_root(self.base_url)} did not clear its KV disk cache (HTTP {resp.status_code})"
        try:
            return str(resp.json()["message"])
        except (ValueError, KeyError, TypeError):
            return f"The server at {_root(self.base_url)} answered, but not with what it cleared"

    def stats(self) -> EngineStats:
        self._ensure_metrics_task()
        now = time.monotonic()
        while self._token_times and now - self._token_times[0] > _RATE_WINDOW_S:
            self._token_times.popleft()
        client_rate = len(self._token_times) / _RATE_WINDOW_S
        m = self._metrics.values if self._metrics.available else {}
        return EngineStats(
            num_running=int(m.get("running", len(self._live))),
            num_waiting=int(m.get("waiting", 0)),
            **self._kv_fields(m),
            prefix_cache_hit_rate=m.get("prefix_hit_rate", 0.0),
            prefill_tokens_per_s=self._metrics.prefill_rate if m else 0.0,
            decode_tokens_per_s=self._metrics.decode_rate if m else client_rate,
            last_batch_size=int(m.get("running", len(self._live))),
            num_steps=int(m.get("steps", 0)),
            num_preemptions=int(m.get("preemptions", 0)),
            total_prompt_tokens=int(m.get("prompt_total", self._prompt_tokens_seen)),
            total_output_tokens=int(m.get("generation_total", self._output_tokens_seen)),
            requests=tuple(_request_stats(rid, live) for rid, live in self._live.items()),
        )

    @property
    def stats_source(self) -> str:
        return "from the server's /metrics" if self._metrics.available else "client-side figures (no /metrics)"

    def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = True) -> list[int]:
        """Through the server's /tokenize (vLLM and llama-server have one; OpenAI does not)."""
        data = self._post_root("/tokenize", {"model": self.model_name, "prompt": text, "content": text,
                                             "add_special_tokens": add_bos, "parse_special": parse_special})
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise RemoteError(f"{self.base_url} has no usable /tokenize endpoint")
        return [int(t) for t in tokens]

    def decode(self, token_ids: list[int]) -> str:
        data = self._post_root("/detokenize", {"model": self.model_name, "tokens": token_ids})
        text = data.get("prompt", data.get("content"))
        if not isinstance(text, str):
            raise RemoteError(f"{self.base_url} has no usable /detokenize endpoint")
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        raise RequestError("a remote backend applies its chat template itself: send the messages instead")

    async def aclose(self) -> None:
        """Stop polling /metrics and close the connection pool; the server is left running."""
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            await asyncio.wait({self._metrics_task})
            self._metrics_task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # helpers

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(transport=self._transport, timeout=_TIMEOUT, headers=self._headers)
        return self._client

    def _request_body(self, prompt: Prompt, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        optional = {
            "seed": params.seed,
            "stop": params.stop or None,
            "presence_penalty": params.presence_penalty or None,
            "frequency_penalty": params.frequency_penalty or None,
            # vLLM / SGLang / llama-server extensions: sent only when they change something.
            "top_k": params.top_k or None,
            "min_p": params.min_p or None,
            "repetition_penalty": params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        body.update(output_fields(params))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return "/chat/completions", {**body, "messages": prompt}
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        return "/completions", {**body, "prompt": prompt}

    def _observe_token(self, live: _Live) -> None:
        now = time.monotonic()
        if live.first_token_at is None:
            self._ttfts.append(now - live.started)
        live.tick(now)
        live.num_tokens += 1
        self._output_tokens_seen += 1
        self._token_times.append(now)

    @staticmethod
    def _observe_usage(chunk: dict[str, Any], live: _Live) -> None:
        usage = chunk.get("usage") or {}
        if usage.get("prompt_tokens"):
            live.num_prompt_tokens = int(usage["prompt_tokens"])
        if usage.get("completion_tokens"):
            live.num_tokens = int(usage["completion_tokens"])


    @staticmethod
    def _kv_fields(m: dict[str, float]) -> dict[str, int]:
        if "kv_usage" not in m:
            return {"num_blocks_total": 0, "num_blocks_used": 0}
        usage = min(max(m["kv_usage"], 0.0), 1.0)
        total = int(m.get("blocks_total", 0))
        block_size = int(m.get("block_size", 0))
        if total and block_size:
            # A localbatch server says what fits at its running mix (its blocks may each hold one
            # KV cache group's layers); other servers leave it to free blocks x block size.
            fit = {"num_tokens_fit": int(m["tokens_fit"])} if "tokens_fit" in m else {}
            return {"num_blocks_total": total, "num_blocks_used": round(usage * total), "block_size": block_size,
                    "kv_bytes_per_token": int(m.get("kv_bytes_per_token", 0)),
                    "kv_bytes_per_token_past_window": int(m.get("kv_bytes_past_window", 0)), **fit}
        return {"num_blocks_total": _USAGE_RESOLUTION, "num_blocks_used": round(usage * _USAGE_RESOLUTION), "block_size": 0}

    def _ensure_metrics_task(self) -> None:
        if self._metrics_task is not None or self._metrics.available is False:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._metrics_task = loop.create_task(self._poll_metrics(), name="localbatch-remote-metrics")

    async def _poll_metrics(self) -> None:
        url = f"{_root(self.base_url)}/metrics"
        while True:
            try:
                resp = await self._http().get(url)
            except httpx.HTTPError:
                await asyncio.sleep(self._metrics_interval * 5)  # server away: keep trying, slowly
                continue
            values = parse_metrics(resp.text) if resp.status_code == 200 else {}
            if not values:
                self._metrics.available = False  # no usable /metrics: client-side figures from now on
                return
            self._update_metrics(values, time.monotonic())
            await asyncio.sleep(self._metrics_interval)

    def _update_metrics(self, values: dict[str, float], now: float) -> None:
        state = self._metrics
        state.available = True
        state.values = values
        prompt, gen = values.get("prompt_total", 0.0), values.get("generation_total", 0.0)
        if state.last is not None and now > state.last[0]:
            dt = now - state.last[0]
            state.prefill_rate = max(prompt - state.last[1], 0.0) / dt
            state.decode_rate = max(gen - state.last[2], 0.0) / dt
        state.last = (now, prompt, gen)
        # A server's own recent-throughput gauges beat our 1-s differences when it has them.
        state.prefill_rate = values.get("prefill_rate", state.prefill_rate)
        state.decode_rate = values.get("decode_rate", state.decode_rate)

    def _post_root(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            with httpx.Client(timeout=_TIMEOUT, headers=self._headers) as client:
                resp = client.post(f"{_root(self.base_url)}{path}", json=body)
            data = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            data = {}
        return data if isinstance(data, dict) else {}


def output_fields(params: SamplingParams) -> dict[str, Any]:
    """The output constraint and logit bias as OpenAI request fields (`response_format`,
    `logit_bias`), and vLLM's `structured_outputs` for a regex or grammar."""
    out: dict[str, Any] = {}
    if params.logit_bias:
        out["logit_bias"] = {str(token): value for token, value in params.logit_bias.items()}
    if params.json_schema is not None:
        schema = _json_value(params.json_schema, "json_schema")
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": schema, "strict": True}}
    elif params.json_object:
        out["response_format"] = {"type": "json_object"}
    elif params.structural_tag is not None:
        out["response_format"] = _json_value(params.structural_tag, "structural_tag")
    elif params.regex is not None:
        out["structured_outputs"] = {"regex": params.regex}
    elif params.grammar is not None:
        out["structured_outputs"] = {"grammar": params.grammar}
    return out


def _json_value(value: Any, param: str) -> Any:
    """A schema or tag given as a JSON string, parsed (servers take objects)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise RequestError(f"{param} is not valid JSON", param=param) from None


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise RemoteError(f"backend URL {url!r} must start with http:// or https:// (e.g. http://host:8000/v1)")
    return url


def _root(base_url: str) -> str:
    return base_url.removesuffix("/v1")


def _pick_model(cards: Any, model: str | None, url: str) -> dict[str, Any]:
    if not isinstance(cards, list) or not cards or not all(isinstance(c, dict) and "id" in c for c in cards):
        raise RemoteError(f"{url}/models lists no models")
    if model is None:
        return cards[0]
    for card in cards:
        if card["id"] == model:
            return card
    raise RemoteError(f"{url} does not serve {model!r}; it serves: {', '.join(str(c['id']) for c in cards)}")


async def _sse_chunks(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise RemoteError(f"the server sent a malformed stream event: {data[:80]!r}") from None
        if isinstance(chunk, dict):
            yield chunk


def _chunk_text(chunk: dict[str, Any]) -> tuple[str, str | None]:
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    delta = choice.get("delta")
    text = (delta or {}).get("content") if delta is not None else choice.get("text")
    return text or "", choice.get("finish_reason")


class _CallText:
    """Streamed `delta.tool_calls` as Hermes-style call text: `<tool_call>{"name": N, "arguments": `,
    the argument fragments as they come, `}</tool_call>` when the next call or the end comes."""

    def __init__(self) -> None:
        self.open = False

    def feed(self, chunk: dict[str, Any], last: bool) -> str:
        choices = chunk.get("choices") or [{}]
        out = []
        for call in (choices[0].get("delta") or {}).get("tool_calls") or []:
            function = call.get("function") or {}
            if function.get("name"):
                out.append(("}</tool_call>" if self.open else "")
                           + f'<tool_call>{{"name": {json.dumps(function["name"])}, "arguments": ')
                self.open = True
            out.append(function.get("arguments") or "")
        if last and self.open:
            out.append("}</tool_call>")
            self.open = False
        return "".join(out)


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


def _http_error(status: int, content: bytes, url: str) -> LocalbatchError:
    try:
        body = json.loads(content)
    except ValueError:
        body = content.decode("utf-8", "replace").strip()[:200]
    message = _error_message(body) or f"HTTP {status}"
    param = body.get("error", {}).get("param") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    if status in (400, 404, 413, 422):
        return RequestError(message, param=param)
    if status in (429, 503):
        return QueueFullError(f"the server is busy (HTTP {status}): {message}")
    if status in (401, 403):
        return RemoteError(f"{url} refused the request (HTTP {status}): check --api-key")
    return RemoteError(f"{url} answered HTTP {status}: {message}")


def _request_stats(request_id: str, live: _Live) -> RequestStats:
    timing = live.timing()
    return RequestStats(
        request_id=request_id,
        status="decode" if live.first_token_at is not None else "prefill",
        num_prompt_tokens=live.num_prompt_tokens,
        num_output_tokens=live.num_tokens,
        num_blocks=0,  # a remote server does not say which blocks a request holds
        num_cached_tokens=0,
        ttft_s=timing.ttft_s,
        itl_s=timing.itl_s,
        tokens_per_s=timing.tokens_per_s,
    )
