"""The Teacher Manager around its boundaries: routing per episode and per turn, residency
(at most N loaded, least recently used evicted), scores equal to the teacher's own
forward pass, the reverse-KL loss moving the student towards its teacher, and the
config-time refusals (missing checkpoint, other vocabulary, remote + full)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest
import torch
from pydantic import ValidationError

from agentflow.errors import InvalidInput
from agentflow.modeling import ModelInit, build_model, save_model, score
from agentflow.run_config import DistillConfig, RunConfig, TeacherConfig
from agentflow.tokenization import ByteTokenizer
from agentflow.tokenization.chat import ByteChatTemplate
from agentflow.turn_rules import command_word
from agentflow.types import NO_VERSION, Trajectory
from trainer.algorithms import AlgorithmConfig, DistillLoss
from trainer.backends.torch_backend import TorchBackendConfig, TorchPolicy
from trainer.teachers import (
    Router,
    TeacherManager,
    TurnContext,
    check_teachers,
    policy_turns,
)

T = TypeVar("T")
TINY = ModelInit(layers=1, hidden=32, heads=2, max_context=256)
TEMPLATE = ByteChatTemplate()
TOKENIZER = ByteTokenizer()


def relay_trajectory(
    questions: list[str], answers: list[str], *, env_ref: str = "agentflow/digit-relay-v0"
) -> Trajectory:
    """A conversation rendered as the white-box agent records it: the prompt, then each
    answer (policy) and the next observation (env) as their own segments."""
    segments: list[tuple[int, list[int]]] = []
    first = TEMPLATE.render([{"role": "user", "content": questions[0]}], add_generation_prompt=True)
    segments.append((0, list(first.token_ids)))
    for i, answer in enumerate(answers):
        segments.append((1, [*TOKENIZER.encode(answer), *TEMPLATE.stop_ids[:1]]))
        if i + 1 < len(questions):
            delta = TEMPLATE.render_delta([{"role": "user", "content": questions[i + 1]}])
            segments.append((0, list(delta.token_ids)))
    ids: list[int] = []
    mask: list[int] = []
    starts: list[int] = []
    for policy, tokens in segments:
        starts.append(len(ids))
        ids += tokens
        mask += [policy] * len(tokens)
    return Trajectory(
        id=uuid.uuid4(),
        run_id=None,
        episode_id=uuid.uuid4(),
        group_id="g",
        leaf_turn_id=uuid.uuid4(),
        reward=1.0,
        status="ready",
        times_served=0,
        min_weight_version=0,
        created_at=datetime.now(UTC),
        turn_ids=tuple(uuid.uuid4() for _ in starts),
        turn_starts=tuple(starts),
        token_ids=tuple(ids),
        logprobs=tuple(-1.0 if m else 0.0 for m in mask),
        loss_mask=tuple(mask),
        weight_versions=tuple(0 if m else NO_VERSION for m in mask),
        env_ref=env_ref,
    )


def _relay() -> Trajectory:
    return relay_trajectory(
        ["mirror 123", "right. shift 456", "wrong. mirror 789"], ["321", "000", "987"]
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teachers")
    out = {}
    for seed, name in enumerate(("mirror", "shift", "third")):
        out[name] = save_model(build_model(TINY, seed=seed + 10), root / name)
    return out


def _teachers(paths: dict[str, Path], **extra: object) -> list[TeacherConfig]:
    return [
        TeacherConfig(
            name="mirror", path=str(paths["mirror"]), envs=["agentflow/mirror-digits-v0"]
        ),
        TeacherConfig(name="shift", path=str(paths["shift"]), envs=["agentflow/shift-digits-v0"]),
    ]


def test_policy_turns_are_the_segments_with_sampled_tokens() -> None:
    t = _relay()
    turns = policy_turns(t)
    assert len(turns) == 3
    for start, end in turns:
        assert all(t.loss_mask[start:end])
        assert TOKENIZER.decode(t.token_ids[start:end], skip_special=True) in ("321", "000", "987")


def test_episode_routing_goes_by_env_and_draws_by_weight(checkpoints: dict[str, Path]) -> None:
    teachers = _teachers(checkpoints)
    router = Router(teachers, DistillConfig())
    mirror = relay_trajectory(["mirror 123"], ["321"], env_ref="agentflow/mirror-digits-v0")
    assert {r.teacher for r in router.route(mirror)} == {0}
    assert router.route(_relay()) == []  # no teacher covers the relay env
    both = [
        TeacherConfig(name="a", path=str(checkpoints["mirror"]), envs=["e"], weight=3.0),
        TeacherConfig(name="b", path=str(checkpoints["shift"]), envs=["e"], weight=1.0),
    ]
    router = Router(both, DistillConfig())
    drawn: list[int] = []
    for _ in range(400):
        t = relay_trajectory(["mirror 1", "shift 2"], ["1", "3"], env_ref="e")
        chosen = {r.teacher for r in router.route(t)}
        assert len(chosen) == 1  # one teacher for the whole episode
        assert {r.teacher for r in router.route(t)} == chosen  # and the same every time
        drawn += chosen
    assert 0.68 < drawn.count(0) / len(drawn) < 0.82  # weights 3:1


def test_turn_routing_follows_the_rule_and_falls_back_to_the_episode(
    checkpoints: dict[str, Path],
) -> None:
    teachers = [
        TeacherConfig(name="rev", path=str(checkpoints["mirror"]), tags=["mirror"]),
        TeacherConfig(
            name="shift",
            path=str(checkpoints["shift"]),
            envs=["agentflow/digit-relay-v0"],
        ),
    ]
    seen: list[TurnContext] = []

    def decode(ids: Sequence[int]) -> str:
        return TOKENIZER.decode(ids, skip_special=True)

    router = Router(
        teachers, DistillConfig(route="turn", rule="agentflow.turn_rules:command_word"), decode
    )
    routes = router.route(_relay())
    # mirror → the teacher tagged `mirror`; shift → the teacher named "shift" (a
    # teacher's name is one of its tags); mirror again → rev.
    assert [r.teacher for r in routes] == [0, 1, 0]
    seen = [
        TurnContext("agentflow/digit-relay-v0", 1, "right. shift 456", ()),
        TurnContext("x", 0, "", ()),
    ]
    assert command_word(seen[0]) == "shift"
    assert command_word(seen[1]) is None
    # A turn whose tag no teacher has keeps the episode's teacher (shift covers the env).
    odd = relay_trajectory(["mirror 1", "right. square 2"], ["1", "4"])
    assert [r.teacher for r in router.route(odd)] == [0, 1]


def test_scores_are_the_teachers_own_log_probs_and_residency_is_bounded(
    checkpoints: dict[str, Path],
) -> None:
    teachers = [
        TeacherConfig(name=name, path=str(path), tags=[name]) for name, path in checkpoints.items()
    ]

    def decode(ids: Sequence[int]) -> str:
        return TOKENIZER.decode(ids, skip_special=True)

    distill = DistillConfig(
        route="turn", rule="agentflow.turn_rules:command_word", estimator="full", max_resident=1
    )
    manager = TeacherManager(teachers, distill, decode=decode)
    batch = [
        relay_trajectory(["mirror 12", "right. shift 34", "right. third 56"], ["21", "45", "9"])
        for _ in range(3)
    ]
    scores = asyncio_run(manager.score(batch))
    t = batch[0]
    models = {name: build_model(TINY, seed=i + 10) for i, name in enumerate(checkpoints)}
    for (start, end), name in zip(policy_turns(t), ("mirror", "shift", "third"), strict=True):
        expected = score(models[name], list(t.token_ids[:end]), start=1)
        target = scores.targets[0]
        for k in range(start, end):
            assert target.teacher[k] == list(checkpoints).index(name)
            assert target.logprobs[k] == pytest.approx(expected[k - 1], abs=1e-5)
            row = target.rows[k]  # type: ignore[index]
            assert target.dist is not None and row >= 0
            assert float(target.dist[row].exp().sum()) == pytest.approx(1.0, abs=1e-4)
            assert float(target.dist[row][t.token_ids[k]]) == pytest.approx(
                expected[k - 1], abs=1e-5
            )
    assert all(target.teacher[k] == -1 for k in range(policy_turns(t)[0][0]))
    # One teacher resident at a time: three teachers, each loaded once in this step.
    loaded = [x for x in manager.teachers if getattr(x, "model", None) is not None]
    assert len(loaded) == 1
    assert manager.residency.peak == 1
    assert scores.metrics["teachers_resident_peak"] == 1.0
    # The next step starts with the resident one: three more loads, not four.
    asyncio_run(manager.score(batch))
    loads = sum(getattr(x, "loads", 0) for x in manager.teachers)
    assert loads == 5
    asyncio_run(manager.close())


def asyncio_run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.mark.parametrize("estimator", ["full", "sampled"])
def test_the_reverse_kl_term_moves_the_student_to_its_teacher(
    estimator: Literal["full", "sampled"], checkpoints: dict[str, Path]
) -> None:
    """Distillation alone (no RL) on a fixed batch: the KL to the teacher falls."""
    torch.manual_seed(0)
    teachers = [TeacherConfig(name="mirror", path=str(checkpoints["mirror"]), envs=["e"])]
    distill = DistillConfig(estimator=estimator, rl=False)
    manager = TeacherManager(teachers, distill)
    student = TorchPolicy(build_model(TINY, seed=1), TorchBackendConfig(lr=3e-3))
    rng = random.Random(0)
    batch = [
        relay_trajectory(
            [f"mirror {rng.randint(100, 999)}"], [str(rng.randint(100, 999))], env_ref="e"
        )
        for _ in range(8)
    ]
    loss = DistillLoss(rl=False, estimator=estimator)
    kls = []
    for _ in range(30):
        scores = asyncio_run(manager.score(batch))
        metrics = student.train_step(
            batch,
            [0.0] * len(batch),
            AlgorithmConfig(),
            teacher=scores,
            distill=loss,
        )
        kls.append(metrics["teacher/mirror/kl"])
        assert metrics["teacher/mirror/tokens"] == sum(sum(t.loss_mask) for t in batch)
    assert kls[-1] < 0.5 * kls[0]
    asyncio_run(manager.close())


def test_a_student_equal_to_its_teacher_has_no_kl(checkpoints: dict[str, Path]) -> None:
    teachers = [TeacherConfig(name="mirror", path=str(checkpoints["mirror"]), envs=["e"])]
    manager = TeacherManager(teachers, DistillConfig(estimator="full"))
    student = TorchPolicy(build_model(TINY, seed=10), TorchBackendConfig(lr=1e-9))
    batch = [relay_trajectory(["mirror 123"], ["321"], env_ref="e")]
    scores = asyncio_run(manager.score(batch))
    metrics = student.train_step(
        batch,
        [0.0],
        AlgorithmConfig(),
        teacher=scores,
        distill=DistillLoss(estimator="full"),
    )
    assert metrics["teacher/mirror/kl"] == pytest.approx(0.0, abs=1e-5)
    asyncio_run(manager.close())


# -- config-time refusals ------------------------------------------------------------------


def _run(teachers: list[dict[str, object]], **extra: object) -> dict[str, object]:
    return {
        "name": "d",
        "envs": [{"id": "agentflow/mirror-digits-v0"}, {"id": "agentflow/shift-digits-v0"}],
        "model": {"init": TINY.model_dump()},
        "teachers": teachers,
        **extra,
    }


def test_a_missing_checkpoint_is_refused_naming_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "teacher"
    config = RunConfig.model_validate(
        _run([{"name": "t", "path": str(missing), "envs": ["agentflow/mirror-digits-v0"]}])
    )
    with pytest.raises(InvalidInput) as caught:
        check_teachers(config)
    assert str(missing) in caught.value.message and "does not exist" in caught.value.message
    assert caught.value.field == ("teachers", "0", "path")


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2,
        )
    )  # fmt: skip
    other.save_pretrained(tmp_path / "other")
    config = RunConfig.model_validate(
        _run(
            [
                {
                    "name": "big",
                    "path": str(tmp_path / "other"),
                    "envs": ["agentflow/mirror-digits-v0"],
                }
            ]
        )
    )
    with pytest.raises(InvalidInput) as caught:
        check_teachers(config)
    assert "vocabulary 300" in caught.value.message and "'big'" in caught.value.message


@pytest.mark.parametrize(
    ("teachers", "extra", "said"),
    [
        (
            [{"name": "r", "url": "http://127.0.0.1:9/", "envs": ["agentflow/mirror-digits-v0"]}],
            {"distill": {"estimator": "full"}},
            "score over HTTP",
        ),
        (
            [{"name": "r", "path": "/x", "envs": ["agentflow/mirror-digits-v0"]}] * 2,
            {},
            "unique",
        ),
        (
            [{"name": "r", "path": "/x", "envs": ["agentflow/guess-number-v0"]}],
            {},
            "do not include",
        ),
        ([{"name": "r", "path": "/x"}], {}, "covers no env"),
        ([{"name": "r", "path": "/x", "url": "http://127.0.0.1:9/"}], {}, "exactly one"),
        ([], {"distill": {"coef": 2.0}}, "add [[teachers]]"),
        (
            [{"name": "r", "path": "/x", "envs": ["agentflow/mirror-digits-v0"]}],
            {"distill": {"rule": "agentflow.turn_rules:command_word"}},
            "set route = 'turn'",
        ),
    ],
)
def test_bad_teacher_configs_are_refused_at_parse(
    teachers: list[dict[str, object]], extra: dict[str, object], said: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        RunConfig.model_validate(_run(teachers, **extra))
    assert said in str(caught.value)


def test_a_rule_that_raises_leaves_the_turn_with_its_episode_teacher(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTFLOW_PLUGIN_MODULES", "tests.support")
    teachers = [
        TeacherConfig(
            name="shift", path=str(checkpoints["shift"]), envs=["agentflow/digit-relay-v0"]
        )
    ]
    distill = DistillConfig(route="turn", rule="tests.support.plugins:failing_rule")
    router = Router(teachers, distill, lambda ids: TOKENIZER.decode(ids, skip_special=True))
    assert [r.teacher for r in router.route(_relay())] == [0, 0, 0]
    assert router.rule_errors == 3


def test_turn_routing_without_a_rule_uses_the_built_in_one(checkpoints: dict[str, Path]) -> None:
    teachers = [
        TeacherConfig(name="mirror", path=str(checkpoints["mirror"])),
        TeacherConfig(name="shift", path=str(checkpoints["shift"])),
    ]
    distill = DistillConfig(route="turn")
    assert distill.turn_rule == "agentflow.turn_rules:command_word"
    router = Router(teachers, distill, lambda ids: TOKENIZER.decode(ids, skip_special=True))
    assert [r.teacher for r in router.route(_relay())] == [0, 1, 0]
