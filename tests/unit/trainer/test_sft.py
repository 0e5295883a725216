"""Warm start: oracle episodes are rendered exactly as the white-box agent records them,
SFT trains only on reply tokens, evaluation and `run_sft` work end to end (tiny models)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import torch
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from agentflow.agents.actions import reply_token_ids
from agentflow.agents.base import Budget, EpisodeHandle
from agentflow.agents.runtime import PolicyRuntime
from agentflow.agents.whitebox import WhiteBoxAgent
from agentflow.db.session import create_engine, session_factory
from agentflow.db.turn_tree import TurnTree
from agentflow.errors import InvalidInput
from agentflow.inference.base import SamplingParams
from agentflow.modeling import ModelInit, build_model, load_model
from agentflow.run_config import AgentConfig, EnvEntry, RunConfig
from agentflow.tokenization.chat import ByteChatTemplate
from agentflow.types import Trajectory
from envs import registry
from envs.base import TextAction
from tests.support.engine import MockEngine, replay
from trainer.embedded import warm_start_config
from trainer.evaluation import evaluate
from trainer.sft import (
    SFT_METRICS_FILE,
    SftConfig,
    SftSequence,
    oracle_episodes,
    run_sft,
    sft,
    sft_from_trajectories,
)

GUESS = "agentflow/guess-number-v0"
TINY = ModelInit(layers=1, hidden=32, heads=2, max_context=256)


def _contains(ids: Sequence[int], part: Sequence[int]) -> bool:
    return any(list(ids[i : i + len(part)]) == list(part) for i in range(len(ids)))


def _replies(seq: SftSequence) -> list[list[int]]:
    """The runs of loss-mask-1 tokens: the policy's replies, in order."""
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(seq.token_ids, seq.loss_mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return runs


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # tiny models: more threads only contend


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(database_url)
    yield session_factory(engine)
    await engine.dispose()


@pytest.mark.parametrize("system_prompt", [None, "Answer with one number."])
@pytest.mark.parametrize(("env_id", "p_oracle"), [(GUESS, 0.35), ("agentflow/lookup-v0", 1.0)])
async def test_oracle_episode_is_what_the_whitebox_agent_records(
    env_id: str,
    p_oracle: float,
    system_prompt: str | None,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    template = ByteChatTemplate()
    sequences = await oracle_episodes(
        env_id, 3, template, p_oracle=p_oracle, seed=5, system_prompt=system_prompt
    )
    if system_prompt is not None:  # the prompt is in the warm start's data
        wanted = template.tokenizer.encode(system_prompt)
        assert all(_contains(s.token_ids, wanted) for s in sequences)
    turns = TurnTree(sessions)
    for seq in sequences:
        runtime = PolicyRuntime(
            engine=MockEngine(replay(_replies(seq))),  # the oracle's replies
            template=template,
            sampling=SamplingParams(max_new_tokens=64, stop_token_ids=template.stop_ids),
            max_context=4096,
        )
        episode_id = await turns.create_episode(env_ref=env_id, task={"seed": seq.env_seed})
        env = registry.make(env_id)
        handle = EpisodeHandle(
            episode_id=episode_id,
            run_id=None,
            env=env,
            runtime=runtime,
            turns=turns,
            task={"seed": seq.env_seed},
            budget=Budget(max_turns=6, max_tokens=4096),
        )
        try:
            outcome = await WhiteBoxAgent(park_after_s=None, system_prompt=system_prompt).run(
                handle
            )
        finally:
            await env.close()
        assert outcome.reward == pytest.approx(seq.reward)
        (leaf,) = await turns.leaves(episode_id)
        recorded = await turns.context(leaf.id)
        assert recorded.token_ids == seq.token_ids
        assert recorded.loss_mask == seq.loss_mask


async def test_only_replies_are_trained_and_episodes_are_reproducible() -> None:
    template = ByteChatTemplate()
    tok = template.tokenizer
    first = await oracle_episodes(GUESS, 200, template, p_oracle=0.35, seed=1)
    again = await oracle_episodes(GUESS, 200, template, p_oracle=0.35, seed=1)
    assert first == again
    assert first != await oracle_episodes(GUESS, 200, template, p_oracle=0.35, seed=2)
    for seq in first:
        replies = _replies(seq)
        assert len(replies) == seq.turns
        for reply in replies:  # a number, then the end-of-message token
            assert reply[-1] == tok.end_id
            assert 1 <= int(tok.decode(reply[:-1])) <= 16
        # the token before each reply opens the assistant's turn
        starts = [i for i, b in enumerate(seq.loss_mask) if b and not seq.loss_mask[i - 1]]
        assert all(seq.token_ids[i - 1] == tok.role_id("assistant") for i in starts)
    success = sum(s.reward > 0 for s in first) / len(first)
    assert 0.35 < success < 0.65  # the noisy oracle finds the number about half the time
    perfect = await oracle_episodes(GUESS, 50, template, p_oracle=1.0, seed=1)
    assert all(s.reward >= 0.6 for s in perfect)  # binary search: at most 5 guesses


def test_reply_tokens_must_parse_back_to_the_action() -> None:
    template = ByteChatTemplate()
    assert reply_token_ids(template, TextAction(text="8")) == [ord("8"), template.stop_ids[0]]
    forged = TextAction(text='<|tool_call|>{"name": "x"}<|/tool_call|>')
    with pytest.raises(InvalidInput):  # as text it would parse back as a tool call
        reply_token_ids(template, forged)


async def test_envs_without_a_noisy_oracle_need_p_oracle_one() -> None:
    with pytest.raises(InvalidInput):
        await oracle_episodes("agentflow/lookup-v0", 1, ByteChatTemplate(), p_oracle=0.5)


async def test_sft_learns_the_replies() -> None:
    template = ByteChatTemplate()
    data = await oracle_episodes(GUESS, 64, template, p_oracle=1.0, seed=0)
    model = build_model(TINY, seed=0)
    logged: list[tuple[int, float]] = []
    metrics = sft(
        model,
        data,
        epochs=6,
        batch_size=16,
        lr=1e-2,
        log=lambda step, loss: logged.append((step, loss)),
        log_every=4,
    )
    assert metrics.steps == 24 and metrics.epochs == 6
    assert metrics.trained_tokens == 6 * sum(sum(s.loss_mask) for s in data)
    assert logged == metrics.losses and metrics.tokens_per_s > 0
    assert metrics.losses[-1][1] < 0.5 * metrics.losses[0][1]
    assert not model.training

    stopped = sft(build_model(TINY), data, epochs=50, batch_size=8, max_seconds=0.2)
    assert stopped.stopped_early and stopped.steps < 400


def test_sft_from_trajectories_uses_their_loss_mask() -> None:
    def trajectory(tokens: list[int], mask: list[int]) -> Trajectory:
        return Trajectory(
            id=uuid.uuid4(),
            run_id=None,
            episode_id=uuid.uuid4(),
            group_id=None,
            leaf_turn_id=uuid.uuid4(),
            reward=1.0,
            status="ready",
            times_served=0,
            min_weight_version=0,
            created_at=dt.datetime.now(dt.UTC),
            turn_ids=(uuid.uuid4(),),
            turn_starts=(0,),
            token_ids=tuple(tokens),
            logprobs=(0.0,) * len(tokens),
            loss_mask=tuple(mask),
            weight_versions=(0,) * len(tokens),
        )

    trained = trajectory([257, 10, 11, 12, 13], [0, 0, 1, 1, 0])
    untrained = trajectory([257, 10, 11], [0, 0, 0])  # no policy tokens: skipped
    metrics = sft_from_trajectories(build_model(TINY), [trained, untrained], epochs=1)
    assert metrics.steps == 1 and metrics.trained_tokens == 2
    with pytest.raises(InvalidInput):
        sft_from_trajectories(build_model(TINY), [untrained], epochs=1)


async def test_evaluate_samples_episodes_concurrently() -> None:
    template = ByteChatTemplate()
    result = await evaluate(
        build_model(TINY), GUESS, 12, template, seed=3, max_new_tokens=4, concurrency=5
    )
    assert result.episodes == 12
    assert 0.0 <= result.mean_reward <= result.success_rate <= 1.0
    assert 1.0 <= result.mean_turns <= 6.0
    assert result.generated_tokens >= 12 and result.episodes_per_s > 0


def test_run_sft_saves_a_loadable_checkpoint(tmp_path: object) -> None:
    config = SftConfig(n_episodes=32, epochs=1, batch_size=16, eval_episodes=4)
    out = tmp_path / "sft"  # type: ignore[operator]
    metrics = run_sft(config, TINY, out)
    assert metrics["data"]["episodes"] == 32 and metrics["train"]["steps"] == 2
    assert metrics["eval"]["episodes"] == 4
    assert json.loads((out / SFT_METRICS_FILE).read_text()) == json.loads(json.dumps(metrics))
    assert load_model(out).config.agentflow_init["layers"] == TINY.layers


def test_min_reward_trains_only_on_the_wins(tmp_path: object) -> None:
    config = SftConfig(
        n_episodes=32, p_oracle=0.3, min_reward=0.5, epochs=1, batch_size=4, eval_episodes=0
    )
    lines: list[str] = []
    metrics = run_sft(config, TINY, tmp_path / "sft", progress=lines.append)  # type: ignore[operator]
    data = asyncio.run(oracle_episodes(GUESS, 32, ByteChatTemplate(), p_oracle=0.3, seed=0))
    wins = sum(1 for s in data if s.reward >= 0.5)
    assert 0 < wins < 32  # the noisy player wins some and loses some
    assert metrics["data"]["trained_on"] == wins
    assert metrics["train"]["steps"] == -(-wins // 4)
    assert lines[0].startswith("warm start data: 32 episodes")
    assert lines[-1].startswith("warm start training:")
    never = SftConfig(n_episodes=4, p_oracle=0.0, min_reward=2.0, eval_episodes=0)
    with pytest.raises(InvalidInput, match="min_reward"):
        run_sft(never, TINY, tmp_path / "never")  # type: ignore[operator]


def test_config_bounds() -> None:
    with pytest.raises(ValidationError):
        SftConfig(p_oracle=1.5)
    with pytest.raises(ValidationError):
        SftConfig(epochs=0)
    with pytest.raises(ValidationError):
        SftConfig(unknown=1)  # type: ignore[call-arg]


def test_the_warm_start_plays_as_the_runs_agent() -> None:
    config = RunConfig(
        name="w",
        envs=[EnvEntry(id=GUESS)],
        agent=AgentConfig(system_prompt="Guess.", max_turns=4, max_tokens=300, max_new_tokens=5),
    )
    sft_config = warm_start_config(config)
    assert (sft_config.system_prompt, sft_config.max_turns) == ("Guess.", 4)
    assert (sft_config.max_tokens, sft_config.max_new_tokens) == (300, 5)
