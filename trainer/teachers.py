"""The Teacher Manager: multi-teacher on-policy distillation (docs/distillation.md).

The student samples; teachers score the student's own tokens; the loss pulls the student
towards each teacher on the turns that teacher covers:

    route  each policy turn of a trajectory → one teacher (or none)
           per episode: the teachers whose `envs` hold the episode's env (several: one
           drawn by `weight`, the same for every turn of the episode);
           per turn (`distill.route = "turn"`): `distill.rule(TurnContext)` names a tag,
           and the teacher whose `tags` (or name) hold it scores that turn; a turn the
           rule leaves open (None, or a tag no teacher has) keeps its episode's teacher
    score  prefill only, batched: a local teacher runs one forward pass over the
           trajectories routed to it and keeps the log-probs (`sampled`) or the whole
           log-softmax (`full`) at the positions that predict its tokens; a remote one
           (an SGLang engine) answers `return_logprob` with `logprob_start_len = 0` and
           `max_new_tokens = 0`, the log-prob of each given token
    loss   (`trainer.backends.torch_backend`) per-token reverse KL on the student's
           samples, times `distill.coef`, alone or added to the RL objective

Residency: at most `distill.max_resident` local teachers are loaded at once; loading
another evicts the least recently used one (dropped, or moved to CPU memory for a CUDA
trainer with `offload = "cpu"`). A step scores the resident teachers first, so a step
whose teachers all fit loads nothing. Metrics per teacher: `teacher/NAME/tokens`,
`/kl`, `/seconds`, `/swaps` (loads after its first).

A teacher that fails (an engine that does not answer) raises `TeacherUnavailable`
naming it: the train loop fails that step, keeps its batch, and tries again. A routing
rule that raises leaves that turn with its episode's teacher (logged once, counted in
`teacher_rule_errors`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from agentflow.errors import AgentFlowError, InvalidInput
from agentflow.modeling import MODEL_INIT_FILE, ModelInit
from agentflow.plugins import load_function
from agentflow.run_config import DistillConfig, RunConfig, TeacherConfig
from agentflow.types import Trajectory

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class TeacherError(AgentFlowError):
    """A teacher could not score a batch; the message names the teacher."""


class TeacherUnavailable(TeacherError):
    """A teacher engine did not answer (refused, timed out, 5xx)."""

    status_code = 503


@dataclass(frozen=True)
class TurnContext:
    """What a per-turn routing rule sees of one policy turn."""

    env_ref: str  # the episode's env id (or registered name)
    turn: int  # 0 for the trajectory's first policy turn
    observation: str  # the text between the previous policy turn and this one
    context_ids: tuple[int, ...]  # every token before this turn


RoutingRule = Callable[[TurnContext], "str | None"]


@dataclass(frozen=True)
class Route:
    """Tokens [start, end) of a trajectory (one policy turn) go to teacher `teacher`."""

    start: int
    end: int
    teacher: int


@dataclass
class TeacherTargets:
    """A trajectory's teacher scores, token-aligned like `Trajectory.logprobs`.

    `logprobs[k]` is the teacher's log-prob of token k and `teacher[k]` its index, for the
    policy tokens a teacher scored (0.0 and -1 elsewhere). With the `full` estimator,
    `dist` holds the teacher's log-softmax at the position predicting each scored token,
    one row per scored token in increasing k (`rows[k]` is its row, -1 elsewhere).
    """

    logprobs: list[float]
    teacher: list[int]
    dist: torch.Tensor | None = None
    rows: list[int] | None = None

    @classmethod
    def empty(cls, n: int, full: bool) -> TeacherTargets:
        return cls([0.0] * n, [-1] * n, None, [-1] * n if full else None)


@dataclass
class TeacherScores:
    """A batch's teacher scores, one `TeacherTargets` per trajectory, in order."""

    names: list[str]
    targets: list[TeacherTargets]
    full: bool
    metrics: dict[str, float] = field(default_factory=dict)


def policy_turns(trajectory: Trajectory) -> list[tuple[int, int]]:
    """(start, end) of each segment holding policy tokens (loss mask 1), in order."""
    starts = list(trajectory.turn_starts)
    n = len(trajectory.token_ids)
    bounds = [*starts, n]
    out = []
    for i, start in enumerate(starts):
        end = bounds[i + 1]
        if start < end and any(trajectory.loss_mask[start:end]):
            out.append((start, end))
    return out


class Router:
    """Policy turns → teacher indices (see the module docstring)."""

    def __init__(
        self,
        teachers: Sequence[TeacherConfig],
        distill: DistillConfig,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self.teachers = list(teachers)
        self.per_turn = distill.route == "turn"
        self.rule_path = distill.turn_rule
        self.rule: RoutingRule | None = (
            load_function(self.rule_path, field=("distill", "rule")) if self.per_turn else None
        )
        self.rule_errors = 0  # turns whose rule raised (they keep the episode's teacher)
        self.decode = decode
        if self.per_turn and decode is None:
            raise InvalidInput("per-turn routing needs the tokenizer to decode", field="distill")
        self.by_tag: dict[str, int] = {}
        for i, teacher in enumerate(self.teachers):
            for tag in (teacher.name, *teacher.tags):
                self.by_tag.setdefault(tag, i)

    def episode_teacher(self, trajectory: Trajectory) -> int | None:
        """The teacher of the trajectory's episode: by env, drawn by weight when several
        cover it (seeded by the episode id, so every turn and every rescoring agree)."""
        env = trajectory.env_ref
        covering = [i for i, t in enumerate(self.teachers) if env in t.envs]
        if not covering:
            return None
        if len(covering) == 1:
            return covering[0]
        weights = [self.teachers[i].weight for i in covering]
        return random.Random(trajectory.episode_id.int).choices(covering, weights)[0]

    def route(self, trajectory: Trajectory) -> list[Route]:
        episode = self.episode_teacher(trajectory)
        routes: list[Route] = []
        previous_end = 0
        for turn, (start, end) in enumerate(policy_turns(trajectory)):
            chosen = episode
            if self.per_turn and self.rule is not None and self.decode is not None:
                context = TurnContext(
                    env_ref=trajectory.env_ref,
                    turn=turn,
                    observation=self.decode(trajectory.token_ids[previous_end:start]),
                    context_ids=tuple(trajectory.token_ids[:start]),
                )
                try:
                    tag = self.rule(context)
                except Exception:  # noqa: BLE001 - a rule's bug costs its turn's routing
                    self.rule_errors += 1
                    if self.rule_errors == 1:
                        log.exception(
                            "routing rule %s raised; the episode's teacher scores", self.rule_path
                        )
                    tag = None
                if isinstance(tag, str) and tag in self.by_tag:
                    chosen = self.by_tag[tag]
            previous_end = end
            if chosen is not None:
                routes.append(Route(start, end, chosen))
        return routes


# -- the teachers ------------------------------------------------------------------------


class LocalTeacher:
    """A checkpoint loaded into this process on demand (see `Residency`)."""

    def __init__(self, config: TeacherConfig, device: str, offload: str) -> None:
        self.config = config
        self.name = config.name
        self.device = device
        self.offload = offload if device.startswith("cuda") else "drop"
        self.model: PreTrainedModel | None = None
        self.loads = 0  # each load onto the device, the first included
        self._on_device = False

    def acquire(self) -> PreTrainedModel:
        from agentflow.modeling import load_model

        if self.model is None:
            self.model = load_model(self.config.path, device=self.device)
            self.model.requires_grad_(False)
            self.loads += 1
        elif not self._on_device:
            self.model = self.model.to(self.device)  # type: ignore[arg-type]
            self.loads += 1
        self._on_device = True
        return self.model

    def evict(self) -> None:
        if self.model is None:
            return
        if self.offload == "cpu":
            self.model = self.model.to("cpu")  # type: ignore[arg-type]
        else:
            self.model = None
            gc.collect()  # the weights' memory goes back now, not at the next collection
        self._on_device = False
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


class RemoteTeacher:
    """An SGLang server scoring the given tokens (prefill only)."""

    def __init__(self, config: TeacherConfig, concurrency: int = 16) -> None:
        assert config.url is not None
        self.config = config
        self.name = config.name
        self.url = str(config.url).rstrip("/")
        self.gate = asyncio.Semaphore(concurrency)

    async def score(self, client: httpx.AsyncClient, token_ids: Sequence[int]) -> list[float]:
        """The log-prob of each token after the first (n - 1 values)."""
        body = {
            "input_ids": list(token_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        async with self.gate:
            try:
                response = await client.post(
                    f"{self.url}/generate", json=body, timeout=self.config.timeout_s
                )
            except httpx.HTTPError as exc:
                raise TeacherUnavailable(
                    f"teacher {self.name!r} at {self.url} did not answer: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise TeacherUnavailable(
                f"teacher {self.name!r} at {self.url}: HTTP {response.status_code}: "
                f"{response.text[:300]}"
            )
        if response.is_error:
            raise TeacherError(
                f"teacher {self.name!r} at {self.url} refused to score: "
                f"HTTP {response.status_code}: {response.text[:300]}"
            )
        try:
            entries = response.json()["meta_info"]["input_token_logprobs"]
            values = [float(entry[0]) for entry in entries[1:]]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TeacherError(
                f"teacher {self.name!r} at {self.url} answered without input log-probs: {exc}"
            ) from exc
        if len(values) != len(token_ids) - 1:
            raise TeacherError(
                f"teacher {self.name!r} at {self.url} scored {len(values)} tokens of "
                f"{len(token_ids) - 1}"
            )
        return values


class Residency:
    """At most `limit` local teachers loaded; the least recently used goes first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.order: OrderedDict[str, LocalTeacher] = OrderedDict()
        self.peak = 0

    def acquire(self, teacher: LocalTeacher) -> PreTrainedModel:
        if teacher.name in self.order:
            self.order.move_to_end(teacher.name)
            return teacher.acquire()
        while len(self.order) >= self.limit:
            _, oldest = self.order.popitem(last=False)
            oldest.evict()
        model = teacher.acquire()
        self.order[teacher.name] = teacher
        self.peak = max(self.peak, len(self.order))
        return model

    @property
    def resident(self) -> list[str]:
        return list(self.order)


# -- the manager ---------------------------------------------------------------------------


class TeacherManager:
    """Routes a batch's turns, scores them with the teachers, and reports per teacher."""

    def __init__(
        self,
        teachers: Sequence[TeacherConfig],
        distill: DistillConfig,
        *,
        device: str = "cpu",
        temperature: float = 1.0,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self.configs = list(teachers)
        self.distill = distill
        self.full = distill.estimator == "full"
        self.temperature = temperature
        self.router = Router(teachers, distill, decode)
        self.teachers: list[LocalTeacher | RemoteTeacher] = [
            RemoteTeacher(t) if t.url is not None else LocalTeacher(t, device, distill.offload)
            for t in teachers
        ]
        self.names = [t.name for t in teachers]
        self.residency = Residency(distill.max_resident)
        self.seconds = [0.0] * len(teachers)
        self.tokens = [0] * len(teachers)
        self._http: httpx.AsyncClient | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        for teacher in self.teachers:
            if isinstance(teacher, LocalTeacher):
                teacher.evict()

    async def score(self, trajectories: Sequence[Trajectory]) -> TeacherScores:
        """Every routed policy token of `trajectories`, scored by its teacher."""
        targets = [TeacherTargets.empty(len(t.token_ids), self.full) for t in trajectories]
        work: dict[int, list[tuple[int, list[Route]]]] = {}
        for index, trajectory in enumerate(trajectories):
            by_teacher: dict[int, list[Route]] = {}
            for route in self.router.route(trajectory):
                by_teacher.setdefault(route.teacher, []).append(route)
            for chosen, routes in by_teacher.items():
                work.setdefault(chosen, []).append((index, routes))
        # Resident teachers first: a step whose teachers are all loaded loads nothing.
        order = sorted(work, key=lambda i: self.names[i] not in self.residency.resident)
        dist_parts: list[list[tuple[int, torch.Tensor]]] = [[] for _ in trajectories]
        for teacher_index in order:
            started = time.perf_counter()
            teacher = self.teachers[teacher_index]
            jobs = work[teacher_index]
            if isinstance(teacher, RemoteTeacher):
                await self._score_remote(teacher, teacher_index, trajectories, jobs, targets)
            else:
                await asyncio.to_thread(
                    self._score_local,
                    teacher,
                    teacher_index,
                    trajectories,
                    jobs,
                    targets,
                    dist_parts,
                )
            self.seconds[teacher_index] += time.perf_counter() - started
            self.tokens[teacher_index] += sum(
                sum(trajectories[i].loss_mask[r.start : r.end].count(1) for r in routes)
                for i, routes in jobs
            )
        if self.full:
            _assemble_dists(targets, dist_parts)
        return TeacherScores(self.names, targets, self.full, self.metrics())

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "teachers_resident_peak": float(self.residency.peak),
            "teacher_rule_errors": float(self.router.rule_errors),
        }
        for i, teacher in enumerate(self.teachers):
            prefix = f"teacher/{teacher.name}"
            out[f"{prefix}/tokens_total"] = float(self.tokens[i])
            out[f"{prefix}/seconds_total"] = round(self.seconds[i], 4)
            if isinstance(teacher, LocalTeacher):
                out[f"{prefix}/swaps"] = float(max(0, teacher.loads - 1))
        return out

    async def _score_remote(
        self,
        teacher: RemoteTeacher,
        teacher_index: int,
        trajectories: Sequence[Trajectory],
        jobs: list[tuple[int, list[Route]]],
        targets: list[TeacherTargets],
    ) -> None:
        if self._http is None:
            self._http = httpx.AsyncClient()
        client = self._http

        async def one(index: int, routes: list[Route]) -> None:
            trajectory = trajectories[index]
            last = max(r.end for r in routes)
            values = await teacher.score(client, trajectory.token_ids[:last])
            target = targets[index]
            for route in routes:
                for k in range(max(route.start, 1), route.end):
                    if trajectory.loss_mask[k]:
                        target.logprobs[k] = values[k - 1]
                        target.teacher[k] = teacher_index

        await asyncio.gather(*(one(i, routes) for i, routes in jobs))

    def _score_local(
        self,
        teacher: LocalTeacher,
        teacher_index: int,
        trajectories: Sequence[Trajectory],
        jobs: list[tuple[int, list[Route]]],
        targets: list[TeacherTargets],
        dist_parts: list[list[tuple[int, torch.Tensor]]],
    ) -> None:
        import torch

        from agentflow.modeling import token_logprobs

        model = self.residency.acquire(teacher)
        device = next(model.parameters()).device
        # Longest first, as many rows as fit the token budget (padding counted).
        jobs = sorted(jobs, key=lambda job: -max(r.end for r in job[1]))
        budget = self.distill.max_tokens_per_batch
        batches: list[list[tuple[int, list[Route]]]] = []
        width = 0
        for job in jobs:
            length = max(r.end for r in job[1])
            if batches and (len(batches[-1]) + 1) * width <= budget:
                batches[-1].append(job)
            else:
                batches.append([job])
                width = length
        for batch in batches:
            width = max(max(r.end for r in routes) for _, routes in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            rows, cols, tokens, where = [], [], [], []
            for row, (index, routes) in enumerate(batch):
                trajectory = trajectories[index]
                last = max(r.end for r in routes)
                ids[row, :last] = torch.tensor(trajectory.token_ids[:last])
                for route in routes:
                    for k in range(max(route.start, 1), route.end):
                        if trajectory.loss_mask[k]:
                            rows.append(row)
                            cols.append(k - 1)  # position k-1 predicts token k
                            tokens.append(trajectory.token_ids[k])
                            where.append((index, k))
            if not where:
                continue
            with torch.inference_mode():
                hidden = model.get_decoder()(input_ids=ids.to(device), use_cache=False)
                selected = hidden.last_hidden_state[torch.tensor(rows), torch.tensor(cols)]
                logits = model.get_output_embeddings()(selected).float()
                token_ids = torch.tensor(tokens, device=logits.device)
                values = token_logprobs(logits, token_ids, self.temperature).cpu()
                full = None
                if self.full:
                    scaled = logits / self.temperature if self.temperature > 0 else logits
                    full = torch.log_softmax(scaled, dim=-1).cpu()
            for j, (index, k) in enumerate(where):
                targets[index].logprobs[k] = float(values[j])
                targets[index].teacher[k] = teacher_index
                if full is not None:
                    dist_parts[index].append((k, full[j]))


def _assemble_dists(
    targets: list[TeacherTargets], parts: list[list[tuple[int, torch.Tensor]]]
) -> None:
    import torch

    for target, rows in zip(targets, parts, strict=True):
        if not rows:
            continue
        rows.sort(key=lambda item: item[0])
        target.dist = torch.stack([row for _, row in rows])
        assert target.rows is not None
        for r, (k, _) in enumerate(rows):
            target.rows[k] = r


# -- config checks and construction -------------------------------------------------------


def _vocabulary(path: Path) -> tuple[int, str]:
    """(vocab size, tokenizer kind) of an HF-format checkpoint directory."""
    config = json.loads((path / "config.json").read_text())
    init_file = path / MODEL_INIT_FILE
    kind = "hf"
    if init_file.is_file():
        kind = str(json.loads(init_file.read_text()).get("tokenizer", "hf"))
    return int(config["vocab_size"]), kind


def student_vocabulary(config: RunConfig) -> tuple[int, str]:
    if config.model.path:
        return _vocabulary(Path(config.model.path))
    init: ModelInit = config.model.init
    return init.vocab_size, init.tokenizer


def check_teachers(config: RunConfig) -> None:
    """Refuse, naming the field, a teacher this trainer cannot load: a checkpoint path that
    is not there, or one whose vocabulary differs from the student's (its scores would be
    of other tokens). Called by the trainer before anything runs; the gateway never loads
    teachers, so the config's parse does not look at the file system."""
    if not config.teachers:
        return
    student = None
    for i, teacher in enumerate(config.teachers):
        if not teacher.path:
            continue
        where = ("teachers", str(i), "path")
        path = Path(teacher.path)
        if not (path / "config.json").is_file():
            said = "does not exist" if not path.exists() else "has no config.json"
            raise InvalidInput(
                f"teacher {teacher.name!r}: checkpoint {teacher.path} {said}", field=where
            )
        if student is None:
            student = student_vocabulary(config)
        mine = _vocabulary(path)
        if mine != student:
            raise InvalidInput(
                f"teacher {teacher.name!r} has vocabulary {mine[0]} ({mine[1]} tokenizer) but "
                f"the student has {student[0]} ({student[1]}): a teacher must score the "
                "student's own tokens",
                field=where,
            )


def build_teachers(config: RunConfig, model: PreTrainedModel) -> TeacherManager | None:
    """The run's Teacher Manager (None without teachers), decoding with the student's
    tokenizer. The entry points ran `check_teachers` before anything started."""
    if not config.teachers:
        return None
    decode = None
    if config.distill.route == "turn":
        decode = _decoder(config, model)
    return TeacherManager(
        config.teachers,
        config.distill,
        device=config.trainer.device,
        temperature=config.agent.temperature,
        decode=decode,
    )


def _decoder(config: RunConfig, model: PreTrainedModel) -> Callable[[Sequence[int]], str]:
    from agentflow.modeling import tokenizer_kind
    from agentflow.tokenization import load_tokenizer

    kind = tokenizer_kind(model)
    tokenizer = load_tokenizer("bytes" if kind == "bytes" else config.model.path)
    return lambda ids: tokenizer.decode(ids, skip_special=True)
