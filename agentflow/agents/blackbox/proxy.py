"""The chat-completion core of the OpenAI-compatible gateway.

One request: render the conversation with the run's chat template, match it against the
episode's turn tree (`matching`), persist the unmatched remainder as a `prompt` (new
root) or `env` turn, generate only what the engine has not seen, persist the `policy`
turn with the engine's token ids, log-probs and weight versions, and hand back the
answer. Formatting it as JSON or SSE is the caller's business (`responses`, `sse`).

The engine session of an episode is named after it; a request continues the session from
the nearest policy turn on its path that the session holds (SGLang semantics: the
parent rid's prompt + output, then only the new tokens), and otherwise sends the whole
context from the turn tree, as after a gateway restart.

Images (`image_url` parts): an engine that does not take them refuses the request before
anything is recorded. Otherwise each image is the template's placeholder in the tokens,
its bytes are stored as a blob linked from the turn the request writes (images already
linked on the matched path are not linked again), and the engine gets every image of the
conversation as `image_data`, with the whole context: a session continuation would send
only the new tokens, and the engine needs each image beside its placeholder.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from agentflow import ids
from agentflow.agents.blackbox.live import ChatState, LiveEpisodes
from agentflow.agents.blackbox.matching import (
    STOP_STRING,
    AssistantView,
    assistant_view,
    match_request,
)
from agentflow.agents.blackbox.openai_schema import ChatCompletionRequest
from agentflow.agents.blackbox.stops import StopWatch, stop_cut
from agentflow.agents.runtime import PolicyRuntime, RuntimeRegistry
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import (
    Conflict,
    EngineLost,
    EngineRequestError,
    EngineUnavailable,
    InvalidInput,
)
from agentflow.images import blob_id, data_url
from agentflow.inference.base import (
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SessionRef,
    TokenObserver,
)
from agentflow.metrics import GatewayMetrics
from agentflow.tokenization.chat import ChatTemplate
from agentflow.types import OPEN_EPISODE_STATUSES, TurnKind, TurnNode, TurnRecord


@dataclass(frozen=True)
class ChatAnswer:
    episode_id: uuid.UUID
    turn_id: uuid.UUID  # the policy turn
    parent_id: uuid.UUID  # the turn it continues (the request's last segment)
    model: str
    template: ChatTemplate
    result: GenerateResult
    view: AssistantView
    created: int

    @property
    def finish_reason(self) -> str:
        if self.view.tool_calls:
            return "tool_calls"
        return "length" if self.result.finish_reason == "length" else "stop"


class ChatProxy:
    def __init__(
        self,
        turns: TurnTree,
        runtimes: RuntimeRegistry,
        live: LiveEpisodes,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.turns = turns
        self.runtimes = runtimes
        self.live = live
        self.metrics = metrics

    async def complete(
        self,
        episode_id: uuid.UUID,
        request: ChatCompletionRequest,
        on_tokens: TokenObserver | None = None,
        turn_id: uuid.UUID | None = None,
    ) -> ChatAnswer:
        """Answer `request` in `episode_id` with the policy turn `turn_id` (new when
        None); `on_tokens` sees the output as it is made."""
        with self.live.admit(episode_id) as state:
            episode = await self.turns.episode(episode_id)
            if episode.status not in OPEN_EPISODE_STATUSES:
                await self.live.release_chat(episode_id)
                raise Conflict(f"episode {episode_id} is {episode.status}; it takes no requests")
            runtime = self.runtimes.get(episode.run_id)
            images = request.images()
            if images and not await runtime.engine.accepts_images():
                raise InvalidInput(
                    "this engine does not accept images: the run's model is text-only",
                    field="messages",
                )
            messages = request.template_messages(runtime.template.image_placeholder)
            tools = request.template_tools()
            # Matching and writing the new segment are one step per episode, so two
            # identical concurrent requests share one segment instead of racing.
            async with state.lock:
                tree = await self.turns.episode_tree(episode_id)
                found = match_request(
                    runtime.template,
                    tree.roots,
                    messages,
                    tools,
                    rerender=runtime.history == "rerender",
                )
                # Refuse what cannot fit before anything is written.
                size = sum(len(n.token_ids) for n in found.path) + len(found.new_tokens)
                _room(runtime, size)
                slot = self.live.running(episode_id)
                budget_room = None
                if slot is not None:
                    turns = sum(n.kind == "policy" for n in found.path)
                    budget_room = slot.check_budget(turns, size)
                path: list[TurnNode | _Written] = list(found.path)
                if found.new_tokens:
                    kind: TurnKind = "prompt" if found.parent is None else "env"
                    record = TurnRecord(
                        kind=kind,
                        token_ids=tuple(found.new_tokens),
                        images=_unlinked(images, found.path),
                    )
                    parent_id = found.parent.id if found.parent else None
                    new_id = await self.turns.add_turn(episode_id, parent_id, record)
                    path.append(_Written(new_id, tuple(found.new_tokens), kind))
                    if self.metrics is not None:
                        self.metrics.turns.labels(kind=kind).inc()
            if not path or path[-1].kind == "policy":
                raise InvalidInput("the request adds no message after the last answer")
            return await self._generate(
                episode_id,
                state,
                runtime,
                path,
                request,
                budget_room,
                images,
                on_tokens,
                turn_id or ids.new_id(),
            )

    async def _generate(
        self,
        episode_id: uuid.UUID,
        state: ChatState,
        runtime: PolicyRuntime,
        path: list[TurnNode | _Written],
        request: ChatCompletionRequest,
        budget_room: int | None,
        images: list[bytes],
        on_tokens: TokenObserver | None,
        turn_id: uuid.UUID,
    ) -> ChatAnswer:
        context = [t for node in path for t in node.token_ids]
        room = _room(runtime, len(context))
        if budget_room is not None:  # the episode's token budget, when an agent runs it
            room = min(room, budget_room)
        limit = min(runtime.sampling.max_new_tokens, request.token_limit() or room, room)
        sampling = runtime.sampling.model_copy(
            update={
                "max_new_tokens": limit,
                "stop_token_ids": tuple(runtime.template.stop_ids),
                "seed": request.seed if request.seed is not None else runtime.sampling.seed,
                "top_logprobs": request.top_logprobs or 0,
            }
        )
        # With images the whole context goes out with every image (module docstring).
        session = None if images else await self._session(episode_id, state, runtime)
        start = time.perf_counter()
        image_data = tuple(data_url(image) for image in images)
        stops = request.stop_strings()
        observer = _observers(on_tokens, self._stop_watch(runtime, turn_id, stops))
        try:
            result = await self._run(
                runtime, state, session, turn_id, path, context, sampling, image_data, observer
            )
        except EngineLost:
            if session is None:
                raise
            # The session went with its engine (a pool's member died): open it again on a
            # live engine and send the whole context; nothing of this turn was recorded.
            state.session_id = None
            session = await self._session(episode_id, state, runtime)
            result = await self._run(
                runtime, state, session, turn_id, path, context, sampling, image_data, observer
            )
        generate_s = time.perf_counter() - start
        cut = stop_cut(runtime.template.tokenizer.decode, result.output_ids, stops)
        if cut is not None:  # stops.py: keep the tokens up to the stop string
            result = result.cut(cut[0], "stop")
            view = AssistantView(content=cut[1].strip())
        elif result.finish_reason == "abort":
            raise EngineUnavailable("the engine aborted the generation (paused?); retry")
        else:
            view = assistant_view(
                runtime.template, result.output_ids, parse_calls=request.parse_tool_calls
            )
        record = TurnRecord(
            kind="policy",
            token_ids=tuple(result.output_ids),
            logprobs=tuple(result.logprobs),
            weight_versions=tuple(result.token_versions()),
            text=view.content.replace("\x00", ""),
            finish_reason=STOP_STRING if cut is not None else result.finish_reason,
            timings={"generate": generate_s},
        )
        parent_id = path[-1].id
        await self.turns.add_turn(episode_id, parent_id, record, turn_id=turn_id)
        if self.metrics is not None:
            self.metrics.turns.labels(kind="policy").inc()
            self.metrics.generate_seconds.observe(generate_s)
        if session is not None:
            state.session_rids.add(turn_id)
        return ChatAnswer(
            episode_id=episode_id,
            turn_id=turn_id,
            parent_id=parent_id,
            model=runtime.model_name,
            template=runtime.template,
            result=result,
            view=view,
            created=int(time.time()),
        )

    @staticmethod
    def _stop_watch(
        runtime: PolicyRuntime, turn_id: uuid.UUID, stops: Sequence[str]
    ) -> StopWatch | None:
        if not stops:
            return None
        tasks: set[asyncio.Task[None]] = set()

        def abort() -> None:  # called on the event loop, from the engine's step
            task = asyncio.get_running_loop().create_task(runtime.engine.abort(turn_id.hex))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        return StopWatch(runtime.template.tokenizer.decode, stops, abort)

    async def _session(
        self, episode_id: uuid.UUID, state: ChatState, runtime: PolicyRuntime
    ) -> str | None:
        if state.session_id is not None and state.engine is runtime.engine:
            return state.session_id
        name = f"episode-{episode_id.hex}"
        try:
            state.session_id = await runtime.engine.open_session(name)
        except EngineRequestError:  # already open: this process opened it before
            state.session_id = name
        except Exception:
            return None  # an engine without sessions: send whole contexts
        state.engine = runtime.engine
        state.session_rids.clear()
        return state.session_id

    async def _run(
        self,
        runtime: PolicyRuntime,
        state: ChatState,
        session: str | None,
        turn_id: uuid.UUID,
        path: list[TurnNode | _Written],
        context: list[int],
        sampling: SamplingParams,
        image_data: tuple[str, ...] = (),
        observer: TokenObserver | None = None,
    ) -> GenerateResult:
        rid = turn_id.hex
        base = GenerateRequest(
            input_ids=tuple(context), sampling=sampling, rid=rid, image_data=image_data
        )
        if session is None:
            return await runtime.generate(base, observer)
        offset = held = 0
        parent: uuid.UUID | None = None
        for node in path:
            offset += len(node.token_ids)
            if node.kind == "policy" and node.id in state.session_rids:
                parent, held = node.id, offset
        if parent is not None:
            # `offset`: the engine holds all the parent sampled, and a stop string may
            # have cut the recorded answer shorter (stops.py).
            ref = SessionRef(session_id=session, parent_rid=parent.hex, offset=held)
            continued = base.model_copy(update={"input_ids": tuple(context[held:]), "session": ref})
            try:
                return await runtime.generate(continued, observer)
            except EngineRequestError:
                state.session_rids.discard(parent)  # lost or evicted: recompute below
        fresh = base.model_copy(update={"session": SessionRef(session_id=session)})
        return await runtime.generate(fresh, observer)


def _observers(*observers: TokenObserver | None) -> TokenObserver | None:
    """One observer that shows the tokens to each of `observers` that is set."""
    present = [o for o in observers if o is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def show(ids: Sequence[int], logprobs: Sequence[float]) -> None:
        for observer in present:
            observer(ids, logprobs)

    return show


@dataclass(frozen=True)
class _Written:
    """The segment this request wrote, standing in for its (not re-read) `TurnNode`."""

    id: uuid.UUID
    token_ids: tuple[int, ...]
    kind: str


def _unlinked(images: list[bytes], path: list[TurnNode]) -> tuple[bytes, ...]:
    """The request's images not yet linked from a turn of its matched path, in order:
    an image the agent sends again with its history is stored and linked once."""
    linked: dict[str, int] = {}
    for node in path:
        for sha256 in node.images:
            linked[sha256] = linked.get(sha256, 0) + 1
    new: list[bytes] = []
    for image in images:
        sha256 = blob_id(image)
        if linked.get(sha256, 0) > 0:
            linked[sha256] -= 1
        else:
            new.append(image)
    return tuple(new)


def _room(runtime: PolicyRuntime, context_tokens: int) -> int:
    """Tokens left to generate after a context of `context_tokens`; at least one."""
    engine_limit = getattr(runtime.engine, "max_context", None)
    limit = runtime.max_context
    if isinstance(engine_limit, int) and engine_limit > 0:
        limit = min(limit, engine_limit)
    if context_tokens >= limit:
        raise InvalidInput(
            f"the conversation is {context_tokens} tokens; the model's context is {limit}",
            field="messages",
        )
    return limit - context_tokens
