"""Every integer field of every route, at and past the edges of 32 and 64 bits, on SQLite
and PostgreSQL alike (`agentflow.integers`; docs/decisions.md, "Text and numbers the
database can hold").

The fields come from the app's OpenAPI schema, and for the OpenAI-compatible routes, which
parse their own bodies, from their request models: a new route or field is driven with no
change here. For each value sent: never a 5xx; a value outside the field's declared range
is refused with a 422 naming the field (OpenAI's 400 with `param` naming it, on the agents'
routes); a value accepted reads back as the integer sent. The declared ranges lie within 64
bits, and the runs on PostgreSQL show that a field stored in, or compared with, a 32-bit
column is declared within 32 bits: PostgreSQL refuses a wider value at the write (a 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from sqlalchemy.exc import SQLAlchemyError

from agentflow.agents.blackbox.openai_schema import ChatCompletionRequest
from agentflow.agents.blackbox.responses_api import ResponsesRequest
from agentflow.agents.keys import episode_key
from agentflow.api.app import create_app
from agentflow.api.routing import GatewayRoute
from agentflow.config import Settings
from agentflow.integers import INT32_MAX, INT64_MAX, INT64_MIN
from tests.integration.api.test_hostile_input import api_routes

pytestmark = pytest.mark.integration

Loc = tuple[str | int, ...]
Tags = tuple[tuple[Loc, str], ...]  # a union's tag to set, and where

ENV = "tests.integration.rollout.scripted_envs:SlowEnv"
TINY_INIT = {"layers": 1, "hidden": 16, "heads": 2, "max_context": 128}
RUN = {"model": {"init": TINY_INIT}, "envs": [{"id": "agentflow/guess-number-v0"}]}
METRICS = ("POST", "/v1/runs/{run_id}/metrics")

# The edges of 32 and 64 bits, either side, and past both; integral floats (the first at
# 2**31, the second what a trainer sent as a weight version) and one with a fraction;
# booleans, which pydantic reads as 1 and 0.
EDGES: tuple[int | float, ...] = (
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    10**30,
    2.0**31,
    40234300348437.0,
    1.5,
    True,
    False,
)

# The routes that parse their own bodies (to answer in OpenAI's shape), and their models.
SELF_PARSED: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/episodes/{episode_id}/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/episodes/{episode_id}/responses": ResponsesRequest,
}


@dataclass(frozen=True)
class IntField:
    """One integer a route takes: where it goes and the range its schema declares."""

    method: str
    path: str
    where: str  # body, query or path
    loc: Loc  # in the body, or the parameter's name
    low: int | None
    high: int | None
    # The tags of discriminated unions on the way to it (`engine.type`), to set with it.
    tags: Tags = ()
    # Where a 422 puts it: pydantic names a union's branch by its tag (`engine.local.x`).
    error_loc: Loc = ()

    @property
    def route(self) -> tuple[str, str]:
        return self.method, self.path

    @property
    def openai(self) -> bool:
        return self.path in SELF_PARSED

    def takes(self, value: int | float) -> bool:
        """Whether `value` is an integer inside the declared range (no range: any)."""
        number = _integer(value, self.where)
        if number is None:
            return False
        return (self.low is None or self.low <= number) and (
            self.high is None or number <= self.high
        )

    def __str__(self) -> str:
        return f"{self.method} {self.path} {self.where}.{'.'.join(map(str, self.loc))}"


def _exact(bound: float | None) -> int | None:
    """A bound as the integer it stands for. FastAPI's OpenAPI model writes a body's bounds
    as floats, so a 64-bit bound comes out rounded to 2**63; no other bound is that large."""
    if bound is None:
        return None
    if isinstance(bound, float) and abs(bound) >= 2**53:
        exact = INT64_MAX if bound > 0 else INT64_MIN
        assert bound == float(exact), f"a bound of {bound} is past 64 bits"
        return exact
    return int(bound)


def _integers(
    schema: dict[str, Any],
    defs: dict[str, Any],
    loc: Loc,
    tags: Tags = (),
    named: Loc = (),
    seen: frozenset[str] = frozenset(),
) -> Iterator[tuple[Loc, int | None, int | None, Tags, Loc]]:
    """Every integer in a JSON schema: where it is (a list's first item, a map's key `k`),
    its declared bounds, the union tags that lead to it, and where errors name it. A model
    met again inside itself is not walked again (its fields were found the first time)."""
    ref = schema.get("$ref")
    if ref is not None:
        if ref not in seen:
            name = ref.rsplit("/", 1)[1]
            yield from _integers(defs[name], defs, loc, tags, named, seen | {ref})
        return
    if schema.get("type") == "integer":
        low, high = _exact(schema.get("minimum")), _exact(schema.get("maximum"))
        if "exclusiveMinimum" in schema:
            low = int(schema["exclusiveMinimum"]) + 1
        if "exclusiveMaximum" in schema:
            high = int(schema["exclusiveMaximum"]) - 1
        yield loc, low, high, tags, named
    for branch in (*schema.get("anyOf", ()), *schema.get("allOf", ())):
        yield from _integers(branch, defs, loc, tags, named, seen)
    discriminator = schema.get("discriminator")
    by_ref = {r: tag for tag, r in (discriminator or {}).get("mapping", {}).items()}
    for branch in schema.get("oneOf", ()):
        if discriminator is not None and branch.get("$ref") in by_ref:
            tag = by_ref[branch["$ref"]]
            tagged = (*tags, ((*loc, discriminator["propertyName"]), tag))
            yield from _integers(branch, defs, loc, tagged, (*named, tag), seen)
        else:
            yield from _integers(branch, defs, loc, tags, named, seen)
    for name, child in schema.get("properties", {}).items():
        yield from _integers(child, defs, (*loc, name), tags, (*named, name), seen)
    if isinstance(schema.get("items"), dict):
        yield from _integers(schema["items"], defs, (*loc, 0), tags, (*named, 0), seen)
    for i, child in enumerate(schema.get("prefixItems", ())):
        yield from _integers(child, defs, (*loc, i), tags, (*named, i), seen)
    if isinstance(schema.get("additionalProperties"), dict):
        child = schema["additionalProperties"]
        yield from _integers(child, defs, (*loc, "k"), tags, (*named, "k"), seen)


def integer_fields(app: FastAPI) -> list[IntField]:
    """Every integer field of every route: parameters and JSON bodies from the OpenAPI
    schema, and the bodies of the routes that parse their own from their models."""
    spec = app.openapi()
    defs = spec.get("components", {}).get("schemas", {})
    found: list[IntField] = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", ()):
                name = (parameter["name"],)
                for _, low, high, _, _ in _integers(parameter["schema"], defs, ()):
                    where = parameter["in"]
                    found.append(IntField(method.upper(), path, where, name, low, high, (), name))
            content = operation.get("requestBody", {}).get("content", {})
            body = content.get("application/json", {}).get("schema")
            if body is not None:
                for loc, low, high, tags, named in _integers(body, defs, ()):
                    found.append(
                        IntField(method.upper(), path, "body", loc, low, high, tags, named)
                    )
    for path, model in SELF_PARSED.items():
        schema = model.model_json_schema()
        for loc, low, high, tags, named in _integers(schema, schema.get("$defs", {}), ()):
            found.append(IntField("POST", path, "body", loc, low, high, tags, named))
    return found


def test_every_integer_the_api_takes_is_bounded_within_64_bits() -> None:
    app = create_app(Settings(database_url="sqlite+aiosqlite:///unused.db"))
    fields = integer_fields(app)
    assert len(fields) >= 80  # runs' configs alone have over fifty
    unbounded = [str(f) for f in fields if f.low is None or f.high is None]
    assert not unbounded, f"integer fields with no range (agentflow.integers): {unbounded}"
    for f in fields:
        assert f.low is not None and f.high is not None
        assert INT64_MIN <= f.low <= f.high <= INT64_MAX, str(f)
    # The routes that parse their own bodies are the ones listed, so none is left out.
    own = {
        r.path
        for r in api_routes(app)
        if "POST" in r.methods and r.include_in_schema and not isinstance(r, GatewayRoute)
    }
    assert own == set(SELF_PARSED)


# ---- driving every field, on both databases ------------------------------------------


def _integer(value: int | float, where: str) -> int | None:
    """The integer pydantic's lax mode reads `value` as; None: it is not one."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, bool) and where != "body":
        return None  # `true` in a URL is text, not a number
    return int(value)


def _text(value: int | float) -> str:
    """`value` as a path or query parameter: as a JSON number would be written."""
    return json.dumps(value)


def _values(f: IntField, rng: random.Random) -> list[int | float]:
    """The edges, the field's own bounds either side, and one value inside them; in
    increasing order (a weight version must be newer than the last one accepted)."""
    values: list[int | float] = list(EDGES)
    if f.low is not None and f.high is not None:
        values += [f.low - 1, f.low, f.high, f.high + 1, rng.randint(f.low, f.high)]
    unique = {(type(v), v): v for v in values}  # True == 1 == 1.0, but each is sent
    return sorted(unique.values(), key=float)


def _put(body: dict[str, Any], loc: Loc, value: Any) -> None:
    """Set `value` at `loc` in `body`, making the dicts and lists on the way."""
    node: Any = body
    for part, after in itertools.pairwise(loc):
        empty: Any = [] if isinstance(after, int) else {}
        if isinstance(part, int):
            while len(node) <= part:
                node.append(empty)
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    last = loc[-1]
    if isinstance(last, int):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _at(document: Any, loc: Loc) -> Any:
    for part in loc:
        document = document[part]
    return document


NOT_READ = object()  # nowhere to read this field back from


@dataclass
class Gateway:
    """One app on one database, with what its routes need to exist."""

    app: FastAPI
    http: httpx.AsyncClient
    weights: str  # a directory of the live run's model weights, as a trainer publishes one
    env_id: str = ""
    stored_run: str = ""  # made, never started: lists, metrics, the trajectory stream
    live_run: str = ""  # started and paused: weight publishes
    marks: Iterator[int] = field(default_factory=itertools.count)

    async def send(self, values: dict[IntField, int | float]) -> httpx.Response:
        """One request to the route of `values` (one route, one union branch) with each
        field set to its value."""
        f = next(iter(values))
        path = f.path
        for name, known in (("env_id", self.env_id), ("run_id", self.run_for(f))):
            path = path.replace("{" + name + "}", known)
        episode = uuid.uuid4()
        path = path.replace("{episode_id}", str(episode))
        headers = {"content-type": "application/json"}
        if f.openai:
            key = episode_key(episode, self.app.state.settings.secret_key)
            headers["authorization"] = f"Bearer {key}"
        if f.path.startswith("/ui/api/") and f.method != "GET":
            # A dashboard action: from the dashboard's own page, with its token.
            token = (await self.http.get("/ui/api/session")).json()["csrf_token"]
            headers |= {"origin": str(self.http.base_url).rstrip("/"), "x-csrf-token": token}
        params: dict[str, str] = {"start": "false"} if f.route == ("POST", "/v1/runs") else {}
        body = self.base_body(list(values)) if f.method in ("POST", "PATCH", "PUT") else None
        for at, tag in f.tags:
            assert body is not None
            _put(body, at, tag)
        for each, value in values.items():
            if each.where == "path":
                path = path.replace("{" + str(each.loc[0]) + "}", _text(value))
            elif each.where == "query":
                params[str(each.loc[0])] = _text(value)
            else:
                assert body is not None
                _put(body, each.loc, value)
        path = re.sub(r"\{[^}]+\}", str(uuid.uuid4()), path)  # any other id: an unknown one
        content = None if body is None else json.dumps(body).encode()
        return await self.http.request(
            f.method, path, params=params, content=content, headers=headers
        )

    def run_for(self, f: IntField) -> str:
        return self.live_run if "/weights" in f.path else self.stored_run

    def base_body(self, fields: list[IntField]) -> dict[str, Any]:
        """A body the route takes as it is, for the fields to be set in; `{}` for a route
        not known here (a value out of range is still refused naming the field)."""
        f = fields[0]
        route = f.route
        if route == ("POST", "/v1/envs"):
            name = f"ints-{uuid.uuid4().hex[:12]}"
            return {"name": name, "kind": "python", "spec": {"entry_point": ENV, "kwargs": {}}}
        if route == ("POST", "/v1/runs"):
            return json.loads(json.dumps({"name": "ints", **RUN}))
        if route == METRICS:
            # A mark of its own, so the read back shows this request landed on the version.
            return {"metrics": {"mark": float(next(self.marks))}}
        if route == ("POST", "/v1/runs/{run_id}/weights"):
            if all(each.loc[0] != "broadcast" for each in fields):
                return {"path": self.weights}
            bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[4]]}
            return {"version": INT32_MAX, "broadcast": {"group_name": "g", "buckets": [bucket]}}
        if route == ("POST", "/v1/runs/{run_id}/weights/group"):
            return {"master_address": "127.0.0.1", "master_port": 29500, "group_name": "g"}
        if f.openai and "chat" in f.path:
            return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        if f.openai:
            return {"model": "m", "input": "hi"}
        return {}

    async def read_back(self, response: httpx.Response, f: IntField) -> Any:
        """What the gateway stored (or used) for the field, read from where it keeps it."""
        route = f.route
        if f.where == "query":
            echoed = response.json()
            return echoed.get(f.loc[0], NOT_READ) if isinstance(echoed, dict) else NOT_READ
        if route == ("POST", "/v1/envs"):
            stored = await self.http.get(f"/v1/envs/{response.json()['id']}")
            return _at(stored.json(), f.loc)
        if route == ("PATCH", "/v1/envs/{env_id}"):
            return _at((await self.http.get(f"/v1/envs/{self.env_id}")).json(), f.loc)
        if route == ("POST", "/v1/runs"):
            # The answer is the run as read from the database after the run manager's own
            # session stored it, not the request's config echoed.
            return _at(response.json()["config"], f.loc)
        if route == METRICS:
            sent = json.loads(response.request.content)
            versions = (await self.http.get(f"/v1/runs/{self.stored_run}/metrics")).json()
            (landed,) = [v for v in versions["versions"] if v["metrics"] == sent["metrics"]]
            return landed[f.loc[0]]  # the version, or the step it holds
        if route == ("POST", "/v1/runs/{run_id}/weights") and f.loc == ("version",):
            run = (await self.http.get(f"/v1/runs/{self.live_run}")).json()
            recorded = (await self.http.get(f"/v1/runs/{self.live_run}/metrics")).json()
            assert run["weight_version"] in [v["version"] for v in recorded["versions"]]
            return run["weight_version"]
        return NOT_READ


@pytest.fixture
async def gateway(database_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    from agentflow.modeling import ModelInit, build_model, save_model

    weights = save_model(build_model(ModelInit(**TINY_INIT), seed=1), tmp_path / "weights")
    app = create_app(Settings(database_url=database_url))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            gateway = Gateway(app, http, str(weights))
            name = f"ints-{uuid.uuid4().hex[:12]}"
            base = {"name": name, "kind": "python", "spec": {"entry_point": ENV}}
            gateway.env_id = (await http.post("/v1/envs", json=base)).json()["id"]
            stored = await http.post("/v1/runs?start=false", json={"name": "ints", **RUN})
            gateway.stored_run = stored.json()["id"]
            live = {**RUN, "name": "ints-live", "agent": {"max_turns": 2, "max_new_tokens": 4}}
            gateway.live_run = (await http.post("/v1/runs", json=live)).json()["id"]
            try:
                paused = await http.post(f"/v1/runs/{gateway.live_run}/pause")
                assert paused.status_code == 200, paused.text
                yield gateway
            finally:
                # Stopped, not left paused: the next gateway on this database (another
                # test's) would resume a paused run as a restart does.
                await http.post(f"/v1/runs/{gateway.live_run}/stop")


def _names_the_field(response: httpx.Response, f: IntField) -> bool:
    body = response.json()
    if f.openai:  # OpenAI's shape: the field as a dotted path
        return bool(body["error"]["param"] == ".".join(map(str, f.error_loc)))
    return any(list(e["loc"]) == [f.where, *f.error_loc] for e in body["detail"])


async def _record_versions(gateway: Gateway, versions: list[int | None]) -> None:
    """The stored run's weight versions, for the metrics of a step to attach to (a
    trainer's metrics name a version the run recorded when it was published)."""
    runs = gateway.app.state.run_manager.runs
    for version in sorted({v for v in versions if v is not None}):
        # One the column cannot hold is left out: what the route then does with it (a 500
        # where its range is too wide) is what the test is about, not this setup.
        with contextlib.suppress(SQLAlchemyError, OverflowError):
            await runs.record_version(uuid.UUID(gateway.stored_run), version, "", {})


# The fields that reach an integer column: the highest value their range admits is
# stored and read back (a range wider than the column is a 500 there, on PostgreSQL).
STORED_AT_THE_TOP = {
    ("POST", "/v1/envs", ("max_concurrency",)),
    ("PATCH", "/v1/envs/{env_id}", ("max_concurrency",)),
    (*METRICS, ("version",)),
    ("POST", "/v1/runs/{run_id}/weights", ("version",)),
    ("GET", "/v1/runs", ("offset",)),
    ("GET", "/v1/envs", ("offset",)),
    ("GET", "/v1/runs/{run_id}/episodes", ("offset",)),
    ("GET", "/ui/api/runs", ("offset",)),
    ("GET", "/ui/api/runs/{run_id}/episodes", ("offset",)),
}


def _rounds(
    plan: dict[IntField, list[int | float]],
) -> Iterator[dict[IntField, int | float]]:
    """The fields' values as requests: the fields of one route and union branch each take
    their next value in one request (pydantic names every field it refuses), in the order
    of each field's values. OpenAI's error shape names only one field: one field a request."""
    groups: dict[tuple[Any, ...], list[IntField]] = {}
    for f in plan:
        groups.setdefault((f.route, f.tags, f if f.openai else None), []).append(f)
    for fields in groups.values():
        for i in range(max(len(plan[f]) for f in fields)):
            yield {f: plan[f][i] for f in fields if i < len(plan[f])}


async def test_every_integer_field_is_refused_by_name_or_stored_exactly(
    gateway: Gateway,
) -> None:
    fields = integer_fields(gateway.app)
    rng = random.Random(0)
    values = {f: _values(f, rng) for f in fields}
    refused = {f: [v for v in vs if not f.takes(v)] for f, vs in values.items()}
    taken = {f: [v for v in vs if f.takes(v)] for f, vs in values.items()}

    requests = 0
    for sent in _rounds(refused):
        response = await gateway.send(sent)
        requests += 1
        openai = next(iter(sent)).openai
        what = f"{ {str(f): v for f, v in sent.items()} }: {response.status_code} {response.text}"
        assert response.status_code == (400 if openai else 422), what[:3000]
        unnamed = {str(f): v for f, v in sent.items() if not _names_the_field(response, f)}
        assert not unnamed, f"not refused by name: {unnamed}: {response.text[:3000]}"

    # Values in range are taken and read back as the integer sent, or refused for another
    # reason (a cross-field rule, a run that is not live, an episode that does not exist),
    # never with a 5xx. A request that sets several fields and is refused is sent again
    # one field at a time, so every value is tried on its own.
    metrics = [_integer(v, f.where) for f, vs in taken.items() if f.route == METRICS for v in vs]
    await _record_versions(gateway, metrics)
    tops: set[tuple[str, str, Loc]] = set()
    read = 0

    async def read_back(response: httpx.Response, f: IntField, value: int | float) -> None:
        nonlocal read
        stored = await gateway.read_back(response, f)
        if stored is NOT_READ:
            return
        number = _integer(value, f.where)
        assert type(stored) is int and stored == number, f"{f} = {value!r}: read {stored!r}"
        read += 1
        if number == f.high:
            tops.add((f.method, f.path, f.loc))

    for sent in _rounds(taken):
        response = await gateway.send(sent)
        requests += 1
        what = f"{ {str(f): v for f, v in sent.items()} }: {response.status_code} {response.text}"
        assert response.status_code < 500, what[:3000]
        if 200 <= response.status_code < 300:
            for f, value in sent.items():
                await read_back(response, f, value)
            continue
        if len(sent) == 1:
            continue
        for f, value in sent.items():
            alone = await gateway.send({f: value})
            requests += 1
            what = f"{f} = {value!r}: {alone.status_code} {alone.text[:300]}"
            assert alone.status_code < 500, what
            if 200 <= alone.status_code < 300:
                await read_back(alone, f, value)
    assert requests >= 300 and read >= 100, (requests, read)
    missing = STORED_AT_THE_TOP - tops
    assert not missing, f"never stored at the top of their range: {missing}"


async def test_a_run_at_the_highest_version_records_it_in_its_tokens_and_episodes(
    gateway: Gateway,
) -> None:
    """A version is not only a column of its own: the engine stamps every token with it
    (packed 32-bit arrays) and each episode keeps its oldest and newest."""
    http, run = gateway.http, gateway.live_run
    published = await http.post(
        f"/v1/runs/{run}/weights", json={"version": INT32_MAX, "path": gateway.weights}
    )
    assert published.status_code == 200, published.text
    assert (await http.post(f"/v1/runs/{run}/resume")).status_code == 200
    # An episode's versions are set when it ends: the newest is the one published.
    query = {"weight_version": str(INT32_MAX)}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        page = await http.get(f"/ui/api/runs/{run}/episodes", params=query)
        assert page.status_code == 200, page.text
        items = [e for e in page.json()["items"] if e["max_weight_version"] == INT32_MAX]
        if items:
            break
        assert loop.time() < deadline, "no episode played at the published version"
        await asyncio.sleep(0.1)
    tree = (await http.get(f"/v1/episodes/{items[0]['id']}")).json()
    versions = [v for node in _nodes(tree["roots"]) for v in node["weight_versions"] or ()]
    assert INT32_MAX in versions
    assert (await http.post(f"/v1/runs/{run}/stop")).status_code == 200


def _nodes(roots: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    stack = list(roots)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node["children"])
