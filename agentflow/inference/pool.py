"""`EnginePool`: several engines behind one `Engine`, routed by session, with engines
that die replaced.

A session lives on one engine (its KV and its request tree are there), so a session is
opened on the live engine holding the fewest sessions and every request of it goes
there; a request without a session goes to the live engine with the fewest requests in
flight. Control calls (pause, resume, a weight update) go to every live engine at once,
and a weight update names its version, so all engines agree on it.

An engine that dies (it raises `EngineLost`: a Ray actor that exited, a server that is
gone) takes its sessions with it. The pool marks it dead once, fails the requests that
were on it with `EngineLost` naming it, and builds a replacement with the `replace`
factory in the background: the replacement is brought to the pool's newest weights (and
paused if the pool is) before it takes a session. The caller decides what a lost request
means: the white-box agent reopens its session on a live engine and sends the turn again
from the recorded context (`agentflow.agents.actions.SampledActions`), so the episode
goes on; anything else fails its episode with the reason.

Weights handed over in process or from a directory are replayed into a replacement;
broadcast weights are not (they exist only in the engines), so a replacement serves the
newest weights it can load until the next publish, and says so in the log.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import operator
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from agentflow.errors import EngineLost, EngineUnavailable
from agentflow.inference.base import (
    Engine,
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TokenObserver,
    WeightUpdate,
    generate_observed,
    next_weight_version,
)

log = logging.getLogger(__name__)

# Builds the engine for slot `index` (its `generation`-th engine, 0 for the first).
EngineFactory = Callable[[int, int], Awaitable[Engine]]

_INDEX = operator.attrgetter("index")


@dataclass
class _Slot:
    index: int
    engine: Engine | None
    generation: int = 0
    sessions: set[str] = field(default_factory=set)
    opening: int = 0  # sessions being opened
    in_flight: int = 0
    replacing: asyncio.Task[None] | None = None

    @property
    def live(self) -> bool:
        return self.engine is not None


@dataclass
class PoolCounters:
    lost: int = 0  # engines that died
    replaced: int = 0  # replacements that took over
    failed_replacements: int = 0
    lost_requests: int = 0  # requests that failed because their engine died


class EnginePool:
    """`Engine` over `engines`; see the module docstring."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        replace: EngineFactory | None = None,
        max_replacements: int = 8,
        wait_for_engine_s: float = 300.0,
    ) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self._slots = [_Slot(i, e) for i, e in enumerate(engines)]
        # Per session opened, without a Python step per slot: the live slots (None once an
        # engine dies or a replacement takes over, until looked up again), and each
        # slot's sessions held and being opened, by slot index.
        self._live: list[_Slot] | None = None
        self._session_load = [0] * len(self._slots)
        self._replace = replace
        self.max_replacements = max_replacements
        self.wait_for_engine_s = wait_for_engine_s
        self.counters = PoolCounters()
        self._session_slot: dict[str, _Slot] = {}
        self._rid_slot: dict[str, _Slot] = {}
        self._version = 0
        self._newest: WeightUpdate | None = None  # replayed into replacements
        self._paused: PauseMode | None = None
        self._live_changed: asyncio.Event | None = None
        self._state: asyncio.Lock | None = None
        self._closed = False
        self._next = 0  # round-robin among equals
        self._burying: set[asyncio.Task[None]] = set()  # dead engines being closed

    # -- routing ------------------------------------------------------------------------

    def engines(self) -> list[Engine | None]:
        """The engine of each slot, None while it is being replaced."""
        return [s.engine for s in self._slots]

    def _changed(self) -> asyncio.Event:
        if self._live_changed is None:
            self._live_changed = asyncio.Event()
        return self._live_changed

    async def _live_slots(self) -> list[_Slot]:
        """The live slots; when none is, wait for a replacement to take over."""
        if self._live and not self._closed:
            return self._live
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_engine_s
        while True:
            if self._closed:
                raise EngineUnavailable("the engine pool is closed")
            changed = self._changed()
            changed.clear()  # before looking: a replacement that lands after sets it again
            # `engine is not None` rather than `.live`: no property call per slot per pick.
            live = [s for s in self._slots if s.engine is not None]
            if live:
                self._live = live
                return live
            if not any(s.replacing is not None for s in self._slots):
                raise EngineUnavailable("every engine of the pool died and none is replaced")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EngineUnavailable(
                    f"no live engine in the pool for {self.wait_for_engine_s:.0f} s"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _least(self, live: list[_Slot], loads: list[int]) -> _Slot:
        """The slot of `live` (in slot order) with the least of `loads` (one each); among
        equals, the first at or after a start that moves on one slot per call (round-robin).
        Runs per session opened: C min and index scans, no Python call per slot."""
        n = len(self._slots)
        self._next = start = (self._next + 1) % n
        least = min(loads)
        first = start if len(live) == n else bisect.bisect_left(live, start, key=_INDEX)
        try:
            return live[loads.index(least, first)]
        except ValueError:  # none from `start` on: wrap around
            return live[loads.index(least)]

    async def open_session(self, session_id: str | None = None) -> str:
        # A session that could not be opened does not exist yet: try the next engine.
        for _ in range(len(self._slots)):
            live = await self._live_slots()
            loads = self._session_load
            if len(live) < len(loads):
                loads = [loads[s.index] for s in live]
            slot = self._least(live, loads)
            engine = self._engine(slot)
            # Counted at once: a burst of opens spreads over the engines.
            slot.opening += 1
            self._session_load[slot.index] += 1
            opened = False
            try:
                sid = await engine.open_session(session_id)
                opened = True
            except EngineLost as exc:
                error = self._lost(slot, engine, exc)
                continue
            finally:
                slot.opening -= 1
                if not opened:
                    self._session_load[slot.index] -= 1
            slot.sessions.add(sid)
            self._session_slot[sid] = slot
            return sid
        raise error

    async def close_session(self, session_id: str) -> None:
        slot = self._session_slot.pop(session_id, None)
        if slot is None:
            return  # never opened here, or its engine died and took it
        slot.sessions.discard(session_id)
        self._session_load[slot.index] -= 1
        if slot.engine is None:
            return
        engine = slot.engine
        try:
            await engine.close_session(session_id)
        except EngineLost as exc:
            self._lost(slot, engine, exc)

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        return await self.generate_observed(req, None)

    async def generate_observed(
        self, req: GenerateRequest, observer: TokenObserver | None
    ) -> GenerateResult:
        if req.session is not None:
            slot = self._session_slot.get(req.session.session_id)
            if slot is None or slot.engine is None:
                self.counters.lost_requests += 1
                raise EngineLost(
                    f"session {req.session.session_id!r} is on no live engine of the pool "
                    "(its engine died): open a new session"
                )
        else:
            live = await self._live_slots()
            slot = self._least(live, [s.in_flight for s in live])
        engine = self._engine(slot)
        slot.in_flight += 1
        self._rid_slot[req.rid] = slot
        try:
            return await generate_observed(engine, req, observer)
        except EngineLost as exc:
            self.counters.lost_requests += 1
            raise self._lost(slot, engine, exc) from exc
        finally:
            slot.in_flight -= 1
            self._rid_slot.pop(req.rid, None)

    async def abort(self, rid: str) -> None:
        slot = self._rid_slot.get(rid)
        if slot is None or slot.engine is None:
            return  # finished, or lost with its engine
        engine = slot.engine
        try:
            await engine.abort(rid)
        except EngineLost as exc:
            self._lost(slot, engine, exc)

    # -- control: every live engine -------------------------------------------------------

    async def _each(self, call: Callable[[Engine], Awaitable[object]]) -> list[object]:
        """`call` on every live engine at once; an engine that dies is replaced (and
        brought up to date then), the others' answers are returned."""
        slots = [s for s in self._slots if s.live]

        async def one(slot: _Slot) -> object:
            engine = self._engine(slot)
            try:
                return await call(engine)
            except EngineLost as exc:
                self._lost(slot, engine, exc)
                return None

        answers = await asyncio.gather(*(one(s) for s in slots))
        return [a for a in answers if a is not None]

    def _state_lock(self) -> asyncio.Lock:
        """Held while the engines' shared state (weights, pause) changes, and while a
        replacement is brought up to it: a replacement never joins mid-change."""
        if self._state is None:
            self._state = asyncio.Lock()
        return self._state

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        async with self._state_lock():
            self._paused = PauseMode(mode)
            await self._each(lambda e: e.pause(mode))

    async def resume(self) -> None:
        async with self._state_lock():
            self._paused = None
            await self._each(lambda e: e.resume())

    async def update_weights(self, update: WeightUpdate) -> int:
        async with self._state_lock():
            version = next_weight_version(self._version, update)
            named = update.model_copy(update={"version": version})
            await self._each(lambda e: e.update_weights(named))
            self._version = version
            self._newest = named
            return version

    async def accepts_images(self) -> bool:
        slot = (await self._live_slots())[0]
        return await self._engine(slot).accepts_images()

    async def info(self) -> EngineInfo:
        infos = await self._each(lambda e: e.info())
        if not infos:
            slot = (await self._live_slots())[0]
            infos = [await self._engine(slot).info()]
        parts = [i for i in infos if isinstance(i, EngineInfo)]
        first = parts[0]
        slots = sum(int(i.extra.get("max_batch_size") or 0) for i in parts)
        return EngineInfo(
            model=first.model,
            vocab_size=first.vocab_size,
            max_context=min(i.max_context for i in parts),
            weight_version=self._version or first.weight_version,
            running=sum(i.running for i in parts),
            waiting=sum(i.waiting for i in parts),
            paused=self._paused is not None,
            sessions=sum(i.sessions for i in parts),
            kv_tokens=sum(i.kv_tokens for i in parts),
            accepts_images=first.accepts_images,
            extra={
                "engines": len(self._slots),
                "live_engines": sum(s.live for s in self._slots),
                "max_batch_size": slots or None,
                "engines_lost": self.counters.lost,
                "engines_replaced": self.counters.replaced,
                "requests_lost": self.counters.lost_requests,
                "members": [i.extra for i in parts],
            },
        )

    async def close(self) -> None:
        self._closed = True
        self._changed().set()
        await asyncio.gather(*self._burying, return_exceptions=True)
        tasks = [s.replacing for s in self._slots if s.replacing is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        engines = [s.engine for s in self._slots if s.engine is not None]
        self._live = None
        for slot in self._slots:
            slot.engine = None
        for engine in engines:
            with contextlib.suppress(Exception):
                await engine.close()

    # -- death and replacement ------------------------------------------------------------

    def _engine(self, slot: _Slot) -> Engine:
        if slot.engine is None:
            raise EngineLost(f"engine {slot.index} of the pool died")
        return slot.engine

    def _lost(self, slot: _Slot, engine: Engine, exc: EngineLost) -> EngineLost:
        """Mark `slot`'s `engine` dead (once), forget its sessions, start its
        replacement; returns the error to raise to the caller."""
        error = EngineLost(f"engine {slot.index} of the pool died: {exc}")
        if slot.engine is not engine:
            return error  # already marked (another request saw it first)
        slot.engine = None
        self._live = None
        self.counters.lost += 1
        for sid in slot.sessions:
            self._session_slot.pop(sid, None)
        log.warning(
            "engine %d (generation %d) died with %d sessions: %s",
            slot.index,
            slot.generation,
            len(slot.sessions),
            exc,
        )
        self._session_load[slot.index] -= len(slot.sessions)
        slot.sessions = set()
        # What the dead engine still holds here (its client's connections, a server
        # process of its own) is released in the background.
        burial = asyncio.get_running_loop().create_task(self._bury(engine))
        self._burying.add(burial)
        burial.add_done_callback(self._burying.discard)
        if self._replace is None or self._closed:
            return error
        if self.counters.replaced + self.counters.failed_replacements >= self.max_replacements:
            log.error(
                "engine %d is not replaced: the pool made its %d replacements",
                slot.index,
                self.max_replacements,
            )
            return error
        slot.replacing = asyncio.get_running_loop().create_task(
            self._replace_slot(slot), name=f"replace-engine-{slot.index}"
        )
        return error

    @staticmethod
    async def _bury(engine: Engine) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(engine.close(), timeout=30.0)

    async def _replace_slot(self, slot: _Slot) -> None:
        assert self._replace is not None
        generation = slot.generation + 1
        try:
            engine = await self._replace(slot.index, generation)
            try:
                async with self._state_lock():
                    await self._bring_up_to_date(engine)
                    if not self._closed:
                        slot.engine, slot.generation = engine, generation
                        self._live = None
            except BaseException:
                with contextlib.suppress(Exception):
                    await engine.close()
                raise
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the slot stays dead; the others serve on
            self.counters.failed_replacements += 1
            log.exception("engine %d could not be replaced", slot.index)
            return
        finally:
            slot.replacing = None
            self._changed().set()
        if slot.engine is not engine:  # the pool closed meanwhile
            with contextlib.suppress(Exception):
                await engine.close()
            return
        self.counters.replaced += 1
        log.warning("engine %d replaced (generation %d)", slot.index, generation)

    async def _bring_up_to_date(self, engine: Engine) -> None:
        newest = self._newest
        if newest is not None and newest.broadcast is None:
            await engine.update_weights(newest)
        elif newest is not None:
            log.warning(
                "a replacement engine cannot load broadcast weights (version %d); it serves "
                "its own until the next publish",
                newest.version,
            )
        if self._paused is not None:
            await engine.pause(self._paused)
