"""A small deterministic `Engine` behind the mock SGLang worker in unit tests.

The next token depends only on the previous token and the weight version, so a request
continued from `input_ids + partial output` produces exactly what an uninterrupted request
would: stitching can be checked token for token. Each token takes `step_s` of (async)
time so a pause can land mid-generation.
"""

from __future__ import annotations

import asyncio
import uuid

from agentflow.errors import EngineRequestError
from agentflow.inference.base import (
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    VersionSpan,
    WeightUpdate,
)

VOCAB = 64


def next_token(prev: int, version: int) -> int:
    return (prev * 7 + 3 + version) % VOCAB


def token_logprob(token: int) -> float:
    return -((token % 5) + 1) / 10


class FakeEngine:
    def __init__(self, *, step_s: float = 0.0, max_context: int = 512) -> None:
        self.step_s = step_s
        self.max_context = max_context
        self.version = 0
        self.sessions: dict[str, dict[str, list[int]]] = {}
        self.mode: PauseMode | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.started = asyncio.Event()  # set when any request produced its first token
        self.loaded_paths: list[str] = []
        self.closed = False

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if any(not 0 <= t < VOCAB for t in req.input_ids):
            raise EngineRequestError(f"input_ids outside the vocabulary [0, {VOCAB})")
        context = list(req.input_ids)
        cached = 0
        if req.session is not None:
            tree = self.sessions.get(req.session.session_id)
            if tree is None:
                raise EngineRequestError(f"unknown session {req.session.session_id}")
            if req.session.parent_rid is not None:
                if req.session.parent_rid not in tree:
                    raise EngineRequestError(f"unknown parent rid {req.session.parent_rid}")
                parent = tree[req.session.parent_rid][: req.session.offset]
                cached = len(parent)
                context = parent + context
        await self.resumed.wait()
        out: list[int] = []
        versions: list[int] = []
        reason = "length"
        self.running.add(req.rid)
        try:
            prev = context[-1]
            while len(out) < req.sampling.max_new_tokens:
                await asyncio.sleep(self.step_s)  # the "forward pass"
                # Pause, abort and weight updates land between steps, as in LocalEngine.
                if self.mode is not None and self.mode is not PauseMode.ABORT:
                    await self.resumed.wait()
                if req.rid in self.aborted or self.mode is PauseMode.ABORT:
                    reason = "abort"
                    break
                prev = next_token(prev, self.version)
                out.append(prev)
                versions.append(self.version)
                self.started.set()
                if prev in req.sampling.stop_token_ids:
                    reason = "stop"
                    break
        finally:
            self.running.discard(req.rid)
            self.aborted.discard(req.rid)
        if req.session is not None:
            self.sessions[req.session.session_id][req.rid] = context + out
        spans: list[VersionSpan] = []
        for i, v in enumerate(versions):
            if spans and spans[-1].version == v:
                spans[-1] = VersionSpan(version=v, start=spans[-1].start, end=i + 1)
            else:
                spans.append(VersionSpan(version=v, start=i, end=i + 1))
        return GenerateResult(
            rid=req.rid,
            output_ids=out,
            logprobs=[token_logprob(t) for t in out],
            finish_reason=reason,  # type: ignore[arg-type]
            weight_versions=spans,
            prompt_tokens=len(context),
            cached_tokens=cached,
        )

    async def open_session(self, session_id: str | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise EngineRequestError(f"session {sid} already exists")
        self.sessions[sid] = {}
        return sid

    async def close_session(self, session_id: str) -> None:
        if self.sessions.pop(session_id, None) is None:
            raise EngineRequestError(f"unknown session {session_id}")

    async def abort(self, rid: str) -> None:
        if rid in self.running:
            self.aborted.add(rid)

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self.mode = mode
        self.resumed.clear()
        if mode is PauseMode.ABORT:
            # Abort at the pause itself, as an engine does: a request mid-step must not
            # miss it when update and resume follow before its step ends.
            self.aborted |= self.running

    async def resume(self) -> None:
        self.mode = None
        self.resumed.set()

    async def update_weights(self, update: WeightUpdate) -> int:
        if update.path is not None:
            if update.path.startswith("/missing"):
                raise EngineRequestError(f"no model at {update.path}")
            self.loaded_paths.append(update.path)
        self.version = update.version if update.version is not None else self.version + 1
        return self.version

    async def info(self) -> EngineInfo:
        return EngineInfo(
            model="fake",
            vocab_size=VOCAB,
            max_context=self.max_context,
            weight_version=self.version,
            running=len(self.running),
            paused=not self.resumed.is_set(),
            sessions=len(self.sessions),
        )

    async def close(self) -> None:
        self.closed = True
