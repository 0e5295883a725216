"""calc-tool's `python` tool in the real bubblewrap sandbox."""

import re
import shutil

import pytest

from envs import registry
from envs.base import TextAction, ToolCall, ToolCallsAction
from envs.builtin.calc_tool import CalcToolEnv
from tests.support.play import play_episode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]


def python_call(code: str) -> ToolCallsAction:
    return ToolCallsAction(calls=[ToolCall(id="c1", name="python", arguments={"code": code})])


async def test_oracle_solves_calc_tool_in_the_sandbox() -> None:
    env = CalcToolEnv()
    for seed in range(4):
        episode = await play_episode(env, registry.oracle("agentflow/calc-tool-v0"), seed=seed)
        assert episode.success and episode.total_reward == 1.0
    await env.close()
    await env.close()


async def test_tool_failures_are_observations_not_crashes() -> None:
    env = CalcToolEnv(max_turns=6, tool_timeout_s=1.0)
    await env.reset(seed=0)
    looped = await env.step(python_call("while True:\n    pass"))
    assert looped.observation.text == "error: time limit"
    hostile = await env.step(python_call("print(open('/etc/shadow').read())"))
    # Hidden from the sandbox's minimal view of the host, or unreadable as `nobody`.
    assert re.match(r"error: (PermissionError|FileNotFoundError)", hostile.observation.text or "")
    netless = await env.step(
        python_call("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    )
    assert (netless.observation.text or "").startswith("error: ")
    silent = await env.step(TextAction(text="python(x = 1)"))
    assert silent.observation.text == "(no output; use print)"
    state = await env.state()
    assert state["tool_calls"] == 4 and not state["done"]
    await env.close()
