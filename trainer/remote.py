"""`agentflow trainer CONFIG --gateway URL [--run ID]`: the split form's trainer.

The gateway executes the run (engines, envs, agents, database); this process leases
trajectories over HTTP, trains, and publishes each version with `disk` sync (a
safetensors directory the gateway's engines load; it must be readable at the same path
there) or `nccl` sync (a broadcast to the run's SGLang engines over a process group they
join through the gateway: trainer/broadcast_sync.py). The loop, checkpoints and
acknowledgement rules are the embedded ones.

What this process form cannot do is refused before anything starts, naming the field:
`inprocess` sync, an NCCL broadcast from a CPU trainer, the warm start (the gateway
builds its engine from `model`, so run `agentflow sft` first and point `model.path` at
its output), a CUDA device this machine lacks, and a config that disagrees with the
run's on what both sides use (the starting model, the sampling temperature the log-probs
are taken at, the group size, the batch the gateway's staleness gate admits episodes for).

Every call to the gateway goes through a `RetryingTransport`: a gateway that restarts
within the retry window (`trainer.gateway.retry_window_s`, or `--retry-window-s`) costs
this process waits, not its state; one that stays away ends it with `GatewayUnavailable`.
Each attempt has a deadline shorter than the window (`trainer.gateway`), so a gateway
that hangs is retried like one that died. docs/training.md ("When the gateway goes
away") says why each call is safe to send again.

Without a run id the trainer trains the newest open run named like its config, or creates
one (`find_or_create_run`): a trainer that restarts (a container restarted on failure)
takes up the same run rather than starting a second.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from agentflow.api.schemas.runs import RunPublic
from agentflow.client import (
    RETRY_STATUSES,
    AsyncClient,
    GatewayUnavailable,
    RetryingTransport,
    RetryPolicy,
    send_buffered,
)
from agentflow.errors import AgentFlowError, InvalidInput
from agentflow.inference.base import WeightUpdate
from agentflow.rollout.stream import HttpTrajectoryStream
from agentflow.run_config import GatewayCallsConfig, RunConfig, check_device
from trainer import ranks
from trainer.backends.base import Policy
from trainer.broadcast_sync import BroadcastPublisher, broadcast_settings, tied_names
from trainer.loggers import build_loggers
from trainer.loop import resume, summarize_batch, train
from trainer.report import RunReport
from trainer.setup import build_policy, loop_settings
from trainer.teachers import build_teachers, check_teachers
from trainer.weights import GatewayWeightTarget, Publisher, WeightPublisher, WeightSyncError

# What the gateway's run and this trainer both use, so must agree on (the model's seed only
# matters when it is built from `model.init`).
_SHARED: tuple[tuple[str, ...], ...] = (
    ("model",),
    ("seed",),
    ("agent", "temperature"),
    ("rollout", "group_size"),
    ("trainer", "batch_episodes"),
)

log = logging.getLogger(__name__)

# The runs a trainer started without `--run` takes up again. `pending` too, once it has
# started: a run is pending while the gateway builds its engine, which is when a trainer
# killed during its `POST /v1/runs` comes back. A run that ended (stopped, finished,
# failed) is not trained again: a new one is created.
OPEN_RUN_STATUSES = ("pending", "running", "paused")
# `POST /v1/runs` answers once the run's engine is built, which may load a large model;
# also how long a pending run may take to start.
_CREATE_TIMEOUT_S = 1800.0
_PENDING_POLL_S = 2.0


def train_remote(
    config: RunConfig,
    gateway: str,
    run_id: uuid.UUID | None = None,
    *,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Train run `run_id` of `gateway`; its calls are retried and timed out as
    `config.trainer.gateway` says. Without `run_id`, the run is `find_or_create_run`'s,
    named on stderr."""
    check_split_form(config)
    if config.trainer.threads:
        import torch

        torch.set_num_threads(config.trainer.threads)
    if not ranks.in_ranks():
        if ranks.needs_ranks(config):
            raise InvalidInput(
                "this config trains under torchrun (trainer.ranks > 1, or the Megatron "
                "backend): run it with `agentflow trainer`, which starts torchrun",
                field=("trainer", "ranks"),
            )
        return asyncio.run(_train(config, gateway.rstrip("/"), run_id, api_key))
    # One of `trainer.ranks` torchrun processes (trainer/ranks.py): rank 0 trains the run,
    # the others follow its commands and never call the gateway.
    import torch.distributed as dist

    device = ranks.join(config.trainer.device, config.trainer.ranks)
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"device": device})}
    )
    try:
        if dist.get_rank() != 0:
            return {"rank": dist.get_rank(), "steps": ranks.follow(build_policy(config))}
        return asyncio.run(_train(config, gateway.rstrip("/"), run_id, api_key))
    finally:
        dist.destroy_process_group()


def gateway_policies(calls: GatewayCallsConfig) -> tuple[RetryPolicy, RetryPolicy]:
    """The retry policies of this trainer's calls to the gateway: one for every call but
    the weights calls, and one for those, whose attempts get `publish_timeout_s` (the
    gateway answers once its engines have loaded the version). One window for both."""
    return (
        RetryPolicy(window_s=calls.retry_window_s, attempt_timeout_s=calls.attempt_timeout_s),
        RetryPolicy(window_s=calls.retry_window_s, attempt_timeout_s=calls.publish_timeout_s),
    )


def check_split_form(config: RunConfig) -> None:
    """Refuse, naming the field, what a trainer in its own process cannot do."""
    if config.weights.sync not in ("disk", "nccl"):
        raise InvalidInput(
            "a trainer in its own process publishes with disk or nccl sync, not "
            f"{config.weights.sync!r}",
            field=("weights", "sync"),
        )
    if (
        config.weights.sync == "nccl"
        and config.weights.broadcast.backend == "nccl"
        and not config.trainer.device.startswith("cuda")
    ):
        raise InvalidInput(
            "the nccl backend broadcasts CUDA tensors and this trainer's device is "
            f"{config.trainer.device!r}: train on a CUDA device, or broadcast with gloo",
            field=("weights", "broadcast", "backend"),
        )
    if config.warm_start.enabled:
        raise InvalidInput(
            "the split trainer does not run the warm start (the gateway's engine starts from "
            "`model`): run `agentflow sft CONFIG` first and set model.path to its output",
            field=("warm_start", "enabled"),
        )
    check_device(config.trainer.device, ("trainer", "device"))
    if config.trainer.backend == "megatron":
        from trainer.backends.megatron.policy import require_cuda

        require_cuda()
    check_teachers(config)


def check_same_run(config: RunConfig, stored: dict[str, Any], run_id: uuid.UUID) -> None:
    """This trainer's config must agree with the run's on what both sides use."""
    mine = config.model_dump(mode="json")
    for path in _SHARED:
        if path == ("seed",) and config.model.path:
            continue
        here, there = _at(mine, path), _at(stored, path)
        if there is not None and here != there:
            raise InvalidInput(
                f"{here!r} here but {there!r} in run {run_id}'s config on the gateway; "
                "the trainer must agree with the run it trains",
                field=path,
            )


def _at(document: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = document
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


async def find_or_create_run(
    config: RunConfig,
    gateway: str,
    *,
    api_key: str | None = None,
    retry: RetryPolicy | None = None,
    pending_wait_s: float = _CREATE_TIMEOUT_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[RunPublic, bool]:
    """The run named `config.name` to train, and whether it was created here.

    The newest run of that name that is running or paused, or pending and then starts
    within `pending_wait_s`; else a new run created from `config`. A run that ended is
    never taken up. The lookups are retried like every call; the create is not resent
    blind (`_create_run`). `transport`: the connection to the gateway under both (tests
    put faults there).
    """
    policy = retry or RetryPolicy()
    retrying = RetryingTransport(policy, transport)
    async with (
        AsyncClient(gateway, api_key=api_key, transport=retrying) as api,
        AsyncClient(
            gateway, api_key=api_key, timeout_s=_CREATE_TIMEOUT_S, transport=_SendOnce(transport)
        ) as once,
    ):
        never_started = False
        while True:
            found = await _newest_open_run(api, config.name, pending=not never_started)
            if found is None:
                created = await _create_run(api, once, config, policy, pending_wait_s, gateway)
                return created, True
            if found.status != "pending":
                return found, False
            started = await _started(api, found, pending_wait_s)
            if started.status == "pending":
                # Nothing starts a run left pending (a gateway that died while building its
                # engine, or `?start=false`): waiting longer would wait forever.
                log.warning(
                    "run %s is still pending after %g s; not taking it up", found.id, pending_wait_s
                )
                never_started = True
            elif started.status in OPEN_RUN_STATUSES:
                return started, False
            # It ended while starting: look again, which skips it.


async def _create_run(
    api: AsyncClient,
    once: AsyncClient,
    config: RunConfig,
    policy: RetryPolicy,
    pending_wait_s: float,
    gateway: str,
) -> RunPublic:
    """`POST /v1/runs`, never resent blind.

    When the create gets no usable answer (none, or a 502/503/504), the gateway may have
    stored the run anyway, so the runs of that name are read first: a new one is taken
    (once it has started), one that ended is an error naming its status and error, and
    only when there is none is the create sent again, within `policy`'s window.
    """
    before = await _newest_run(api, config.name)
    first_failure: float | None = None
    attempt = 0
    while True:
        attempt += 1
        try:
            return await once.create_run(config)
        except _NoAnswer as exc:
            unanswered = exc
        newest = await _newest_run(api, config.name)
        if newest is not None and (before is None or newest.id != before.id):
            # Stored by the create whose answer was lost.
            newest = await _started(api, newest, pending_wait_s)
            if newest.status in ("running", "paused"):
                return newest
            said = f": {newest.error}" if newest.error else ""
            if newest.status == "pending":
                said = f" after {pending_wait_s:g} s"
            raise AgentFlowError(
                f"run {newest.id} ({config.name!r}) was created but is {newest.status}{said}"
            )
        now = time.monotonic()
        first_failure = now if first_failure is None else first_failure
        left = first_failure + policy.window_s - now
        if left <= 0:
            raise GatewayUnavailable(
                f"the gateway at {gateway} did not answer for {policy.window_s:g} s "
                f"(POST /v1/runs, {attempt} attempts; last error: {unanswered})"
            )
        # Full jitter, as `RetryingTransport` waits between its own retries.
        cap = min(policy.max_wait_s, policy.first_wait_s * 2 ** (attempt - 1))
        wait = min(random.uniform(0, cap), left)
        log.warning(
            "POST /v1/runs failed (attempt %d): %s; no run was stored, creating it again in %.1f s",
            attempt,
            unanswered,
            wait,
        )
        await asyncio.sleep(wait)


async def _started(api: AsyncClient, run: RunPublic, wait_s: float) -> RunPublic:
    """`run` once it is no longer pending (its engine built, or failed), or as it is
    after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    if run.status == "pending":
        log.warning("run %s is pending (its engine is being built); waiting for it", run.id)
    while run.status == "pending" and time.monotonic() < deadline:
        await asyncio.sleep(min(_PENDING_POLL_S, max(0.0, deadline - time.monotonic())))
        run = await api.get_run(run.id)
    return run


async def _newest_open_run(api: AsyncClient, name: str, *, pending: bool) -> RunPublic | None:
    # One query per status: each answers its newest run, however many ended runs share
    # the name.
    statuses = OPEN_RUN_STATUSES if pending else ("running", "paused")
    candidates = [
        page.items[0]
        for status in statuses
        if (page := await api.list_runs(status=status, name=name, limit=1)).items
    ]
    return max(candidates, key=lambda run: run.created_at, default=None)


async def _newest_run(api: AsyncClient, name: str) -> RunPublic | None:
    page = await api.list_runs(name=name, limit=1)
    return page.items[0] if page.items else None


class _NoAnswer(Exception):
    """A request that got no usable answer: it may or may not have been carried out."""


class _SendOnce(httpx.AsyncBaseTransport):
    """Sends a request once; what `RetryingTransport` would retry is raised as `_NoAnswer`
    (transport errors, a body cut short, 502/503/504), any other answer is returned."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._inner = transport or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response, body = await send_buffered(self._inner, request)
        except httpx.TransportError as exc:
            # All of them, not only the transient ones `RetryingTransport` retries: the
            # lookups before this call reach the same URL, so a mistake of this side
            # (a bad scheme, a proxy) has already failed there.
            said = str(exc).rstrip(".")
            described = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
            raise _NoAnswer(described) from exc
        if response.status_code in RETRY_STATUSES:
            text = body[:300].decode(errors="replace")
            raise _NoAnswer(f"HTTP {response.status_code}: {text}")
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class RepeatablePublish:
    """A `GatewayWeightTarget` whose publish may be sent twice.

    The gateway refuses a version it already serves (not newer; a duplicate row), so a
    publish resent because its answer was lost would fail although it went through.
    When a publish is refused, the run's recorded versions decide: this very version at
    this very directory means it is live.
    """

    def __init__(self, target: GatewayWeightTarget, http: httpx.AsyncClient, run_id: str):
        """`http`: a client of the same gateway (its base URL and key) for the check."""
        self.target = target
        self.name = target.name
        self._http = http
        self._run_id = run_id
        self.gave_up: GatewayUnavailable | None = None  # why the last publish failed

    async def update_weights(self, update: WeightUpdate) -> int:
        try:
            return await self.target.update_weights(update)
        except GatewayUnavailable as exc:  # the publisher reports it inside a WeightSyncError
            self.gave_up = exc
            raise
        except AgentFlowError:
            if update.version is not None and await self._recorded(update):
                return update.version
            raise

    async def _recorded(self, update: WeightUpdate) -> bool:
        try:
            response = await self._http.get(f"/v1/runs/{self._run_id}/metrics")
        except GatewayUnavailable as exc:
            self.gave_up = exc
            raise
        if response.is_error:
            return False
        return any(
            v["version"] == update.version and v["uri"] == update.path
            for v in response.json()["versions"]
        )


async def _train(
    config: RunConfig,
    gateway: str,
    run_id: uuid.UUID | None,
    api_key: str | None,
) -> dict[str, Any]:
    directory = Path(config.trainer.run_dir) / config.name
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    calls = config.trainer.gateway
    retry, publishes = gateway_policies(calls)
    by_name = run_id is None
    if run_id is None:
        chosen, created = await find_or_create_run(config, gateway, api_key=api_key, retry=retry)
        run_id = chosen.id
        how = "created" if created else f"resumed ({chosen.status})"
        print(f"trainer: run {run_id} {how}, named {config.name!r}", file=sys.stderr, flush=True)
    # The clients' own (per read, per write) timeouts are the attempts' deadlines too: the
    # transport's deadline on the whole attempt is the one that counts.
    api = AsyncClient(
        gateway,
        api_key=api_key,
        timeout_s=calls.attempt_timeout_s,
        transport=RetryingTransport(retry),
    )
    async with api:
        run = await api.get_run(run_id)  # NotFound, Unauthorized: named errors
        try:
            check_same_run(config, run.config, run_id)
        except InvalidInput as exc:
            if not by_name:
                raise
            raise InvalidInput(
                f"{exc.message}; run {run_id} is the newest open run named {config.name!r}: "
                "stop it (`agentflow runs control ID stop`) or give this config another name",
                field=exc.field,
            ) from None
        async with httpx.AsyncClient(
            base_url=gateway,
            headers=headers,
            timeout=calls.attempt_timeout_s,
            transport=RetryingTransport(retry),
        ) as client:
            return await _train_run(
                config, gateway, api_key, run, api, client, publishes, directory
            )


async def _train_run(
    config: RunConfig,
    gateway: str,
    api_key: str | None,
    run: RunPublic,
    api: AsyncClient,
    client: httpx.AsyncClient,
    publishes: RetryPolicy,
    directory: Path,
) -> dict[str, Any]:
    """`api`, `client`: the gateway's, for every call but the weights calls."""
    run_id = run.id
    document = config.model_dump(mode="json")
    report = RunReport(
        directory,
        config.trainer.steps,
        loggers=build_loggers(config.logger, directory, config.name, document),
    )
    stream = HttpTrajectoryStream(client, run_id)
    local = build_policy(config)
    leader = ranks.LeaderPolicy(local) if ranks.in_ranks() else None
    # The leader answers the local policy's calls, making them on every rank.
    policy: Policy = leader if leader is not None else local
    checkpoints = directory / "checkpoints"
    state, restored = await resume(policy, stream, checkpoints)
    # The steps after the checkpoint are done again, each writing its row anew; the
    # checkpointed ones whose row the gateway lacks (a post that failed) are sent again.
    report.keep_through(state.step)
    await resend_missing_metrics(api, run_id, report)
    weights_api = AsyncClient(
        gateway,
        api_key=api_key,
        timeout_s=config.trainer.gateway.publish_timeout_s,
        transport=RetryingTransport(publishes),
    )
    target = GatewayWeightTarget(gateway, run_id, client=weights_api)
    published = RepeatablePublish(target, client, str(run_id))
    publisher: Publisher
    if config.weights.sync == "nccl":
        # Not repeatable: a broadcast the engines missed cannot be asked for again.
        publisher = BroadcastPublisher(
            [target], broadcast_settings(config), skip=tied_names(policy.model.config)
        )
    else:
        weights_dir = Path(config.weights.dir) if config.weights.dir else directory / "weights"
        publisher = WeightPublisher(
            "disk",
            [published],
            weights_dir.resolve(),
            config=policy.model.config,
            untied_head=config.engine.type == "vllm",
        )

    async def on_step(step: int, metrics: dict[str, float], batch: Any) -> None:
        row = {**summarize_batch(batch, state.version - 1), **metrics}
        ids = [str(t.id) for t in batch]
        # On disk first: the checkpoint that follows counts on it (trainer.loop).
        report.record(step, row, version=state.version, trajectory_ids=ids)
        await _post_metrics(api, run_id, step, state.version, row)

    async def on_error(step: int, message: str) -> None:
        report.error(step, message)

    settings = loop_settings(config, checkpoints)
    # A lease waits on the gateway for data at most half an attempt's deadline, so an
    # idle run's long poll is never taken for a hung gateway.
    settings.pull_timeout_s = min(
        settings.pull_timeout_s, config.trainer.gateway.attempt_timeout_s / 2
    )
    teachers = build_teachers(config, policy.model)
    try:
        if restored is not None:
            state.version = max(state.version, run.weight_version) + 1
            await publisher.publish(policy.state_dict(), state.version)
        else:
            state.version = run.weight_version
        await train(
            policy,
            stream,
            publisher,
            settings,
            state,
            on_step=on_step,
            teachers=teachers,
            on_error=on_error,
        )
    except WeightSyncError:
        if published.gave_up is not None:  # one line, not the publisher's wrapping
            raise published.gave_up from None
        raise
    finally:
        if leader is not None:
            leader.stop()
        report.close()
        if isinstance(publisher, BroadcastPublisher):
            publisher.close()
        await weights_api.aclose()
        if teachers is not None:
            await teachers.close()
    return report.finish({"run": config.name, "run_id": str(run_id), "gateway": gateway})


# What a row of metrics.jsonl holds besides the step's metrics.
_ROW_FIELDS = ("step", "version", "time", "trajectory_ids")


async def _post_metrics(
    api: AsyncClient, run_id: uuid.UUID, step: int, version: int, row: dict[str, Any]
) -> bool:
    """Send step `step`'s metrics to the gateway, which stores and exports them; the run
    does not depend on it, so a failure is a warning (and the next start sends it again:
    `resend_missing_metrics`)."""
    finite = {
        k: float(v)
        for k, v in row.items()
        if k not in _ROW_FIELDS and isinstance(v, int | float) and math.isfinite(float(v))
    }
    try:
        await api.record_metrics(run_id, version, finite, step=step)
    except AgentFlowError as exc:
        log.warning("step %d: the gateway did not take its metrics: %s", step, exc)
        return False
    return True


async def resend_missing_metrics(api: AsyncClient, run_id: uuid.UUID, report: RunReport) -> int:
    """Send again the rows of `report` whose step the gateway holds no metrics for (their
    post failed, or the gateway lost them); returns how many were sent."""
    rows = [r for r in report.rows() if "version" in r]  # older rows name no version
    if not rows:
        return 0
    recorded = await api.run_metrics(run_id)
    have = {v["step"] for v in recorded["versions"] if v.get("step") is not None}
    sent = 0
    for row in rows:
        step = int(row["step"])
        if step not in have:
            sent += await _post_metrics(api, run_id, step, int(row["version"]), row)
    if sent:
        log.warning("sent the metrics of %d checkpointed step(s) the gateway lacked", sent)
    return sent
