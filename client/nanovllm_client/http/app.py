"""The Starlette app: routes, keys, limits, SSE streaming and the front's own metrics."""
from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import (EngineDeadError, RequestError, RequestTimeoutError, ServiceDrainingError,
                      ServiceUnavailableError)
from ..protocol import FinishReason, join_logprobs
from . import anthropic, chat_output, responses, tokenize
from . import logprobs as lp
from .errors import ApiError, bad
from .schema import Call, parse_chat, parse_completion
from .tenant import tenant_of


@dataclass
class Settings:
    model: str = "default"
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    max_streams: int = 256
    health: Callable[[], Any] | None = None
    """Blocking: returns a HealthReport (run in a thread)."""
    allowed_origins: tuple[str, ...] = ()
    """Origins whose browser pages may call the API (CORS headers and preflights); none by default."""
    tenants: bool = True
    """Tell the service whom each request is for (`tenant_of`): off for a front with a CURVE key of
    its own, whose word the service does not take."""


@dataclass
class Metrics:
    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    active: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    disconnects: int = 0

    def count(self, route: str, status: int) -> None:
        self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def text(self) -> str:
        lines = ["# TYPE nanovllm_http_requests_total counter"]
        lines += [f'nanovllm_http_requests_total{{route="{r}",status="{s}"}} {n}'
                  for (r, s), n in sorted(self.requests.items())]
        lines += ["# TYPE nanovllm_http_active_requests gauge", f"nanovllm_http_active_requests {self.active}",
                  "# TYPE nanovllm_http_prompt_tokens_total counter",
                  f"nanovllm_http_prompt_tokens_total {self.prompt_tokens}",
                  "# TYPE nanovllm_http_completion_tokens_total counter",
                  f"nanovllm_http_completion_tokens_total {self.completion_tokens}",
                  "# TYPE nanovllm_http_client_disconnects_total counter",
                  f"nanovllm_http_client_disconnects_total {self.disconnects}"]
        return "\n".join(lines) + "\n"


ENGINE_METRICS = [
    # (vLLM's name, type, help, value from the engine's stats)
    ("vllm:num_requests_running", "gauge", "Requests in the engine's running batch.", lambda e: e["num_running"]),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission in the engine.", lambda e: e["num_waiting"]),
    ("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0..1).",
     lambda e: (e["num_total_blocks"] - e["num_free_blocks"]) / e["num_total_blocks"]),
    ("vllm:num_preemptions_total", "counter", "Preemptions of running requests.", lambda e: e["num_preemptions"]),
    ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     lambda e: e["prefix_cache_queries"]),
    ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.",
     lambda e: e["prefix_cache_hits"]),
]
"""The engine's state on the front's /metrics, by vLLM's names, so a router or an autoscaler
scraping one URL per worker reads it (the stages' own ports carry the rest, as nanovllm:...)."""


def engine_metrics_text(engine: dict | None) -> str:
    """The engine's stats (from `server_stats`) in the Prometheus text format; with `engine` None
    (no answer from the service) only `nanovllm_http_engine_stats_up 0`."""
    lines = ["# TYPE nanovllm_http_engine_stats_up gauge", f"nanovllm_http_engine_stats_up {int(bool(engine))}"]
    for name, kind, text, value in ENGINE_METRICS:
        try:
            v = float(value(engine or {}))
        except (KeyError, TypeError, ZeroDivisionError):
            continue
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {v}"]
    return "\n".join(lines) + "\n"


def _package_version() -> str:
    try:
        return importlib.metadata.version("nanovllm-client")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


_VERSION = _package_version()


@dataclass
class Opened:
    """One choice's stream, started: its index among the request's choices, and when streaming
    its first delta (read before the headers)."""
    index: int
    stream: Any
    events: Any
    first: Any = None


def _summed_usage(usages: list[dict], n: int) -> dict:
    """One request's usage over its choices: each prompt counted once (its first choice's), the
    completions all."""
    out = {"prompt_tokens": sum(u["prompt_tokens"] for u in usages[::n]),
           "completion_tokens": sum(u["completion_tokens"] for u in usages)}
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages[::n])
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


@dataclass
class Answer:
    """A whole (not streamed) answer, collected."""
    text: str = ""
    events: list = field(default_factory=list)
    parser: Any = None
    reason: str | None = None
    usage: dict = field(default_factory=dict)
    logprobs: list | None = None
    """Every token's entry, when asked for (None where some were lost: `join_logprobs`)."""
    prompt_logprobs: list | None = None
    num_tokens: int = 0
    stop_reason: str | None = None
    """The stop string that ended it, if one did."""


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _service_error(e: Exception) -> ApiError:
    if isinstance(e, ServiceDrainingError):
        return ApiError(503, f"the service is draining: {e}", code="draining")
    if isinstance(e, (ServiceUnavailableError, EngineDeadError)):
        return ApiError(503, f"the service is unavailable: {e}", code="unavailable")
    if isinstance(e, RequestTimeoutError):
        return ApiError(503, str(e), code="timeout")
    if isinstance(e, ValueError):
        return bad(str(e))
    if isinstance(e, RequestError):  # refused by a stage: the prompt (too long, a bad template) or a value
        # The stages name the field they refuse in their message; response_format is the one
        # refused only there (a stage compiles its grammar), so it is named as the param.
        return bad(f"request failed: {e}", "response_format" if "response_format" in str(e) else None)
    return ApiError(500, f"request failed: {e}")


def _usage(u: dict | None, echo_only: bool = False) -> dict:
    """OpenAI's usage for the service's; `echo_only`: the token made past the echoed prompt was
    dropped (`Call.echo_only`), so none counts."""
    u = u or {}
    prompt, completion = u.get("prompt_tokens", 0), 0 if echo_only else u.get("completion_tokens", 0)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if u.get("cached_tokens"):
        out["prompt_tokens_details"] = {"cached_tokens": u["cached_tokens"]}
    return out


def _finish(reason: FinishReason | None) -> str | None:
    """OpenAI's finish_reason for ours: an abort (the stream was stopped) reads as "stop"."""
    return None if reason is None else "stop" if reason == FinishReason.ABORT else FinishReason(reason).value


def build_app(client: Any, settings: Settings) -> Starlette:
    """`client`: a started AsyncClient (or anything with its `stream`)."""
    metrics = Metrics()

    def authorized(request: Request) -> str | None:
        """The request's tenant (None where the service is not told), or ApiError 401."""
        peer = request.client.host if request.client else None
        if not settings.api_keys:
            return tenant_of(None, peer) if settings.tenants else None
        header = request.headers.get("authorization", "")
        # Bearer (OpenAI's SDKs) or x-api-key (Anthropic's): the same keys either way.
        given = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "").strip()
        ok = False
        for key in settings.api_keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given.encode(), key.encode())
        if not ok:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
        return tenant_of(given, peer) if settings.tenants else None

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            raise ApiError(413, f"the body is larger than {settings.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > settings.max_body_bytes:
                raise ApiError(413, f"the body is larger than {settings.max_body_bytes} bytes")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise bad(f"the body is not valid JSON: {str(e)[:200]}") from None

    async def model_card() -> dict:
        """The one model, with its context length (`max_model_len`) once the engine has said it."""
        card = {"id": settings.model, "object": "model", "created": 0, "owned_by": "nanovllm"}
        try:
            engine = (await client.server_stats(timeout=5.0)).get("engine") or {}
        except Exception:  # noqa: BLE001 — a service not up yet: the card without it
            engine = {}
        if isinstance(engine.get("max_model_len"), int):
            card["max_model_len"] = engine["max_model_len"]
        return card

    async def models(request: Request) -> Response:
        try:
            authorized(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [await model_card()]})

    async def model(request: Request) -> Response:
        try:
            authorized(request)
            if request.path_params["name"] != settings.model:
                raise ApiError(404, f"the model '{request.path_params['name'][:128]}' does not exist; this server "
                                    f"serves '{settings.model}'", "model", "model_not_found")
        except ApiError as e:
            return _error(e)
        return JSONResponse(await model_card())

    async def version(request: Request) -> Response:
        return JSONResponse({"version": _VERSION})

    async def command(request: Request, route: str, run: Callable[[], Any], field: str | None) -> Response:
        """A route answered by one command to the service (tokenize, detokenize, the cache reset):
        the key checked, then `run()` (which reads the body if it needs one and raises ApiError for a
        bad one); the service's refusal a 400 naming `field`, its absence or drain a 503."""
        try:
            authorized(request)
            body = await run()
        except ApiError as e:
            metrics.count(route, e.status)
            return _error(e)
        except (ServiceUnavailableError, RequestTimeoutError) as e:
            err = _service_error(e)
            metrics.count(route, err.status)
            return _error(err)
        except (RequestError, ValueError) as e:  # the service's refusal, or the client's own check
            metrics.count(route, 400)
            return _error(bad(str(e), field))
        metrics.count(route, 200)
        return JSONResponse(body)

    def served_model(name: str | None) -> None:
        if name is not None and name != settings.model:
            raise ApiError(404, f"the model '{name[:128]}' does not exist; this server serves '{settings.model}'",
                           "model", "model_not_found")

    async def tokenize_route(request: Request) -> Response:
        """vLLM's /tokenize, answered by the tokenizer stage (tokenize.py)."""
        async def run() -> dict:
            name, prompt, options = tokenize.parse_tokenize(await read_json(request))
            served_model(name)
            try:
                tokenized = await client.tokenize(prompt, **options)
            except (RequestError, ValueError) as e:
                raise bad(str(e), "messages" if isinstance(prompt, list) else "prompt") from None
            limit = None if tokenized.max_model_len else (await model_card()).get("max_model_len")
            return tokenize.tokenize_body(tokenized, limit, options["return_token_strs"])

        return await command(request, "tokenize", run, None)

    async def detokenize_route(request: Request) -> Response:
        """vLLM's /detokenize, answered by the tokenizer stage (tokenize.py)."""
        async def run() -> dict:
            name, tokens = tokenize.parse_detokenize(await read_json(request))
            served_model(name)
            return {"prompt": await client.detokenize(tokens)}

        return await command(request, "detokenize", run, "tokens")

    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's /reset_prefix_cache (SGLang's router calls it /flush_cache): the engine forgets
        every cached KV block no running request holds and says how many; 503 while draining."""
        async def run() -> dict:
            return {"freed_blocks": await client.reset_prefix_cache()}

        return await command(request, "reset_prefix_cache", run, None)

    async def health(request: Request) -> Response:
        if settings.health is None:
            return JSONResponse({"status": "unknown"})
        report = await asyncio.to_thread(settings.health)
        body = {"status": "ok" if report.healthy else "unhealthy",
                "stages": {r: s.state for r, s in report.stages.items()}}
        return JSONResponse(body, status_code=200 if report.healthy else 503)

    async def metrics_route(request: Request) -> Response:
        try:
            engine = (await client.server_stats(timeout=2.0)).get("engine") or {}
        except Exception:  # noqa: BLE001 — the service down: the front's own metrics, and that it is down
            engine = None
        return PlainTextResponse(metrics.text() + engine_metrics_text(engine), media_type="text/plain; version=0.0.4")

    async def open_streams(request: Request, parse: Callable[[Any], Call]) -> tuple[Call, list[Opened]]:
        """Authorize, parse and start one request's choices (one stream each; `Call.choices`), each
        with its first delta when streaming. Raises ApiError (the service's refusal as one), with
        every stream it started cancelled."""
        call: Call | None = None
        opened: list[Opened] = []
        try:
            tenant = authorized(request)
            call = parse(await read_json(request))
            if call.model != settings.model:
                raise ApiError(404, f"the model '{call.model[:128]}' does not exist; this server serves "
                                    f"'{settings.model}'", "model", "model_not_found")
            choices = call.choices()
            if metrics.active + len(choices) > settings.max_streams:
                raise ApiError(429, f"too many requests in flight (at most {settings.max_streams})")
            for index, prompt, sampling in choices:
                metrics.active += 1
                try:
                    stream = await client.stream(prompt, sampling=sampling, tenant=tenant, **call.kwargs)
                except BaseException:
                    metrics.active -= 1
                    raise
                opened.append(Opened(index, stream, aiter(stream)))
            # The first deltas before the headers: a request the stages refuse (a prompt too
            # long, a schema that does not compile) gets its 400, not a 200 and an error event.
            if call.stream:
                for o in opened:
                    o.first = await anext(o.events)
        except BaseException as e:
            for o in opened:
                o.stream.cancel()
                metrics.active -= 1
            if isinstance(e, ApiError) or not isinstance(e, Exception):
                raise
            err = _service_error(e)
            if call is not None and call.forced and err.param == "response_format":  # the forced call's grammar
                err = bad(f"the forced tool call's grammar (from the tools' parameter schemas) was refused: {e}",
                          "tools")
            raise err from None
        return call, opened

    async def generate(request: Request, route: str, parse: Callable[[Any], Call], chat: bool) -> Response:
        try:
            call, opened = await open_streams(request, parse)
        except ApiError as e:
            metrics.count(route, e.status)
            return _error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if call.stream:
            metrics.count(route, 200)
            body = _sse(opened, call, rid, created, kind, chat, settings.model, metrics)
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        answers = await asyncio.gather(*(collect(o.stream, call, chat) for o in opened), return_exceptions=True)
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is not None:
            err = _service_error(failed) if isinstance(failed, Exception) else ApiError(500, "request failed")
            metrics.count(route, err.status)
            return _error(err)
        choices = []
        prompts = [prompt for _, prompt, _ in call.choices()] if not chat else []
        for o, answer in zip(opened, answers):
            if chat:
                choices.append({"index": o.index, "message": chat_output.message(answer.events, answer.parser.calls),
                                "finish_reason": chat_output.finish_reason(answer.reason, answer.parser.calls),
                                "logprobs": lp.chat_logprobs(answer.logprobs) if call.logprobs else None,
                                "stop_reason": answer.stop_reason})
            else:
                choices.append(_completion_choice(o.index, call, prompts[o.index], answer))
        body = {"id": rid, "object": kind, "created": created, "model": settings.model, "choices": choices,
                "usage": _summed_usage([a.usage for a in answers], call.n)}
        if chat and call.prompt_logprobs:  # vLLM's: beside the choices (one prompt)
            body["prompt_logprobs"] = lp.vllm_prompt_logprobs(answers[0].prompt_logprobs)
        metrics.count(route, 200)
        return JSONResponse(body)

    async def collect(stream: Any, call: Call, chat: bool) -> Answer:
        """A whole answer: chat's through the same parser a stream goes through, fed as the text
        arrives; the stream ended and counted either way."""
        answer, parser, usage = Answer(), None, None
        try:
            async for d in stream:
                if chat:
                    if parser is None:
                        parser = call.output_parser(d.reasoning_open)  # every delta carries it
                    answer.events += _parse(parser, d, stream)
                else:
                    answer.text += d.text
                answer.logprobs = join_logprobs(answer.logprobs, answer.num_tokens, d.logprobs, len(d.token_ids))
                answer.num_tokens += len(d.token_ids)
                answer.prompt_logprobs = answer.prompt_logprobs or d.prompt_logprobs
                if d.finished:
                    answer.reason, usage, answer.stop_reason = _finish(d.finish_reason), d.usage, d.stop_reason
        finally:
            stream.cancel()
            metrics.active -= 1
        answer.usage = _usage(usage, call.echo_only)
        metrics.prompt_tokens += answer.usage["prompt_tokens"]
        metrics.completion_tokens += answer.usage["completion_tokens"]
        if chat:
            answer.parser = parser or call.output_parser()
            answer.events += answer.parser.finish()
        return answer

    async def typed_api(request: Request, route: str, parse: Callable[[Any], Call],
                        error_json: Callable[[ApiError], dict], writer: Callable[[], Any],
                        whole: Callable[[Answer], dict]) -> Response:
        """The chat path in another API's shapes (OpenAI's Responses, Anthropic's Messages): `writer()`
        makes its stream's events (`_events_sse`), `whole` its answer, `error_json` its errors."""
        def refused(e: ApiError) -> Response:
            metrics.count(route, e.status)
            return JSONResponse(error_json(e), status_code=e.status)

        try:
            call, (opened,) = await open_streams(request, parse)  # one choice: these APIs have no n
        except ApiError as e:
            return refused(e)
        first, events, stream = opened.first, opened.events, opened.stream
        if call.stream:
            metrics.count(route, 200)
            return StreamingResponse(_events_sse(first, events, stream, call, writer(), metrics),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            answer = await collect(stream, call, True)
        except Exception as e:  # noqa: BLE001
            return refused(_service_error(e))
        metrics.count(route, 200)
        return JSONResponse(whole(answer))

    async def responses_route(request: Request) -> Response:
        """OpenAI's Responses API, stateless (responses.py)."""
        rid, created = responses.new_id()

        def whole(answer: Answer) -> dict:
            return responses.response_body(rid, created, settings.model,
                                           "incomplete" if answer.reason == "length" else "completed",
                                           responses.output_items(answer.events, answer.parser.calls), answer.usage,
                                           answer.reason)

        return await typed_api(request, "responses", responses.parse_response_request, ApiError.body,
                               lambda: responses.StreamItems(rid, created, settings.model), whole)

    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (anthropic.py)."""
        msg_id = anthropic.new_id()
        return await typed_api(request, "messages", anthropic.parse_messages, anthropic.error_body,
                               lambda: anthropic.StreamBlocks(msg_id, settings.model),
                               lambda a: anthropic.message_body(a.events, a.parser.calls, a.reason, a.usage,
                                                                settings.model, msg_id, a.stop_reason))

    async def completions(request: Request) -> Response:
        return await generate(request, "completions", parse_completion, False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat", parse_chat, True)

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(ApiError(404, f"no such path: {request.url.path[:200]}"))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(ApiError(405, f"method {request.method} not allowed on {request.url.path[:200]}"))

    app = Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/flush_cache", reset_prefix_cache, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/responses", responses_route, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ], exception_handlers={404: not_found, 405: not_allowed})
    app.state.metrics = metrics
    if settings.allowed_origins:  # answered before the routes: a preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "X-Api-Key"], max_age=600)
    return app


async def _sse(opened: list[Opened], call: Call, rid: str, created: int, kind: str, chat: bool, model: str,
               metrics: Metrics) -> AsyncIterator[bytes]:
    """The SSE body of a request's choices (each `Opened`: its first delta, then the rest of its
    stream's, interleaved as they come, each chunk with its choice's index); cancelled by the server
    when the HTTP client goes away, which aborts every choice's request."""
    chunk_kind = kind + ".chunk" if chat else kind

    def event(choices: list, usage: dict | None = None, with_usage: bool = False) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": chunk_kind, "created": created, "model": model,
                                "choices": choices}
        if with_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    streams = {o.index: o.stream for o in opened}
    prompts = {index: prompt for index, prompt, _ in call.choices()} if call.echo else {}  # what echo shows
    # every delta carries reasoning_open
    parsers = {o.index: call.output_parser(o.first.reasoning_open) for o in opened} if chat else {}
    held: dict[int, list] = {}  # chat: logprob entries of tokens whose text the parser still holds
    pieces: dict[int, lp.CompletionLogprobs] = {}
    usages: dict[int, dict] = {}
    try:
        for index in parsers:
            yield event([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                        None, call.include_usage)
        async for index, d in _deltas(opened):
            reason = _finish(d.finish_reason) if d.finished else None
            parser = parsers.get(index)
            if parser is not None:  # reasoning, tool calls and content, each in its own chunk
                if call.logprobs and d.logprobs:
                    held.setdefault(index, []).extend(d.logprobs)
                for e in _parse(parser, d, streams[index]) + (parser.finish() if d.finished else []):
                    yield event([{"index": index, "delta": chat_output.delta(e), "finish_reason": None,
                                  "logprobs": _held_logprobs(held, index)}], None, call.include_usage)
                if reason:
                    yield event([{"index": index, "delta": {}, "logprobs": _held_logprobs(held, index),
                                  "finish_reason": chat_output.finish_reason(reason, parser.calls),
                                  "stop_reason": d.stop_reason}], None, call.include_usage)
            else:
                piece = pieces.get(index)
                if piece is None:  # the choice's first delta
                    piece = pieces[index] = lp.CompletionLogprobs()
                    if call.echo:  # the prompt first: its text (and its tokens' logprobs)
                        echoed = _echo(call, prompts[index], d.prompt_logprobs, piece)
                        yield event([{"index": index, "text": echoed[0], "finish_reason": None,
                                      "logprobs": echoed[1]}], None, call.include_usage)
                text, entries = ("", None) if call.echo_only else (d.text, d.logprobs)
                reason = "length" if call.echo_only and reason else reason  # max_tokens 0 reached
                if text or reason or (call.logprobs and entries):
                    chunk = {"index": index, "text": text, "finish_reason": reason,
                             "logprobs": piece.piece(entries) if call.logprobs and entries is not None else None}
                    if reason:
                        chunk["stop_reason"] = d.stop_reason
                    yield event([chunk], None, call.include_usage)
            if d.finished:
                usages[index] = usage = _usage(d.usage, call.echo_only)
                metrics.prompt_tokens += usage["prompt_tokens"]
                metrics.completion_tokens += usage["completion_tokens"]
        if call.include_usage:
            yield event([], _summed_usage([usages[i] for i in sorted(usages)], call.n), True)
        yield b"data: [DONE]\n\n"
    except (RequestError, ServiceUnavailableError, RequestTimeoutError) as e:
        err = _service_error(e)
        usages = dict.fromkeys(streams, {})  # ended: not a disconnect
        yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        _ended(len(usages) == len(streams), list(streams.values()), metrics)


async def _deltas(opened: list[Opened]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, delta) of every choice's stream, first deltas first; one stream is read
    directly, several are read at once by one task each and interleaved as the deltas come."""
    if len(opened) == 1:
        async for d in _chain(opened[0].first, opened[0].events):
            yield opened[0].index, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(o: Opened) -> None:
        try:
            async for d in _chain(o.first, o.events):
                queue.put_nowait((o.index, d, None))
        except Exception as e:  # noqa: BLE001 — handed to the reader
            queue.put_nowait((o.index, None, e))
            return
        queue.put_nowait((o.index, None, None))

    tasks = [asyncio.create_task(pump(o)) for o in opened]
    try:
        ended = 0
        while ended < len(tasks):
            index, d, error = await queue.get()
            if error is not None:
                raise error
            if d is None:
                ended += 1
            else:
                yield index, d
    finally:
        for t in tasks:
            t.cancel()


async def _events_sse(first: Any, events: AsyncIterator[Any], stream: Any, call: Call, writer: Any,
                     metrics: Metrics) -> AsyncIterator[bytes]:
    """An SSE body of typed events (Anthropic's Messages, OpenAI's Responses): `writer` turns the
    parser's events into its API's (`start()`, `feed(event)`, `finish(usage, reason, calls)`,
    `error(api_error)`, each a list of encoded events); the stream ends as `_sse`'s does."""
    finished = False
    parser = call.output_parser(first.reasoning_open)
    try:
        for chunk in writer.start():
            yield chunk
        async for d in _chain(first, events):
            for e in _parse(parser, d, stream) + (parser.finish() if d.finished else []):
                for chunk in writer.feed(e):
                    yield chunk
            if d.finished:
                finished = True
                usage = _usage(d.usage)
                metrics.prompt_tokens += usage["prompt_tokens"]
                metrics.completion_tokens += usage["completion_tokens"]
                for chunk in writer.finish(usage, _finish(d.finish_reason), parser.calls, d.stop_reason):
                    yield chunk
    except (RequestError, ServiceUnavailableError, RequestTimeoutError) as e:
        finished = True
        for chunk in writer.error(_service_error(e)):
            yield chunk
    finally:
        _ended(finished, [stream], metrics)


def _held_logprobs(held: dict[int, list], index: int) -> dict | None:
    """Chat's logprobs for a chunk: the entries held for its choice since its last chunk (the
    tokens a chunk's text came from arrive with it or before it), taken."""
    entries = held.pop(index, None)
    return lp.chat_logprobs(entries) if entries else None


def _echo(call: Call, prompt: Any, entries: list | None, piece: lp.CompletionLogprobs) -> tuple[str, dict | None]:
    """Completions' echo: the prompt's text (as given, or its tokens' text for token ids) and,
    with logprobs, its tokens' (the first null); `piece` then counts offsets past it."""
    text = prompt if isinstance(prompt, str) else lp.prompt_text(entries or [])
    logprobs = piece.piece(entries, first_given=True) if call.logprobs and entries is not None else None
    piece.offset = len(text)
    return text, logprobs


def _completion_choice(index: int, call: Call, prompt: Any, answer: Answer) -> dict:
    """A whole completion's choice: its text (after the echoed prompt), logprobs in the legacy
    lists, and vLLM's prompt_logprobs where asked."""
    piece = lp.CompletionLogprobs()
    text, logprobs = _echo(call, prompt, answer.prompt_logprobs, piece) if call.echo else ("", None)
    if not call.echo_only:
        text += answer.text
        if call.logprobs and answer.logprobs is not None:
            mine = piece.piece(answer.logprobs)
            logprobs = mine if logprobs is None else lp.joined(logprobs, mine)
    elif call.logprobs and logprobs is None:
        logprobs = piece.piece([])
    reason = "length" if call.echo_only and answer.reason else answer.reason  # max_tokens 0 reached
    choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs,
              "stop_reason": answer.stop_reason}
    if call.prompt_logprobs:
        choice["prompt_logprobs"] = lp.vllm_prompt_logprobs(answer.prompt_logprobs)
    return choice


def _ended(finished: bool, streams: list, metrics: Metrics) -> None:
    """A streamed body is done (finished, failed or cut by the client): count it, abort what runs."""
    if not finished:
        metrics.disconnects += 1
    for stream in streams:
        stream.cancel()  # aborts the request in the engine when it did not finish (idempotent)
        metrics.active -= 1


def _parse(parser: chat_output.ChatOutputParser, d: Any, stream: Any) -> list[chat_output.Event]:
    """The events of delta `d`. Once the parser drops the rest of the output (the one call of
    `parallel_tool_calls: false` is complete) the request is stopped: the engine frees its blocks
    instead of generating to max_tokens, and the stream still ends with its usage."""
    events = parser.feed(d.text)
    if parser.done and not d.finished:
        stream.stop()  # once: later calls send nothing
    return events


async def _chain(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for d in events:
        yield d
