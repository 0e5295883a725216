"""Any of our envs as a ``gymnasium.Env`` with ``Text`` action and observation spaces.

The observation is the text of the step's new messages (``observation.text`` when the
env gives one), limited to printable ASCII -- other characters become ``?`` -- and to
``max_observation_chars``; an action is the text of a ``text`` action. Our envs are
async; this adapter runs the wrapped env on its own event-loop thread, so it works both
from plain code and from inside a running event loop.

A text the wrapped env cannot parse is its business (our envs answer it with a format
reminder), so every string in ``action_space`` is a valid action here.
"""

from __future__ import annotations

import asyncio
import string
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import gymnasium
from gymnasium import spaces

from envs.base import Env, Observation, StepResult, TextAction

T = TypeVar("T")
CHARSET = string.printable
_ALLOWED = frozenset(CHARSET)


def observation_text(observation: Observation, limit: int) -> str:
    text = observation.text
    if text is None:
        text = "\n".join(m.content for m in observation.messages)
    clean = "".join(c if c in _ALLOWED else "?" for c in text)[:limit]
    return clean or " "  # a Text space needs at least one character


class GymnasiumEnv(gymnasium.Env[str, str]):
    """Wrap ``make_env()`` (one of our envs) as a Gymnasium env."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        make_env: Callable[[], Env],
        *,
        max_observation_chars: int = 4096,
        max_action_chars: int = 256,
        step_timeout_s: float | None = 60.0,
    ) -> None:
        self.observation_space = spaces.Text(
            max_length=max_observation_chars, min_length=1, charset=CHARSET
        )
        self.action_space = spaces.Text(max_length=max_action_chars, min_length=1, charset=CHARSET)
        self._limit = max_observation_chars
        self._timeout = step_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.env: Env = self._run(self._build(make_env))
        self._closed = False

    @staticmethod
    async def _build(make_env: Callable[[], Env]) -> Env:
        return make_env()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _answer(self, result: StepResult) -> str:
        return observation_text(result.observation, self._limit)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        # Without a seed, draw one from the generator Gymnasium seeded, so that
        # reset(seed=s) followed by plain resets is reproducible too.
        episode_seed = seed if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        result = self._run(self.env.reset(seed=episode_seed, options=options))
        return self._answer(result), dict(result.info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"actions are text, not {type(action).__name__}")
        result = self._run(self.env.step(TextAction(text=action), timeout_s=self._timeout))
        return (
            self._answer(result),
            float(result.reward),
            result.terminated,
            result.truncated,
            dict(result.info),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.env.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()


def register_with_gymnasium(env_id: str, **defaults: Any) -> None:
    """Make ``gymnasium.make(env_id, **kwargs)`` build our env ``env_id`` as a Gymnasium env.

    ``kwargs`` go to our env's factory (``envs.registry.make``); Gymnasium's own ``make``
    options (``max_episode_steps``, wrappers) work as for any Gymnasium env.
    """
    from envs import registry

    registry.spec(env_id)  # fail now, not at make time, for an unknown id

    def create(**kwargs: Any) -> GymnasiumEnv:
        return GymnasiumEnv(lambda: registry.make(env_id, **{**defaults, **kwargs}))

    gymnasium.register(id=env_id, entry_point=create)
