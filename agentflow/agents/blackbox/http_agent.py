"""`HttpAgent`: the agent is a service; the gateway posts it the episode and waits.

The gateway POSTs the brief (`outcome.start_episode`: episode id, task, first messages,
tools, `base_url`, `api_key`, `callback_url`, `env_step_url`, `reward_url`) to the
agent service's URL. The service answers 2xx at once and runs its loop on its own time,
calling the gateway's OpenAI-compatible API with the key, and finally
`POST callback_url {status, answer?, reward?, error?}`. No callback within `deadline_s`
fails the episode with "agent did not call back within N s"; a refused or unreachable
service fails it with the reason, and other episodes go on.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from agentflow.agents.base import EpisodeHandle, EpisodeOutcome
from agentflow.agents.blackbox.live import LiveEpisodes
from agentflow.agents.blackbox.outcome import REWARD_SOURCES, RewardSource, settle, start_episode
from envs.base import EnvError


class HttpAgent:
    def __init__(
        self,
        url: str,
        live: LiveEpisodes,
        *,
        deadline_s: float = 600.0,
        reward: RewardSource = "env",
        post_timeout_s: float = 10.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"agent url must be http(s)://, got {url!r}")
        if not 0 < deadline_s <= 86_400:
            raise ValueError("deadline_s must be in (0, 86400]")
        if reward not in REWARD_SOURCES:
            raise ValueError(f"reward must be one of {REWARD_SOURCES}, got {reward!r}")
        self.url = url
        self.live = live
        self.deadline_s = deadline_s
        self.reward: RewardSource = reward
        self.post_timeout_s = post_timeout_s
        self._client = client

    async def run(self, episode: EpisodeHandle) -> EpisodeOutcome:
        deadline = time.monotonic() + self.deadline_s
        try:
            slot, brief = await start_episode(self.live, episode)
        except EnvError as exc:
            return EpisodeOutcome(status="failed", error=f"env reset failed: {exc.message}")
        try:
            brief["deadline_s"] = self.deadline_s
            refused = await self._post(brief)
            if refused is not None:
                return EpisodeOutcome(status="failed", error=refused)
            try:
                report = await asyncio.wait_for(
                    asyncio.shield(slot.report), deadline - time.monotonic()
                )
            except TimeoutError:
                return EpisodeOutcome(
                    status="failed",
                    error=f"agent did not call back within {self.deadline_s:g} s",
                )
            return await settle(slot, report, self.reward, deadline)
        finally:
            await self.live.finish_agent(episode.episode_id)

    async def _post(self, brief: dict[str, object]) -> str | None:
        """Hand the episode over; the reason it failed, or None."""
        client = self._client or httpx.AsyncClient(timeout=self.post_timeout_s)
        try:
            answer = await client.post(self.url, json=brief, timeout=self.post_timeout_s)
        except httpx.HTTPError as exc:
            return f"agent service at {self.url} unreachable: {type(exc).__name__}: {exc}"
        finally:
            if self._client is None:
                await client.aclose()
        if answer.status_code >= 300:
            return (
                f"agent service refused the episode: HTTP {answer.status_code}: {answer.text[:300]}"
            )
        return None
