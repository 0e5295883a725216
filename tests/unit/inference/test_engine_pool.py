"""`EnginePool` over real local engines: routing by session, control to every engine,
and an engine that dies (a member that raises `EngineLost` from then on, as a Ray actor
that exited does; tests/integration/placement runs the real actors)."""

from __future__ import annotations

import asyncio

import pytest

from agentflow.errors import EngineLost, EngineUnavailable
from agentflow.inference.base import (
    Engine,
    GenerateRequest,
    PauseMode,
    SamplingParams,
    SessionRef,
    WeightUpdate,
)
from agentflow.inference.local import LocalEngine
from agentflow.inference.pool import EnginePool
from agentflow.modeling import ModelInit, build_model

TINY = ModelInit(layers=1, hidden=32, heads=2, max_context=128)


class Mortal:
    """A local engine that can be killed: every call after `kill()` raises EngineLost."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.dead = False
        self.closed = False

    def kill(self) -> None:
        self.dead = True

    def __getattr__(self, name: str) -> object:
        method = getattr(self.engine, name)

        async def call(*args: object, **kwargs: object) -> object:
            await asyncio.sleep(0)  # a call crosses a process boundary: others run meanwhile
            if self.dead:
                raise EngineLost("the engine process exited")
            return await method(*args, **kwargs)

        return call

    async def close(self) -> None:
        self.closed = True
        await self.engine.close()


def member(seed: int = 0) -> Mortal:
    return Mortal(LocalEngine.from_init(TINY, seed=0, max_batch_size=8))


def request(session: str | None = None, tokens: int = 3) -> GenerateRequest:
    ref = SessionRef(session_id=session) if session is not None else None
    return GenerateRequest(
        input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=tokens), session=ref
    )


def as_engines(members: list[Mortal]) -> list[Engine]:
    return list(members)  # type: ignore[arg-type]


async def wait_for(condition: object, timeout_s: float = 10.0) -> None:
    async def poll() -> None:
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


async def test_sessions_spread_and_stick() -> None:
    members = [member(), member()]
    pool = EnginePool(as_engines(members))
    sessions = [await pool.open_session() for _ in range(4)]
    counts = [(await m.engine.info()).sessions for m in members]
    assert counts == [2, 2]
    for sid in sessions:
        result = await pool.generate(request(sid))
        assert len(result.output_ids) == 3
        cont = GenerateRequest(
            input_ids=(4,),
            sampling=SamplingParams(max_new_tokens=2),
            session=SessionRef(session_id=sid, parent_rid=result.rid),
        )
        assert (await pool.generate(cont)).prompt_tokens == 3 + 3 + 1  # the session's context
    await pool.close_session(sessions[0])
    assert sum([(await m.engine.info()).sessions for m in members]) == 3
    await pool.close()
    assert all(m.closed for m in members)


async def test_weight_update_names_one_version_for_every_engine() -> None:
    members = [member(), member()]
    pool = EnginePool(as_engines(members))
    state = build_model(TINY, seed=1).state_dict()
    assert await pool.update_weights(WeightUpdate(state_dict=state)) == 1
    assert await pool.update_weights(WeightUpdate(state_dict=state, version=5)) == 5
    assert [m.engine.weight_version for m in members] == [5, 5]
    info = await pool.info()
    assert info.weight_version == 5
    assert info.extra["engines"] == 2 and info.extra["live_engines"] == 2
    assert info.extra["max_batch_size"] == 16  # the elastic pool sizes against all slots
    await pool.pause(PauseMode.RETRACT)
    assert [(await m.engine.info()).paused for m in members] == [True, True]
    await pool.resume()
    assert [(await m.engine.info()).paused for m in members] == [False, False]
    await pool.close()


async def test_a_dead_engine_loses_its_sessions_and_is_replaced_up_to_date() -> None:
    members = [member(), member()]
    built: list[Mortal] = []

    async def replace(index: int, generation: int) -> Engine:
        new = member()
        built.append(new)
        return new  # type: ignore[return-value]

    pool = EnginePool(as_engines(members), replace=replace)
    state = build_model(TINY, seed=1).state_dict()
    await pool.update_weights(WeightUpdate(state_dict=state, version=3))
    await pool.pause(PauseMode.IN_PLACE)
    await pool.resume()
    first, second = await pool.open_session(), await pool.open_session()
    index = next(i for i, m in enumerate(members) if first in m.engine._sessions)
    members[index].kill()
    doomed = first
    with pytest.raises(EngineLost, match=f"engine {index} of the pool died"):
        await pool.generate(request(doomed))
    # Later requests of that session are refused at once: its KV is gone.
    with pytest.raises(EngineLost, match="open a new session"):
        await pool.generate(request(doomed))
    assert pool.counters.lost == 1 and pool.counters.lost_requests == 2
    await pool.close_session(doomed)  # nothing to close: no error
    # The other engine serves on, new sessions included.
    assert len((await pool.generate(request(second))).output_ids) == 3
    assert len((await pool.generate(request(await pool.open_session()))).output_ids) == 3
    await wait_for(lambda: pool.counters.replaced == 1)
    assert built[0].engine.weight_version == 3  # the pool's newest weights, replayed
    assert pool.engines()[index] is built[0]
    info = await pool.info()
    assert info.extra["live_engines"] == 2 and info.extra["engines_lost"] == 1
    await pool.close()


async def test_a_replacement_starts_empty_for_the_least_loaded_pick() -> None:
    """The sessions a dead engine took with it no longer count for its slot."""
    members = [member(), member()]
    ready = asyncio.Event()
    built: list[Mortal] = []

    async def replace(index: int, generation: int) -> Engine:
        await ready.wait()
        built.append(member())
        return built[-1]  # type: ignore[return-value]

    pool = EnginePool(as_engines(members), replace=replace)
    sessions = [await pool.open_session() for _ in range(4)]
    assert [len(m.engine._sessions) for m in members] == [2, 2]
    members[0].kill()
    doomed = next(s for s in sessions if s in members[0].engine._sessions)
    with pytest.raises(EngineLost):
        await pool.generate(request(doomed))
    for sid in sessions:
        if sid in members[1].engine._sessions:
            await pool.close_session(sid)
    assert await pool.open_session() in members[1].engine._sessions  # the only live one
    ready.set()
    await wait_for(lambda: pool.counters.replaced == 1)
    # One session on engine 1, none on the replacement: the next goes to the replacement.
    assert await pool.open_session() in built[0].engine._sessions
    await pool.close()


async def test_a_replacement_inherits_a_pause() -> None:
    members = [member()]

    async def replace(index: int, generation: int) -> Engine:
        return member()  # type: ignore[return-value]

    pool = EnginePool(as_engines(members), replace=replace)
    await pool.pause(PauseMode.ABORT)
    members[0].kill()
    await pool.info()  # the control call finds it dead
    await wait_for(lambda: pool.counters.replaced == 1)
    assert (await pool.info()).paused
    new = pool.engines()[0]
    assert isinstance(new, Mortal) and (await new.engine.info()).paused
    await pool.close()


async def test_requests_wait_for_a_replacement_when_no_engine_lives() -> None:
    members = [member()]
    gate = asyncio.Event()

    async def replace(index: int, generation: int) -> Engine:
        await gate.wait()
        return member()  # type: ignore[return-value]

    pool = EnginePool(as_engines(members), replace=replace)
    sid = await pool.open_session()
    members[0].kill()
    with pytest.raises(EngineLost):
        await pool.generate(request(sid))
    waiting = asyncio.create_task(pool.open_session())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    gate.set()
    new_sid = await asyncio.wait_for(waiting, 10.0)
    assert len((await pool.generate(request(new_sid))).output_ids) == 3
    await pool.close()


async def test_without_replacements_a_dead_pool_says_so() -> None:
    members = [member()]
    pool = EnginePool(as_engines(members), max_replacements=0, replace=None)
    members[0].kill()
    with pytest.raises(EngineLost):
        await pool.generate(request())
    with pytest.raises(EngineUnavailable, match="none is replaced"):
        await pool.open_session()
    await pool.close()


async def test_a_failed_replacement_leaves_the_slot_dead() -> None:
    members = [member(), member()]

    async def replace(index: int, generation: int) -> Engine:
        raise RuntimeError("no room on the cluster")

    pool = EnginePool(as_engines(members), replace=replace, max_replacements=1)
    sid = await pool.open_session()
    holder = next(m for m in members if sid in m.engine._sessions)
    holder.kill()
    with pytest.raises(EngineLost):
        await pool.generate(request(sid))
    await wait_for(lambda: pool.counters.failed_replacements == 1)
    assert (await pool.info()).extra["live_engines"] == 1
    assert len((await pool.generate(request(await pool.open_session()))).output_ids) == 3
    await pool.close()


def test_a_pool_needs_an_engine() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])


async def test_a_session_is_opened_on_a_live_engine_when_the_chosen_one_died() -> None:
    members = [member(), member()]
    pool = EnginePool(as_engines(members), replace=None)
    members[0].kill()  # the pool has not seen it yet
    sessions = [await pool.open_session() for _ in range(3)]
    assert all(sid in members[1].engine._sessions for sid in sessions)
    assert pool.counters.lost == 1
    await pool.close()


async def test_a_replacement_ready_during_an_update_joins_after_it() -> None:
    """The replacement is brought up to date under the lock the update holds: it never
    serves the weights an update in flight is replacing."""
    held = asyncio.Event()
    release = asyncio.Event()

    class SlowUpdate(Mortal):
        async def update_weights(self, update: WeightUpdate) -> int:
            held.set()
            await release.wait()
            return await self.engine.update_weights(update)

    members = [member(), SlowUpdate(LocalEngine.from_init(TINY, seed=0, max_batch_size=8))]
    built: list[Mortal] = []

    async def replace(index: int, generation: int) -> Engine:
        built.append(member())
        return built[-1]  # type: ignore[return-value]

    pool = EnginePool(as_engines(members), replace=replace)
    state = build_model(TINY, seed=1).state_dict()
    members[0].kill()
    update = asyncio.create_task(pool.update_weights(WeightUpdate(state_dict=state)))
    await held.wait()  # the update is in flight; member 0's death shows up now
    assert pool.counters.lost == 1
    await wait_for(lambda: bool(built))
    await asyncio.sleep(0.05)
    assert pool.counters.replaced == 0  # built, but waiting for the update to end
    release.set()
    assert await update == 1
    await wait_for(lambda: pool.counters.replaced == 1)
    assert built[0].engine.weight_version == 1
    await pool.close()


async def test_a_burst_of_sessions_spreads_over_unequal_engines() -> None:
    members = [member(), member()]
    pool = EnginePool(as_engines(members))
    for sid in [await pool.open_session() for _ in range(8)]:
        if sid in members[1].engine._sessions:
            await pool.close_session(sid)  # engine 0 holds four, engine 1 none
    assert [len(m.engine._sessions) for m in members] == [4, 0]
    await asyncio.gather(*(pool.open_session() for _ in range(8)))
    assert [len(m.engine._sessions) for m in members] == [6, 6]
    await pool.close()


async def test_ties_go_round_robin_from_a_moving_start_past_dead_engines() -> None:
    """Least sessions first; among equals the first at or after a start that moves on one
    slot per pick, wrapping around and skipping the dead."""
    members = [member() for _ in range(4)]
    pool = EnginePool(as_engines(members), replace=None)
    members[1].kill()  # picked first (start 1), found dead, then skipped
    chosen = []
    for _ in range(6):
        sid = await pool.open_session()
        chosen.append(next(i for i, m in enumerate(members) if sid in m.engine._sessions))
    assert chosen == [2, 3, 0, 2, 3, 0]
    assert pool.counters.lost == 1
    await pool.close()
