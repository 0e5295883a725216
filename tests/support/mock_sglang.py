"""A stand-in SGLang 0.5.23 server backed by any `Engine`, for tests and local runs.

It speaks SGLang's HTTP API as a server started with `--skip-tokenizer-init` does (ids in,
ids out) and is strict where SGLang is: an unknown `sampling_params` key is a 400. It is
stricter on top-level `/generate` keys (unknown ones are a 400 too), to catch client typos
that sglang-router would otherwise drop without a word. Features SGLang has but this
worker does not (text input, batched input, penalties, grammars, CUDA IPC weight updates,
NCCL groups without a GPU) are refused with a 400 that says so, never faked.

Weights broadcast by a trainer are received for real: `/init_weights_update_group` joins
the trainer's group (`agentflow.inference.broadcast`; `gloo` on CPU) and
`/update_weights_from_distributed` receives each bucket from it. Buckets are staged and
the engine switches, all at once, when they cover every weight. `stream: true` answers with SGLang's
non-incremental server-sent events (each chunk the output so far, `completion_tokens` in
its `meta_info`), a chunk per decode step of an engine that streams. Backed by
`LocalEngine`, the answers are real model output.

Only `stop_token_ids` stop generation (the model's EOS is not implied, as with
`ignore_eos`). Requests that arrive while generation is paused wait until it continues,
as they do in SGLang's scheduler.

Routes under `/mock/` are this worker's own: the request log tests use to see where the
router sent what.

With `image_understanding`, the worker says so in `/model_info` and takes `image_data`
(one data URL per image placeholder, checked and logged); the text-only model behind it
then answers from the ids alone. Without it, `image_data` is a 400, as from a text model.

SGLang's schema itself (field names, defaults, the keys it knows) comes from the client's
`agentflow.inference.sglang_wire`, so the worker and the client cannot disagree on it;
this module holds only what the worker enforces on top and how it behaves.

Run from the repository root: `python -m tests.support.mock_sglang --port P
--model-init '{"layers": 2}'` (or `--model-path DIR` for an HF-format directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from agentflow.errors import AgentFlowError, CapacityExceeded, EngineError, EngineUnavailable
from agentflow.inference import broadcast
from agentflow.inference import sglang_wire as wire
from agentflow.inference.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    SessionRef,
    TensorBucket,
    TokenObserver,
    WeightGroup,
    WeightUpdate,
    generate_observed,
)


class Refusal(ValueError):
    """A request this worker answers with a 400."""


def parse_generate(raw: dict[str, Any]) -> wire.GenerateBody:
    """A `/generate` body as SGLang would take it, refusing what this worker cannot honour.

    Every key SGLang knows is accepted; the ones that change the answer must keep their
    default (or be absent), so a request never silently gets a different behaviour than
    it would from SGLang. Keys SGLang does not know are refused, as SGLang refuses unknown
    `sampling_params` keys.
    """
    ours = wire.GenerateBody.model_fields.keys()
    unknown = raw.keys() - ours - wire.GENERATE_DEFAULTS.keys() - wire.GENERATE_INERT
    if unknown:
        raise Refusal(f"unknown /generate keys: {sorted(unknown)}")
    _require_defaults(raw, wire.GENERATE_DEFAULTS, "")
    if "input_ids" not in raw:
        raise Refusal("input_ids is required (this server runs without a tokenizer)")
    if not isinstance(raw["input_ids"], list) or not raw["input_ids"]:
        raise Refusal("input_ids must be a non-empty list of ids")
    if isinstance(raw["input_ids"][0], list):
        raise Refusal("batched input_ids are not supported by this worker")
    sampling = raw.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise Refusal("sampling_params must be an object")
    start = raw.get("logprob_start_len", -1)
    if start != -1 and (
        not isinstance(start, int)
        or start < 0
        or sampling.get("max_new_tokens", 128) != 0
        or not raw.get("return_logprob")
    ):
        raise Refusal(
            "input log-probs (logprob_start_len >= 0) only for scoring: with "
            "return_logprob and sampling_params.max_new_tokens = 0"
        )
    implemented = wire.SamplingParamsBody.model_fields.keys()
    unknown = sampling.keys() - implemented - wire.SAMPLING_DEFAULTS.keys()
    unknown -= wire.SAMPLING_TEXT_ONLY
    if unknown:
        # SGLang's own wording for the same mistake.
        raise Refusal(f"Unknown sampling parameter(s): {sorted(unknown)}")
    _require_defaults(sampling, wire.SAMPLING_DEFAULTS, "sampling_params.")
    session = raw.get("session_params")
    if isinstance(session, dict) and (
        session.get("replace") or session.get("drop_previous_output")
    ):
        raise Refusal("session_params.replace/drop_previous_output are not supported")
    kept = {k: v for k, v in sampling.items() if k in implemented}
    body = {k: v for k, v in raw.items() if k in ours}
    return wire.GenerateBody.model_validate({**body, "sampling_params": kept})


def _require_defaults(body: dict[str, Any], defaults: dict[str, Any], prefix: str) -> None:
    for key, default in defaults.items():
        if key in body and body[key] != default and body[key] is not None:
            raise Refusal(f"{prefix}{key}={body[key]!r} is not supported by this worker")


def _version(weight_version: str | None) -> int | None:
    """The integer version an update names; None: the engine's next."""
    if weight_version is None:
        return None
    try:
        return wire.version_from_wire(weight_version)
    except EngineError as exc:
        raise Refusal(f"{exc.message}: this worker counts integers") from None


def _failure(message: str) -> JSONResponse:
    """SGLang's answer to a weights call that did not succeed."""
    return JSONResponse({"success": False, "message": message}, status_code=400)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


class WorkerState:
    """What the server keeps besides the engine: pause gate, in-flight rids, request log."""

    def __init__(self, engine: Engine, model_path: str | None, context_length: int | None):
        self.engine = engine
        self.model_path = model_path
        self.context_length = context_length
        self.running = asyncio.Event()
        self.running.set()
        self.in_flight: set[str] = set()
        self.held: dict[str, asyncio.Event] = {}  # rid -> set when aborted while held
        self.log: deque[dict[str, Any]] = deque(maxlen=10_000)  # recent /generate calls
        self.control: deque[dict[str, Any]] = deque(maxlen=10_000)  # other routes, in order
        self.weight_groups: dict[str, Any] = {}  # group name -> torch process group
        self.staged: dict[str, Any] = {}  # received tensors not yet loaded

    async def hold_while_paused(self, rid: str) -> bool:
        """Wait for continue; False when the request was aborted meanwhile."""
        if self.running.is_set():
            return True
        aborted = self.held[rid] = asyncio.Event()
        waiters = [
            asyncio.ensure_future(self.running.wait()),
            asyncio.ensure_future(aborted.wait()),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            return not aborted.is_set()
        finally:
            for task in waiters:
                task.cancel()
            self.held.pop(rid, None)


def _meta(
    result: GenerateResult, *, return_logprob: bool, max_new_tokens: int, version: int
) -> dict[str, Any]:
    """SGLang's meta_info; `version` is the engine's, reported when no token was made."""
    reason: dict[str, Any]
    if result.finish_reason == "stop":
        reason = {"type": "stop", "matched": result.output_ids[-1] if result.output_ids else None}
    elif result.finish_reason == "length":
        reason = {"type": "length", "length": max_new_tokens}
    else:
        reason = {"type": "abort", "message": "Abort before or during generation."}
    spans = sorted(result.weight_versions, key=lambda s: s.start)
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "weight_version": wire.version_to_wire(spans[-1].version if spans else version),
    }
    if len(spans) > 1:
        meta["weight_versions"] = [
            {"version": wire.version_to_wire(s.version), "start": s.start, "end": s.end}
            for s in spans
        ]
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids, strict=True)
        ]
    if result.top_logprobs is not None:
        meta["output_top_logprobs"] = [
            [[lp, tok, None] for tok, lp in step] for step in result.top_logprobs
        ]
    return meta


def _to_request(body: wire.GenerateBody, routing_key: str | None) -> GenerateRequest:
    sp = body.sampling_params
    session = None
    if body.session_params is not None:
        session = SessionRef(
            session_id=body.session_params.id,
            parent_rid=body.session_params.rid,
            offset=body.session_params.offset,
        )
    return GenerateRequest(
        input_ids=tuple(body.input_ids),
        sampling=SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            max_new_tokens=sp.max_new_tokens,
            stop_token_ids=tuple(sp.stop_token_ids or ()),
            seed=sp.sampling_seed,
            top_logprobs=body.top_logprobs_num or 0,
        ),
        rid=body.rid or uuid.uuid4().hex,
        session=session,
        routing_key=routing_key,
    )


def create_mock_worker(
    engine: Engine,
    *,
    model_path: str | None = None,
    context_length: int | None = None,
    close_engine: bool = False,
    image_understanding: bool = False,
) -> FastAPI:
    """The app; `model_path` is what `/model_info` reports (the router keys models by it).

    Give a local directory: sglang-router 0.3.2 loads a tokenizer from the path it reads
    there, and a name that is not a local directory makes it try a model hub.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_engine:
            await engine.close()

    app = FastAPI(title="mock SGLang worker", lifespan=lifespan)
    state = WorkerState(engine, model_path, context_length)
    app.state.worker = state

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise Refusal("body is not JSON") from None
        if not isinstance(body, dict):
            raise Refusal("body must be a JSON object")
        return body

    @app.exception_handler(Refusal)
    async def _refused(request: Request, exc: Refusal) -> JSONResponse:
        return _error(str(exc))

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, exc: ValidationError) -> JSONResponse:
        return _error(str(exc))

    @app.exception_handler(AgentFlowError)
    async def _engine_error(request: Request, exc: AgentFlowError) -> JSONResponse:
        # An engine that is down or full is a 503 (clients retry); a bad request is a 400.
        if isinstance(exc, CapacityExceeded | EngineUnavailable):
            return _error(exc.message, 503)
        return _error(exc.message, 500 if exc.status_code >= 500 else 400)

    async def _score(body: wire.GenerateBody) -> dict[str, Any]:
        """Prefill only: SGLang's `input_token_logprobs` from `logprob_start_len` on, the
        first entry's log-prob None when it starts at token 0 (nothing predicts it)."""
        score = getattr(engine, "score", None)
        if score is None:
            raise Refusal("this worker's engine cannot score input tokens")
        ids = list(body.input_ids)
        start = min(body.logprob_start_len, len(ids))
        values = await asyncio.to_thread(
            score, ids, body.sampling_params.temperature, max(1, start)
        )
        entries: list[list[Any]] = [[None, ids[0], None]] if start == 0 else []
        entries += [[lp, tok, None] for lp, tok in zip(values, ids[max(1, start) :], strict=True)]
        state.log.append({"score": True, "input_ids": ids, "at": time.time()})
        return {
            "output_ids": [],
            "meta_info": {
                "id": body.rid or uuid.uuid4().hex,
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids),
                "completion_tokens": 0,
                "cached_tokens": 0,
                "weight_version": wire.version_to_wire((await engine.info()).weight_version),
                "input_token_logprobs": entries,
            },
        }

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = parse_generate(await json_body(request))
        if body.image_data and not image_understanding:
            raise Refusal("image_data: this model has no image understanding")
        for item in body.image_data or ():
            if not item.startswith("data:image/"):
                raise Refusal("image_data: this worker reads data URLs only")
        if body.logprob_start_len >= 0:
            return await _score(body)
        req = _to_request(body, request.headers.get(wire.ROUTING_KEY_HEADER))
        state.log.append(
            {
                "image_data": list(body.image_data or ()),
                "rid": req.rid,
                "routing_key": req.routing_key,
                "input_ids": list(req.input_ids),
                "max_new_tokens": req.sampling.max_new_tokens,
                "session_params": body.session_params.model_dump() if body.session_params else None,
                "at": time.time(),
            }
        )
        if body.stream:
            return StreamingResponse(_streamed(req, body), media_type="text/event-stream")
        return await _answer(req, body, None)

    async def _answer(
        req: GenerateRequest, body: wire.GenerateBody, observer: TokenObserver | None
    ) -> dict[str, Any]:
        state.in_flight.add(req.rid)
        try:
            if await state.hold_while_paused(req.rid):
                result = await generate_observed(engine, req, observer)
            else:
                result = GenerateResult(
                    rid=req.rid,
                    output_ids=[],
                    logprobs=[],
                    finish_reason="abort",
                    weight_versions=[],
                    prompt_tokens=len(req.input_ids),
                )
        finally:
            state.in_flight.discard(req.rid)
        return {
            "output_ids": result.output_ids,
            "meta_info": _meta(
                result,
                return_logprob=body.return_logprob,
                max_new_tokens=req.sampling.max_new_tokens,
                version=(await engine.info()).weight_version if not result.output_ids else 0,
            ),
        }

    async def _streamed(req: GenerateRequest, body: wire.GenerateBody) -> AsyncIterator[bytes]:
        """SGLang's non-incremental stream: each chunk holds the output so far."""
        chunks: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        ids: list[int] = []
        entries: list[list[Any]] = []

        def observe(new_ids: Sequence[int], logprobs: Sequence[float]) -> None:
            ids.extend(new_ids)
            entries.extend([lp, tok, None] for tok, lp in zip(new_ids, logprobs, strict=True))
            meta: dict[str, Any] = {
                "id": req.rid,
                "finish_reason": None,
                "prompt_tokens": len(req.input_ids),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
            }
            if body.return_logprob:
                meta["output_token_logprobs"] = list(entries)
            chunks.put_nowait({"output_ids": list(ids), "meta_info": meta})

        task = asyncio.create_task(_answer(req, body, observe))
        while not (task.done() and chunks.empty()):
            get = asyncio.ensure_future(chunks.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                yield f"data: {json.dumps(get.result())}\n\n".encode()
            else:
                get.cancel()
        yield f"data: {json.dumps(await task)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    @app.post("/open_session")
    async def open_session(request: Request) -> str:
        body = wire.OpenSessionBody.model_validate(await json_body(request))
        return await engine.open_session(body.session_id)

    @app.post("/close_session")
    async def close_session(request: Request) -> None:
        body = wire.CloseSessionBody.model_validate(await json_body(request))
        await engine.close_session(body.session_id)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> None:
        body = await json_body(request)
        rids = list(state.in_flight) if body.get("abort_all") else [body.get("rid")]
        for rid in rids:
            if not isinstance(rid, str):
                raise Refusal("rid (string) or abort_all is required")
            if rid in state.held:
                state.held[rid].set()
            else:
                await engine.abort(rid)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        state.control.append({"route": "/pause_generation", "body": await json_body(request)})
        body = await json_body(request)
        try:
            mode = PauseMode(body.get("mode", "abort"))
        except ValueError:
            raise Refusal(
                f"mode must be abort, retract or in_place, not {body.get('mode')!r}"
            ) from None
        state.running.clear()
        await engine.pause(mode)
        return {"status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, str]:
        state.control.append({"route": "/continue_generation"})
        await engine.resume()
        state.running.set()
        return {"status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = wire.UpdateWeightsFromDiskBody.model_validate(await json_body(request))
        state.control.append({"route": "/update_weights_from_disk", "body": body.model_dump()})
        if body.abort_all_requests:
            for rid in list(state.in_flight):
                await engine.abort(rid)
        version = _version(body.weight_version)
        try:
            got = await engine.update_weights(WeightUpdate(path=body.model_path, version=version))
        except (AgentFlowError, ValueError, OSError) as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        state.model_path = body.model_path
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights (version {got}).",
                "num_paused_requests": 0,
            }
        )

    def unsupported(route: str) -> JSONResponse:
        return _failure(f"{route}: this worker has no CUDA IPC support")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = wire.InitWeightsUpdateGroupBody.model_validate(await json_body(request))
        state.control.append({"route": "/init_weights_update_group", "body": body.model_dump()})
        if body.backend == "nccl" and not _has_cuda():
            return _failure("NCCL needs a GPU and this worker has none; use backend gloo")
        if body.group_name in state.weight_groups:
            return _failure(f"group {body.group_name!r} exists")
        group = WeightGroup(
            master_address=body.master_address,
            master_port=body.master_port,
            group_name=body.group_name,
            backend=body.backend,  # type: ignore[arg-type]  # checked by WeightGroup
            world_size=body.world_size,
            rank_offset=body.rank_offset,
        )
        try:  # blocks until the trainer and every other rank have joined
            state.weight_groups[body.group_name] = await asyncio.to_thread(
                broadcast.open_group, group, body.rank_offset
            )
        except Exception as exc:  # a rendezvous that timed out, a bad address
            return _failure(f"joining the group failed: {exc}")
        return JSONResponse({"success": True, "message": "Succeeded to initialize group."})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = wire.UpdateWeightsFromDistributedBody.model_validate(await json_body(request))
        state.control.append(
            {"route": "/update_weights_from_distributed", "body": body.model_dump()}
        )
        group = state.weight_groups.get(body.group_name)
        if group is None:
            return _failure(f"no group {body.group_name!r}: call /init_weights_update_group")
        bucket = TensorBucket(names=body.names, dtypes=body.dtypes, shapes=body.shapes)
        try:
            state.staged.update(await asyncio.to_thread(broadcast.receive_bucket, group, bucket))
        except Exception as exc:  # the trainer went away mid-broadcast
            state.staged.clear()
            return _failure(f"receiving the bucket failed: {exc}")
        names = getattr(engine, "weight_names", None)
        if names is not None and set(names()) <= set(state.staged):
            staged, state.staged = state.staged, {}
            update = WeightUpdate(state_dict=staged, version=_version(body.weight_version))
            try:
                await engine.update_weights(update)
            except AgentFlowError as exc:
                return _failure(str(exc))
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        wire.UpdateWeightsFromTensorBody.model_validate(await json_body(request))
        return unsupported("/update_weights_from_tensor")

    async def model_info() -> dict[str, Any]:
        info = await engine.info()
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": wire.version_to_wire(info.weight_version),
            "has_image_understanding": image_understanding,
            "has_audio_understanding": False,
        }

    async def server_info() -> dict[str, Any]:
        info = await engine.info()
        return {
            "model_path": state.model_path,
            "context_length": state.context_length or info.max_context,
            "skip_tokenizer_init": True,
            "version": wire.SGLANG_VERSION,
            "tp_size": 1,
        }

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.get("/health")
    async def health() -> None:
        await engine.info()

    @app.get("/health_generate")
    async def health_generate() -> None:
        await state.running.wait()
        await engine.generate(
            GenerateRequest(input_ids=(0,), sampling=SamplingParams(max_new_tokens=1))
        )

    @app.get("/mock/requests")
    async def mock_requests() -> list[dict[str, Any]]:
        return list(state.log)

    @app.get("/mock/control")
    async def mock_control() -> list[dict[str, Any]]:
        return list(state.control)

    @app.get("/mock/state")
    async def mock_state() -> dict[str, Any]:
        info = await engine.info()
        return {
            "paused": not state.running.is_set(),
            "in_flight": sorted(state.in_flight),
            "held": sorted(state.held),
            "engine": info.model_dump(),
        }

    return app


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.mock_sglang",
        description="Serve a LocalEngine behind SGLang 0.5.23's HTTP API.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-init", help="ModelInit as JSON: a small random-init model")
    source.add_argument("--model-path", help="an HF-format model directory")
    parser.add_argument("--seed", type=int, default=0, help="weights seed for --model-init")
    parser.add_argument(
        "--save-dir",
        help="with --model-init: save the initial weights here (default: a temporary "
        "directory) and report it as model_path",
    )
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    import tempfile

    import uvicorn

    from agentflow.inference.local import LocalEngine
    from agentflow.modeling import ModelInit, save_model

    with tempfile.TemporaryDirectory(prefix="mock-sglang-") as tmp:
        if args.model_init is not None:
            engine = LocalEngine.from_init(
                ModelInit.model_validate_json(args.model_init),
                seed=args.seed,
                max_batch_size=args.max_batch_size,
            )
            # Report a real local directory: the router reads model_path to find a
            # tokenizer, and anything else sends it to a model hub.
            model_path = str(save_model(engine.model, args.save_dir or tmp))
        else:
            engine = LocalEngine.from_pretrained(
                args.model_path, max_batch_size=args.max_batch_size
            )
            model_path = args.model_path
        app = create_mock_worker(engine, model_path=model_path, close_engine=True)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        await uvicorn.Server(config).serve()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
