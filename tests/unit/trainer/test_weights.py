"""WeightPublisher: in-process and on-disk publishes to real LocalEngines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentflow.errors import EngineError, InvalidInput
from agentflow.inference.base import WeightUpdate
from agentflow.inference.local import LocalEngine
from agentflow.modeling import MODEL_INIT_FILE, ModelInit, build_model, load_model, score
from trainer.weights import (
    INDEX_FILE,
    MANIFEST_FILE,
    WeightPublisher,
    WeightSyncError,
    sha256_of,
)

INIT = ModelInit(layers=1, hidden=32, heads=2, max_context=64)
TOKENS = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
async def engines() -> AsyncIterator[list[LocalEngine]]:
    pair = [LocalEngine.from_init(INIT, seed=0, max_batch_size=2) for _ in range(2)]
    yield pair
    for engine in pair:
        await engine.close()


class RecordingTarget:
    """Keeps the updates it is handed (to check what a target receives)."""

    name = "recorder"

    def __init__(self) -> None:
        self.updates: list[WeightUpdate] = []

    async def update_weights(self, update: WeightUpdate) -> int:
        self.updates.append(update)
        assert update.version is not None
        return update.version


def assert_serves(engine: LocalEngine, model: Any, version: int) -> None:
    assert engine.weight_version == version
    assert engine.score(TOKENS) == pytest.approx(score(model, TOKENS), abs=1e-5)


async def test_inprocess_switches_every_engine(engines: list[LocalEngine]) -> None:
    trained = build_model(INIT, seed=1)
    assert engines[0].score(TOKENS) != pytest.approx(score(trained, TOKENS), abs=1e-3)
    publisher = WeightPublisher("inprocess", engines)

    report = await publisher.publish(trained.state_dict(), version=1)

    assert publisher.published_version == 1
    for engine in engines:
        assert_serves(engine, trained, 1)
    assert report.mode == "inprocess" and report.version == 1 and report.path is None
    assert [t.version for t in report.targets] == [1, 1]
    assert len({t.name for t in report.targets}) == 2  # two alike engines, told apart
    # Tied embeddings are counted once.
    assert report.bytes == sum(p.numel() * 4 for p in trained.parameters())


async def test_inprocess_hands_over_copies(engines: list[LocalEngine]) -> None:
    trained = build_model(INIT, seed=1)
    recorder = RecordingTarget()
    await WeightPublisher("inprocess", [engines[0], recorder]).publish(trained.state_dict(), 1)
    handed = recorder.updates[0].state_dict
    assert handed is not None
    before = {name: t.clone() for name, t in handed.items()}
    served = engines[0].score(TOKENS)

    with torch.no_grad():  # the optimizer's next step
        for p in trained.parameters():
            p.add_(0.5)

    assert all(torch.equal(handed[name], before[name]) for name in before)
    assert engines[0].score(TOKENS) == served != pytest.approx(score(trained, TOKENS), abs=1e-3)


async def test_disk_writes_a_checkpoint_with_a_manifest(
    engines: list[LocalEngine], tmp_path: Path
) -> None:
    trained = build_model(INIT, seed=1)
    publisher = WeightPublisher("disk", engines, tmp_path, config=trained.config)

    report = await publisher.publish(trained.state_dict(), version=3)

    version_dir = tmp_path / "v000003"
    assert report.path == str(version_dir) and report.write_seconds <= report.seconds
    for engine in engines:
        assert_serves(engine, trained, 3)
    manifest = json.loads((version_dir / MANIFEST_FILE).read_text())
    assert manifest["version"] == 3
    names = {f["name"] for f in manifest["files"]}
    assert {"model.safetensors", "config.json", MODEL_INIT_FILE} <= names
    assert INDEX_FILE not in names  # one shard
    for f in manifest["files"]:
        assert (version_dir / f["name"]).stat().st_size == f["bytes"]
        assert sha256_of(version_dir / f["name"]) == f["sha256"]
    assert manifest["total_bytes"] == sum(f["bytes"] for f in manifest["files"])
    # A complete HF checkpoint: it loads on its own, with its ModelInit.
    loaded = load_model(version_dir)
    assert loaded.config.agentflow_init == INIT.model_dump()
    assert score(loaded, TOKENS) == pytest.approx(score(trained, TOKENS), abs=1e-6)


async def test_disk_shards_and_keeps_the_newest_versions(
    engines: list[LocalEngine], tmp_path: Path
) -> None:
    model = build_model(INIT, seed=1)
    publisher = WeightPublisher(
        "disk", engines, tmp_path, config=model.config, keep=2, shard_bytes=64 * 1024
    )
    for version in (1, 2, 3):
        model = build_model(INIT, seed=version)
        await publisher.publish(model.state_dict(), version)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]
    latest = tmp_path / "v000003"
    shards = sorted(latest.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    index = json.loads((latest / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as HF does
    assert set(index["weight_map"]) == {n for n, _ in model.named_parameters()}
    for engine in engines:
        assert_serves(engine, model, 3)
    assert score(load_model(latest), TOKENS) == pytest.approx(score(model, TOKENS), abs=1e-6)


async def test_a_failing_target_is_named_and_the_version_not_live(
    engines: list[LocalEngine],
) -> None:
    # A real engine serving another architecture refuses the update (shape mismatch).
    other = LocalEngine.from_init(
        ModelInit(layers=1, hidden=16, heads=2, max_context=64), model_name="other-arch"
    )
    try:
        publisher = WeightPublisher("inprocess", [engines[0], other])
        with pytest.raises(WeightSyncError) as caught:
            await publisher.publish(build_model(INIT, seed=1).state_dict(), version=1)
    finally:
        await other.close()

    err = caught.value
    assert isinstance(err, EngineError)
    assert "LocalEngine(other-arch)" in str(err) and "not live" in str(err)
    assert list(err.failed) == ["LocalEngine(other-arch)"]
    assert "shape" in err.failed["LocalEngine(other-arch)"]
    assert err.switched == ["LocalEngine(local)"]
    assert publisher.published_version == 0


async def test_versions_only_move_forward(engines: list[LocalEngine], tmp_path: Path) -> None:
    model = build_model(INIT, seed=1)
    publisher = WeightPublisher("inprocess", engines[:1])
    await publisher.publish(model.state_dict(), 2)
    with pytest.raises(InvalidInput, match="not newer"):
        await publisher.publish(model.state_dict(), 2)
    with pytest.raises(InvalidInput, match="config"):
        WeightPublisher("disk", engines, tmp_path)
