"""OpenAI-compatible HTTP server over the engine: FastAPI + uvicorn.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with server-sent-event
streaming, ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text format: queue length, running slots, TTFT / TPOT / end-to-end histograms,
prompt and generated tokens, requests by finish reason, cache bytes in use).

Request fields: ``model`` (this server's model id, or absent), ``prompt`` (a string or a list
of token ids; one prompt per request), ``messages`` (chat), ``max_tokens`` (completions:
default 16, as OpenAI; chat: ``max_completion_tokens`` or ``max_tokens``, default the rest of the
context), ``temperature`` (default 1; 0 is greedy), ``top_p``, ``seed``, ``stop`` (a string or
up to 4), ``stream``, ``stream_options.include_usage``, ``n`` (1 only), and the extensions
``min_p``, ``stop_token_ids`` and ``reset`` (the ReSET sampler: ``{"preset": "Qwen3-8B"}`` or
``{"t_low": .., "tau0": .., "t_high": ..}``; ``top_p`` then defaults to 0.95). OpenAI options
this server does not implement (``n`` > 1, ``best_of`` > 1, ``logprobs``, ``echo``, penalties,
``logit_bias``, tools) are refused when set to anything but their neutral value; fields the API
does not define are ignored. A bad request gets a 400 whose OpenAI-style error names the field
(``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``); a full queue a
503. A completion prompt is taken verbatim (no newline added).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from jaxlp.errors import is_number
from jaxlp.sampling.base import Categorical, Greedy
from jaxlp.sampling.reset import ReSETConfig, reset_preset
from jaxlp.serving.chat import ChatTemplate
from jaxlp.serving.engine import EngineLoop, Output, QueueFullError, SamplingParams

MAX_STOP_STRINGS = 4
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
# OpenAI options served only at their neutral value: name -> accepted values.
NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
           "echo": (None, False), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "suffix": (None, ""),
           "response_format": (None, {"type": "text"})}


class BadRequest(ValueError):
    """A 400 answer: ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ------------------------------------------------------------------------- request fields


def _number(body, name, default, *, low=None, high=None, low_open=False, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else is_number(value)
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)):
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a finite number'}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise BadRequest(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}", name)
    if high is not None and value > high:
        raise BadRequest(f"{name} must be <= {high}, got {value!r}", name)
    return value


def _stop_strings(body) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    return tuple(stop)


class Server:
    """The request handling of the app, independent of the web framework (testable directly):
    field checks, prompt building, sampling parameters, bridging engine outputs to asyncio."""

    def __init__(self, loop: EngineLoop, tokenizer, *, model_id: str, chat_template: ChatTemplate | None = None):
        self.loop, self.engine, self.tokenizer = loop, loop.engine, tokenizer
        self.model_id = model_id
        self.chat_template = chat_template or ChatTemplate()
        self.created = int(time.time())

    # -- parsing

    def check_common(self, body: dict) -> None:
        for name, neutral in NEUTRAL.items():
            if body.get(name) not in neutral:
                raise BadRequest(f"{name}={body[name]!r} is not supported by this server", name)
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise BadRequest(f"the model {model!r} does not exist; this server serves {self.model_id!r}", "model",
                             status=404)
        for name in ("stream",):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise BadRequest(f"{name} must be a boolean", name)
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise BadRequest("stream_options must be an object", "stream_options")

    def sampling(self, body: dict, prompt_len: int, *, chat: bool) -> SamplingParams:
        """The request's sampling parameters; ``max_tokens`` defaults to 16 for completions (as
        OpenAI) and to the rest of the context for chat."""
        room = self.engine.max_len - prompt_len
        max_tokens_field = "max_completion_tokens" if chat else "max_tokens"
        if room < 1:
            raise BadRequest(f"the prompt has {prompt_len} tokens; the context length is {self.engine.max_len}",
                             "messages" if chat else "prompt")
        max_tokens = _number(body, max_tokens_field, None, low=1, integer=True)
        if max_tokens is None and chat:
            max_tokens = _number(body, "max_tokens", None, low=1, integer=True)
        if max_tokens is None:
            max_tokens = room if chat else min(16, room)
        if max_tokens > room:
            raise BadRequest(f"prompt of {prompt_len} tokens + {max_tokens_field} {max_tokens} exceeds the context "
                             f"length {self.engine.max_len}", max_tokens_field)
        temperature = _number(body, "temperature", 1.0, low=0.0, high=2.0)
        top_p = _number(body, "top_p", None, low=0.0, high=1.0, low_open=True)
        min_p = _number(body, "min_p", None, low=0.0, high=0.999999)
        seed = _number(body, "seed", None, low=-(2**63), high=2**63 - 1, integer=True)
        if seed is None:
            seed = uuid.uuid4().int % (2**63)
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None:
            if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
                raise BadRequest("stop_token_ids must be a list of integers", "stop_token_ids")
            if len(stop_ids) > self.engine.max_stop_tokens - len(self.engine.config.eos_token_ids):
                raise BadRequest(f"at most {self.engine.max_stop_tokens - len(self.engine.config.eos_token_ids)} "
                                 "stop_token_ids", "stop_token_ids")
            if any(not 0 <= t < self.engine.config.vocab_size for t in stop_ids):
                raise BadRequest("stop_token_ids holds an id outside the vocabulary", "stop_token_ids")
            stop_ids = tuple(self.engine.config.eos_token_ids) + tuple(stop_ids)
        reset = body.get("reset")
        if reset is not None:
            sampler = self._reset_sampler(reset, top_p)
        elif temperature == 0:
            sampler = Greedy()
        else:
            sampler = Categorical(temperature=temperature, top_p=None if top_p in (None, 1) else top_p,
                                  min_p=None if not min_p else min_p)
        return SamplingParams(sampler=sampler, seed=seed, max_tokens=max_tokens, stop_token_ids=stop_ids,
                              stop=_stop_strings(body))

    def _reset_sampler(self, reset: Any, top_p) -> ReSETConfig:
        if not isinstance(reset, dict):
            raise BadRequest("reset must be an object: {\"preset\": name} or {\"t_low\", \"tau0\", \"t_high\"}", "reset")
        try:
            values = {}
            if "preset" in reset:
                preset = reset_preset(str(reset["preset"]))
                values.update(t_low=preset.t_low, tau0=preset.tau0)
            for name in ("t_low", "tau0", "t_high"):
                if name in reset:
                    values[name] = reset[name]
            if "t_low" not in values or "tau0" not in values:
                raise ValueError("reset needs a preset or both t_low and tau0")
            kwargs = dict(t_high=values.get("t_high", 1.0), top_p=0.95 if top_p is None else top_p)
            if not all(is_number(v) and not isinstance(v, bool) for v in values.values()):
                raise ValueError("reset's t_low, tau0 and t_high must be numbers")
            return ReSETConfig.from_tokenizer(self.tokenizer, values["t_low"], values["tau0"], window=self.engine.sampler.window,
                                              **kwargs)
        except ValueError as e:
            raise BadRequest(f"reset: {e}", "reset") from None

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("prompt is empty", "prompt")
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.engine.config.vocab_size for t in ids):
                raise BadRequest(f"prompt holds a token id outside the vocabulary (size "
                                 f"{self.engine.config.vocab_size})", "prompt")
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest("a list of several prompts is not supported: send one request per prompt", "prompt")
        elif prompt is None:
            raise BadRequest("prompt is required", "prompt")
        else:
            raise BadRequest("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise BadRequest("prompt is empty after tokenization", "prompt")
        return ids

    def chat_prompt(self, body: dict) -> list[int]:
        try:
            text = self.chat_template.render(body.get("messages"))
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=not self.chat_template.adds_special_tokens).ids
        if not ids:
            raise BadRequest("messages give an empty prompt", "messages")
        return ids

    # -- running

    def submit(self, ids: list[int], params: SamplingParams) -> tuple[Any, asyncio.Queue]:
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        listener = lambda out: aio.call_soon_threadsafe(queue.put_nowait, out)  # noqa: E731
        try:
            request = self.loop.submit(ids, params, listener=listener, request_id=f"cmpl-{uuid.uuid4().hex}")
        except QueueFullError as e:
            raise BadRequest(f"the server is busy ({e}); retry later", None, status=503, kind="server_error") from None
        except ValueError as e:
            raise BadRequest(str(e), None) from None
        return request, queue

    async def outputs(self, request, queue: asyncio.Queue):
        """The request's outputs as they come; cancels the request if the consumer goes away."""
        try:
            while True:
                out: Output = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            if not request.finished:
                self.loop.cancel(request)


def usage(request) -> dict:
    prompt, completion = len(request.prompt_ids), len(request.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(loop: EngineLoop, tokenizer, *, model_id: str, chat_template: ChatTemplate | None = None):
    """The FastAPI app serving ``loop``'s engine (see module doc); the loop must be started."""
    server = Server(loop, tokenizer, model_id=model_id, chat_template=chat_template)
    metrics = Metrics(loop)
    app = FastAPI(title="jaxlp", version="1")
    app.state.server = server

    def fail(e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.param, e.kind, "model_not_found" if e.status == 404 else None),
                            status_code=e.status)

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # the server never dies on a request
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", kind="server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not loop.running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": server.created,
                                            "owned_by": "jaxlp", "max_model_len": loop.engine.max_len}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def handle(request: Request, chat: bool):
        try:
            body = await read_body(request)
            server.check_common(body)
            ids = server.chat_prompt(body) if chat else server.completion_prompt(body)
            params = server.sampling(body, len(ids), chat=chat)
            job, queue = server.submit(ids, params)
        except BadRequest as e:
            return fail(e)
        created = int(time.time())
        base = {"id": job.id, "created": created, "model": model_id}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(server, metrics, job, queue, base, chat, include_usage),
                                     media_type="text/event-stream")
        async for out in server.outputs(job, queue):
            pass
        metrics.finished(job)
        if job.finish_reason == "error":
            return JSONResponse(error_body(job.error or "generation failed", kind="server_error"), status_code=500)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": job.text},
                      "finish_reason": job.finish_reason, "logprobs": None}
            return {**base, "object": "chat.completion", "choices": [choice], "usage": usage(job)}
        choice = {"index": 0, "text": job.text, "finish_reason": job.finish_reason, "logprobs": None}
        return {**base, "object": "text_completion", "choices": [choice], "usage": usage(job)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


async def _stream(server: Server, metrics: "Metrics", job, queue, base: dict, chat: bool, include_usage: bool):
    """Server-sent events: one chunk per group of tokens, a last one with the finish reason,
    the usage chunk if asked, then ``data: [DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**base, 'object': kind, 'choices': [choice]})}\n\n"

    if chat:
        yield chunk(None, None, first=True)
    async for out in server.outputs(job, queue):
        if out.finished:
            metrics.finished(job)
            if job.finish_reason == "error":
                yield f"data: {json.dumps(error_body(job.error or 'generation failed', kind='server_error'))}\n\n"
                break
            if out.text:
                yield chunk(out.text, None)
            yield chunk(None if chat else "", job.finish_reason)
            if include_usage:
                yield f"data: {json.dumps({**base, 'object': kind, 'choices': [], 'usage': usage(job)})}\n\n"
        elif out.text:
            yield chunk(out.text, None)
    yield "data: [DONE]\n\n"


class Metrics:
    """Prometheus metrics of one server (its own registry): histograms observed per finished
    request, gauges and counters read from the engine at scrape time."""

    def __init__(self, loop: EngineLoop):
        from prometheus_client import CollectorRegistry, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.loop = loop
        self.registry = CollectorRegistry()
        self.ttft = Histogram("jaxlp_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=TIME_BUCKETS, registry=self.registry)
        self.tpot = Histogram("jaxlp_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TOKEN_TIME_BUCKETS, registry=self.registry)
        self.e2e = Histogram("jaxlp_request_latency_seconds", "Time from arrival to the last token",
                             buckets=TIME_BUCKETS, registry=self.registry)
        engine = loop.engine

        class EngineCollector:
            def collect(self):
                stats = engine.stats()
                gauges = {"jaxlp_queue_length": ("Requests waiting for a slot", stats["waiting"]),
                          "jaxlp_running_slots": ("Slots holding a request", stats["running"]),
                          "jaxlp_slots": ("Slots of the engine", stats["slots"]),
                          "jaxlp_cache_bytes_in_use": ("KV cache bytes of the running requests' slots",
                                                       stats["cache_bytes_in_use"]),
                          "jaxlp_cache_bytes_total": ("KV cache bytes allocated", stats["cache_bytes_total"])}
                for name, (doc, value) in gauges.items():
                    yield GaugeMetricFamily(name, doc, value=value)
                for name, doc in (("prompt_tokens", "Prompt tokens prefilled"),
                                  ("generated_tokens", "Tokens generated"),
                                  ("decode_calls", "Decode device calls"),
                                  ("fp8_decode_calls", "Decode device calls that ran NestedFP's FP8 model")):
                    yield CounterMetricFamily(f"jaxlp_{name}", doc, value=stats.get(name, 0))
                requests = CounterMetricFamily("jaxlp_requests", "Finished requests by finish reason",
                                               labels=["finish_reason"])
                for reason in ("stop", "length", "cancelled", "error"):
                    requests.add_metric([reason], stats.get(f"requests_{reason}", 0))
                yield requests

        self.registry.register(EngineCollector())

    def finished(self, job) -> None:
        if job.ttft is not None:
            self.ttft.observe(job.ttft)
        if job.tpot is not None:
            self.tpot.observe(job.tpot)
        if job.finished_at is not None:
            self.e2e.observe(job.finished_at - job.arrival)

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def warm_app(model, tokenizer, *, model_id: str, chat_template: ChatTemplate | None = None, warmup_lengths=(16,),
             **engine_kwargs):
    """``(app, loop)``: an engine over ``model`` (``engine_kwargs`` go to :class:`Engine`), warmed
    up on ``warmup_lengths``, its loop started, and the FastAPI app serving it (stop the loop
    when done)."""
    from jaxlp.serving.engine import Engine

    engine = Engine(model, tokenizer=tokenizer, **engine_kwargs)
    engine.warmup(warmup_lengths)
    loop = EngineLoop(engine).start()
    try:
        return create_app(loop, tokenizer, model_id=model_id, chat_template=chat_template), loop
    except BaseException:
        loop.stop()
        raise


def serve(model, tokenizer, *, model_id: str, kv_cache: str = "bf16", host: str = "127.0.0.1", port: int = 8000,
          chat_template: ChatTemplate | None = None, warmup_lengths=(16,), log_level: str = "warning",
          **engine_kwargs) -> None:
    """Build an engine over ``model``, warm it up, and serve it with uvicorn until interrupted."""
    import uvicorn

    app, loop = warm_app(model, tokenizer, model_id=model_id, chat_template=chat_template,
                         warmup_lengths=warmup_lengths, kv_cache=kv_cache, **engine_kwargs)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        loop.stop()
