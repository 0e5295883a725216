"""A white-box turn whose engine died is sent again on a new session, from the recorded
context (`SampledActions` over an `EnginePool`)."""

from __future__ import annotations

import pytest

from agentflow.agents.actions import SampledActions
from agentflow.agents.episode import EpisodeState
from agentflow.agents.runtime import PolicyRuntime
from agentflow.errors import EngineLost, EngineUnavailable
from agentflow.inference.base import SamplingParams
from agentflow.inference.pool import EnginePool
from agentflow.tokenization.chat import ByteChatTemplate
from tests.unit.inference.test_engine_pool import Mortal, as_engines, member


def runtime(pool: EnginePool) -> PolicyRuntime:
    return PolicyRuntime(
        pool, ByteChatTemplate(), sampling=SamplingParams(max_new_tokens=4), max_context=128
    )


async def test_a_turn_on_a_dead_engine_is_sent_again_with_the_whole_context() -> None:
    members = [member(), member()]
    pool = EnginePool(as_engines(members))
    actions = SampledActions(runtime(pool), park_after_s=None)
    await actions.open()
    context = [1, 2, 3, 4, 5]
    first = await actions.reply(EpisodeState(context=context, observations=[], room=64))
    context += [*first.output_ids, 9, 9]
    holder = next(m for m in members if actions.session_id in m.engine._sessions)
    holder.kill()
    second = await actions.reply(EpisodeState(context=context, observations=[], room=64))
    assert len(second.output_ids) == 4 and actions.resent == 1
    survivor = next(m for m in members if m is not holder)
    assert actions.session_id in survivor.engine._sessions
    assert actions.seen == len(context) + 4  # the new session holds the whole context
    await actions.close()
    await pool.close()


async def test_resends_are_bounded() -> None:
    members = [member(), member()]
    pool = EnginePool(as_engines(members))
    actions = SampledActions(runtime(pool), park_after_s=None, resends_on_lost_engine=0)
    await actions.open()
    next(m for m in members if actions.session_id in m.engine._sessions).kill()
    with pytest.raises(EngineLost):
        await actions.reply(EpisodeState(context=[1, 2, 3], observations=[], room=64))
    await pool.close()


async def test_with_no_engine_left_the_turn_fails_saying_so() -> None:
    only: list[Mortal] = [member()]
    pool = EnginePool(as_engines(only), replace=None)
    actions = SampledActions(runtime(pool), park_after_s=None)
    await actions.open()
    only[0].kill()
    with pytest.raises(EngineUnavailable, match="every engine of the pool died"):
        await actions.reply(EpisodeState(context=[1, 2, 3], observations=[], room=64))
    await pool.close()
