"""The stack tests' images, built once per test session for both profiles (each stack
test would otherwise build them again, at a minute or more a time on a loaded machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentflow.stack import Stack
from tests.support.docker_engine import images_lock

ROOT = Path(__file__).resolve().parents[3]
# Compose interpolates every service's environment, even to build: values it requires.
BUILD_ONLY = (
    "AGENTFLOW_API_KEY",
    "AGENTFLOW_SECRET_KEY",
    "AGENTFLOW_POSTGRES_PASSWORD",
    "AGENTFLOW_SANDBOX_API_KEY",
    "AGENTFLOW_DESKTOP_API_KEY",
    "AGENTFLOW_RUN_CONFIG",
    "AGENTFLOW_VLLM_RUN_CONFIG",
)


@pytest.fixture(scope="session")
def stack_images(docker_engine: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("stack-images")
    unused = tmp / "unused.toml"  # the run configs are bind mounts: absolute paths
    unused.write_text("")
    env_file = tmp / "build.env"
    env_file.write_text("".join(f"{name}={unused}\n" for name in BUILD_ONLY))
    with images_lock():
        Stack(
            ROOT, name=f"agentflow-images-{os.getpid()}", env_file=env_file, profiles=("vllm",)
        ).build()
