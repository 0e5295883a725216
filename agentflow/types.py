"""Shared value types of the turn-tree data model (docs/architecture.md, "Data model"),
free of any database or web code.

A `TurnRecord` is what a rollout hands the store: one segment of tokens appended to its
parent's context. It validates itself on construction, so an invalid record never exists.
`NewTurn` places a record in a tree (episode, parent, id) for batch writes.
What the store hands back:

    StoredTurn      one persisted turn (flat)
     └── TurnNode   the same, with its children: a node of an `EpisodeTree`
    EpisodeInfo     an episode's row
     └── EpisodeTree   the same, with its turn forest and its trajectories (`TrajectoryRef`)
    Context         the full token context of a turn: the segments root → turn, concatenated
    Trajectory      a completed path (root → leaf) with its reward, ready for the trainer

Per-token conventions in a `Context` / `Trajectory`, for tokens of non-policy turns
(prompt, env, tool), which the model did not sample:
    logprob 0.0 (a NaN-free placeholder: sums and JSON stay valid; the loss mask is 0 there),
    weight version -1 (`NO_VERSION`), loss mask 0.
Log-probs are kept at float32 precision: a stored value comes back as `float(np.float32(x))`.

All types are frozen dataclasses of plain values (tuples, dicts, UUIDs, datetimes), so the
API can serialize them directly and they are safe to share between tasks.
"""

from __future__ import annotations

import array
import math
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, cast, get_args

import numpy as np

from agentflow import ids
from agentflow.errors import InvalidInput
from agentflow.images import check_image, is_blob_id

TurnKind = Literal["prompt", "policy", "env", "tool"]
TURN_KINDS: frozenset[str] = frozenset(get_args(TurnKind))

EpisodeStatus = Literal["pending", "running", "completed", "truncated", "failed", "aborted"]
OPEN_EPISODE_STATUSES: frozenset[str] = frozenset({"pending", "running"})
FINAL_EPISODE_STATUSES: frozenset[str] = frozenset({"completed", "truncated", "failed", "aborted"})
# Only these produce trajectories; a failed or aborted episode is never trained on.
TRAINABLE_EPISODE_STATUSES: frozenset[str] = frozenset({"completed", "truncated"})

# ready: servable (fresh, or replayable while times_served < max_reuse); leased: out to a
# trainer; consumed: served max_reuse times; stale: past the staleness bound, dropped;
# rejected: the trainer refused it (its error is recorded).
TrajectoryStatus = Literal["ready", "leased", "consumed", "stale", "rejected"]

NO_VERSION = -1  # weight version of a token the policy did not sample
NON_POLICY_LOGPROB = 0.0  # placeholder log-prob of such a token (its loss mask is 0)

_INT32_MAX = 2**31 - 1
_MAX_FINISH_REASON = 16  # the column width


# Python floats at or past this round to infinity as float32, the stored width.
FLOAT32_OVERFLOW = 3.4028235677973366e38
_HALF_FLOAT32_OVERFLOW = FLOAT32_OVERFLOW / 2
_FLOAT_ONLY = frozenset({float})
# Where a uint32's most significant byte sits in `array("I").tobytes()` ("I" is 4 bytes on
# every platform CPython supports).
_U32_TOP_BYTE = 3 if sys.byteorder == "little" else 0


def _ints(values: Sequence[int], name: str) -> tuple[int, ...]:
    """`values` as a tuple of plain ints in [0, INT32_MAX]. A list or tuple (what engines
    and templates produce) is checked at C speed: this runs several times per turn."""
    if isinstance(values, list | tuple):
        try:
            # Raises for non-integers, negatives and values past 2**32 - 1; int-likes (bool,
            # numpy integers) pass and come back from `tolist` as plain ints.
            arr = array.array("I", values)
        except (TypeError, ValueError, OverflowError):
            pass  # refused: the general path below names the problem
        else:
            # A uint32 is past INT32_MAX exactly when its top bit is set, i.e. when its most
            # significant byte is not ASCII: one C pass instead of a Python max().
            if not arr.tobytes()[_U32_TOP_BYTE::4].isascii():
                raise InvalidInput(f"{name} must lie in [0, {_INT32_MAX}]", field=name)
            return tuple(arr.tolist())
    if isinstance(values, list | tuple) and all(type(v) is int for v in values):
        out = tuple(values)  # the array refused them: out of range (numpy may not hold them)
    else:
        try:
            arr_np = np.asarray(values)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"{name} must be a flat list of integers", field=name) from exc
        if arr_np.ndim != 1 or (arr_np.size and arr_np.dtype.kind not in "iu"):
            raise InvalidInput(f"{name} must be a flat list of integers", field=name)
        out = tuple(arr_np.tolist())
    if out and (min(out) < 0 or max(out) > _INT32_MAX):
        raise InvalidInput(f"{name} must lie in [0, {_INT32_MAX}]", field=name)
    return out


def _floats(values: Sequence[float], name: str) -> tuple[float, ...]:
    """`values` as a tuple of floats that are finite in float32 (the stored width)."""
    if isinstance(values, list | tuple) and set(map(type, values)) <= _FLOAT_ONLY:
        out = tuple(values)
    else:
        try:
            arr = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"{name} must be a flat list of numbers", field=name) from exc
        if arr.ndim != 1:
            raise InvalidInput(f"{name} must be a flat list of numbers", field=name)
        out = tuple(arr.tolist())
    # hypot is one C pass and at least every |v| (NaN or inf when some v is), so far below
    # the limit it settles the check; otherwise each value is checked. NaN fails both
    # comparisons; a value that overflows float32 is as bad as a NaN.
    if not (
        math.hypot(*out) < _HALF_FLOAT32_OVERFLOW
        or all(-FLOAT32_OVERFLOW < v < FLOAT32_OVERFLOW for v in out)
    ):
        raise InvalidInput(f"{name} must be finite float32 values", field=name)
    return out


def _check_length(name: str, got: int, want: int) -> None:
    if got != want:
        raise InvalidInput(f"{name} has {got} entries but the turn has {want} tokens", field=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRecord:
    """One segment appended to the parent's context, exactly as the engine or env produced it.

    Policy turns carry one log-prob and one weight version per token; other kinds carry
    neither. `loss_mask` defaults to all 1 for policy turns and all 0 otherwise; a 1 is
    only allowed where there is a log-prob (a policy token). Sequences are normalized to
    tuples of Python ints/floats.

    `images` (non-policy turns) are what the turn showed besides its tokens, in order: an
    env observation's screenshot, a chat request's image parts. Each is PNG or JPEG bytes,
    or the id of a blob already stored; they are stored once each as blobs and the turn
    links to them, never holding the bytes in its row.
    """

    kind: TurnKind
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    weight_versions: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None
    text: str | None = None
    reward: float | None = None
    finish_reason: str | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    images: tuple[bytes | str, ...] = ()

    def __post_init__(self) -> None:
        self._settle(_ints, _floats)

    def _settle(
        self,
        ints: Callable[[Sequence[int], str], tuple[int, ...]],
        floats: Callable[[Sequence[float], str], tuple[float, ...]],
    ) -> None:
        """Check the record and normalize it in place, token arrays through `ints` and
        `floats` (`_ints` and `_floats`, or `_as_checked` for arrays checked upstream)."""
        if self.kind not in TURN_KINDS:
            raise InvalidInput(
                f"kind must be one of {sorted(TURN_KINDS)}, got {self.kind!r}", field="kind"
            )
        tokens = ints(self.token_ids, "token_ids")
        n = len(tokens)
        set_ = object.__setattr__  # frozen: normalize once, here
        set_(self, "token_ids", tokens)

        if self.kind == "policy":
            if self.logprobs is None or self.weight_versions is None:
                raise InvalidInput(
                    "a policy turn needs logprobs and weight_versions",
                    field="logprobs" if self.logprobs is None else "weight_versions",
                )
            lp = floats(self.logprobs, "logprobs")
            _check_length("logprobs", len(lp), n)
            versions = ints(self.weight_versions, "weight_versions")
            _check_length("weight_versions", len(versions), n)
            set_(self, "logprobs", lp)
            set_(self, "weight_versions", versions)
        else:
            for name in ("logprobs", "weight_versions"):
                if getattr(self, name) is not None:
                    raise InvalidInput(f"only policy turns carry {name}", field=name)

        if self.loss_mask is None:
            set_(self, "loss_mask", (1 if self.kind == "policy" else 0,) * n)
        else:
            mask = _ints(self.loss_mask, "loss_mask")
            _check_length("loss_mask", len(mask), n)
            if mask and max(mask) > 1:
                raise InvalidInput("loss_mask entries must be 0 or 1", field="loss_mask")
            if self.kind != "policy" and any(mask):
                raise InvalidInput(
                    "loss_mask may be 1 only on policy tokens (they alone have log-probs)",
                    field="loss_mask",
                )
            set_(self, "loss_mask", mask)

        if self.text is not None and "\x00" in self.text:
            # PostgreSQL text cannot hold NUL; refuse it everywhere so both stores agree.
            raise InvalidInput("text must not contain NUL characters", field="text")
        if self.reward is not None and not math.isfinite(self.reward):
            raise InvalidInput("reward must be finite", field="reward")
        if self.finish_reason is not None and not (
            0 < len(self.finish_reason) <= _MAX_FINISH_REASON
        ):
            raise InvalidInput(
                f"finish_reason must have 1-{_MAX_FINISH_REASON} characters", field="finish_reason"
            )
        for key, value in self.timings.items():
            if not isinstance(key, str) or isinstance(value, bool):
                raise InvalidInput("timings maps names to seconds", field="timings")
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise InvalidInput(f"timing {key!r} must be finite seconds >= 0", field="timings")
        set_(self, "timings", dict(self.timings))
        set_(self, "images", _images(self.images, self.kind))

    @classmethod
    def checked_upstream(
        cls,
        kind: TurnKind,
        token_ids: tuple[int, ...],
        *,
        logprobs: tuple[float, ...] | None = None,
        weight_versions: tuple[int, ...] | None = None,
        reward: float | None = None,
        finish_reason: str | None = None,
        timings: Mapping[str, float],
        images: tuple[bytes | str, ...] = (),
    ) -> TurnRecord:
        """A record of tokens already checked where they came in: an engine's answer
        (`GenerateResult` refuses what `_ints` and `_floats` would) or the chat template's
        own ids, as tuples of plain ints and floats. The episode loop records two a turn,
        and checking each token again cost a few microseconds each; every other check
        (lengths, reward, timings, images) is made as for any record."""
        record = object.__new__(cls)
        set_ = object.__setattr__
        set_(record, "kind", kind)
        set_(record, "token_ids", token_ids)
        set_(record, "logprobs", logprobs)
        set_(record, "weight_versions", weight_versions)
        set_(record, "loss_mask", None)
        set_(record, "text", None)
        set_(record, "reward", reward)
        set_(record, "finish_reason", finish_reason)
        set_(record, "timings", timings)
        set_(record, "images", images)
        record._settle(_as_checked, _as_checked)
        return record


def _as_checked(values: Sequence[Any], name: str) -> tuple[Any, ...]:
    """A token array checked upstream (`TurnRecord.checked_upstream`, which takes only
    tuples), taken as it is."""
    return cast(tuple[Any, ...], values)


def _images(images: Sequence[bytes | str], kind: str) -> tuple[bytes | str, ...]:
    if not images:
        return ()
    if kind == "policy":
        raise InvalidInput("policy turns carry no images", field="images")
    out: list[bytes | str] = []
    for index, image in enumerate(images):
        where = ("images", str(index))
        if isinstance(image, bytes | bytearray | memoryview):
            image = bytes(image)
            check_image(image, where)
        elif not is_blob_id(image):
            raise InvalidInput("an image is PNG/JPEG bytes or a blob id (sha256 hex)", field=where)
        out.append(image)
    return tuple(out)


Segment = TurnRecord  # the docs speak of a turn's "segment"; both names mean this type


@dataclass(frozen=True, slots=True, kw_only=True)
class NewTurn:
    """A turn to write with `TurnTree.add_turns`; `id` is chosen here so that children in the
    same batch can name their parent before anything reaches the database."""

    episode_id: uuid.UUID
    parent_id: uuid.UUID | None
    record: TurnRecord
    id: uuid.UUID = field(default_factory=ids.new_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredTurn:
    """A persisted turn. `logprobs`/`weight_versions` are None for non-policy turns."""

    id: uuid.UUID
    episode_id: uuid.UUID
    parent_id: uuid.UUID | None
    depth: int  # 0 for a root
    kind: TurnKind
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    weight_versions: tuple[int, ...] | None
    loss_mask: tuple[int, ...]
    text: str | None
    reward: float | None
    finish_reason: str | None
    timings: dict[str, Any]
    created_at: datetime
    images: tuple[str, ...] = ()  # blob ids, in order (`GET /v1/blobs/{id}`)

    def record(self) -> TurnRecord:
        """The segment as it was written."""
        return TurnRecord(
            kind=self.kind,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            weight_versions=self.weight_versions,
            loss_mask=self.loss_mask,
            text=self.text,
            reward=self.reward,
            finish_reason=self.finish_reason,
            timings=self.timings,
            images=self.images,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnNode(StoredTurn):
    """A turn with its children (branches), oldest first."""

    children: tuple[TurnNode, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryRef:
    """A trajectory as listed under its episode (tokens left out)."""

    id: uuid.UUID
    leaf_turn_id: uuid.UUID
    reward: float | None
    status: TrajectoryStatus
    min_weight_version: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeInfo:
    id: uuid.UUID
    run_id: uuid.UUID | None
    environment_id: uuid.UUID | None
    env_ref: str
    task: dict[str, Any]
    group_id: str | None
    status: EpisodeStatus
    reward: float | None
    error: str | None
    created_at: datetime
    finished_at: datetime | None
    # The oldest and newest weight versions its tokens were sampled with (set when it
    # finishes; None while live or without policy tokens).
    min_weight_version: int | None = None
    max_weight_version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeTree(EpisodeInfo):
    """An episode with its whole turn forest (usually one root: the prompt)."""

    roots: tuple[TurnNode, ...]
    trajectories: tuple[TrajectoryRef, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """Everything on the path root → turn, concatenated; one entry per token.

    `turn_ids[i]`'s segment starts at token `turn_starts[i]`. Non-policy tokens have
    logprob 0.0, weight version -1 and loss mask 0 (see the module docstring).
    """

    turn_ids: tuple[uuid.UUID, ...]
    turn_starts: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    weight_versions: tuple[int, ...]

    @property
    def min_weight_version(self) -> int | None:
        """The oldest weight version that produced a token here; None without policy tokens."""
        sampled = [v for v in self.weight_versions if v != NO_VERSION]
        return min(sampled) if sampled else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    """A completed root → leaf path with its reward, exactly as the engine saw and produced it."""

    id: uuid.UUID
    run_id: uuid.UUID | None
    episode_id: uuid.UUID
    group_id: str | None
    leaf_turn_id: uuid.UUID
    reward: float | None
    status: TrajectoryStatus
    times_served: int
    min_weight_version: int | None
    created_at: datetime
    turn_ids: tuple[uuid.UUID, ...]
    turn_starts: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    weight_versions: tuple[int, ...]
    lease_id: str | None = None  # the lease it was served under (acknowledge with it)
    loss_weight: float = 1.0  # < 1 when served past the staleness bound (`downweight`)
    env_ref: str = ""  # the episode's env (registry id or name): teachers are routed by it
    turn_rewards: tuple[float, ...] = ()  # each turn's own reward (env turns: its step's)

    def staleness(self, current_version: int) -> int | None:
        """`current_version - min(token versions)` (docs/architecture.md, "Asynchrony and
        staleness"); None without policy tokens."""
        if self.min_weight_version is None:
            return None
        return current_version - self.min_weight_version
