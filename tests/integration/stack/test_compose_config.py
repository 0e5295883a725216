"""docker-compose.yml validates for both profiles, and its services have the structure the
stack relies on: host networking everywhere, no published ports or bridge networks, the
GPU services asking for GPUs, SGLang serving token ids behind the real router."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentflow.stack import PROFILES, Stack, StackError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def _resolved(profile: str, **environment: str) -> dict[str, Any]:
    """The resolved file, with only the services this profile runs."""
    stack = Stack(ROOT, name="agentflow-config-check", env_file=ROOT / ".env.example",
                  profiles=(profile,), environment=environment)  # fmt: skip
    resolved = yaml.safe_load(stack.config())
    active = stack.services()
    resolved["services"] = {k: v for k, v in resolved["services"].items() if k in active}
    return resolved


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's volumes (docker-compose v1 prints the short form)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2] if isinstance(volume, str) else (
            volume["source"], volume["target"])  # fmt: skip
        mounts[target] = source
    return mounts


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_validates_on_host_networking_only(profile: str) -> None:
    services = _resolved(profile)["services"]
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        assert "ports" not in service and "networks" not in service, name
    assert "networks" not in _resolved(profile) or not _resolved(profile)["networks"]


def test_cpu_profile_services() -> None:
    services = _resolved("cpu")["services"]
    assert set(services) == {"postgres", "gateway", "sandbox", "desktop", "trainer"}
    gateway = services["gateway"]
    assert gateway["restart"] == "always"  # a crashed gateway comes back
    assert gateway["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "agentflow db upgrade && exec agentflow serve" in " ".join(gateway["command"])
    assert gateway["environment"]["AGENTFLOW_ENVIRONMENT"] == "production"
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
    # The stack's PostgreSQL keeps off the host's 5432.
    assert services["postgres"]["environment"]["POSTGRES_PORT"] != "5432"
    assert ":55432/" in gateway["environment"]["AGENTFLOW_DATABASE_URL"]
    trainer = services["trainer"]
    assert "--run" not in trainer["command"]  # it finds or creates the config's run
    assert trainer["depends_on"]["gateway"]["condition"] == "service_healthy"
    # The gateway loads the weights the trainer publishes: same volume, same path.
    assert _mounts(trainer)["/data"] == _mounts(gateway)["/data"] == "agentflow-data"
    sandbox = services["sandbox"]
    assert sandbox["environment"]["AGENTFLOW_SANDBOX_API_KEY"]
    assert sandbox["environment"]["AGENTFLOW_SANDBOX_BACKEND"] == "docker"
    assert sandbox["environment"]["AGENTFLOW_SANDBOX_IMAGE"] == "agentflow-sandbox-runtime:local"
    assert _mounts(sandbox)["/var/run/docker.sock"] == "/var/run/docker.sock"
    assert "privileged" not in sandbox and "cap_add" not in sandbox


def test_gpu_profile_services() -> None:
    services = _resolved("gpu", AGENTFLOW_MODEL_DIR="/models/qwen", SGLANG_PORT="31000")["services"]
    assert set(services) == {
        "postgres",
        "gateway-gpu",
        "sandbox",
        "desktop",
        "sglang",
        "router",
        "trainer-gpu",
    }
    sglang, router, trainer = services["sglang"], services["router"], services["trainer-gpu"]
    gateway = services["gateway-gpu"]
    # The gateway's SGLang engine tokenizes with the checkpoint the server loads.
    assert _mounts(gateway)["/models/policy"] == "/models/qwen"
    assert _mounts(trainer)["/models/policy"] == "/models/qwen"
    assert trainer["depends_on"]["gateway-gpu"]["condition"] == "service_healthy"
    assert gateway["restart"] == "always" and "/healthz" in " ".join(
        gateway["healthcheck"]["test"])  # fmt: skip
    command = sglang["command"]
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    assert "--skip-tokenizer-init" in command  # the gateway owns tokenization
    assert command[command.index("--port") + 1] == "31000"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert _mounts(sglang)["/models/policy"] == "/models/qwen"
    assert router["command"][:3] == ["python3", "-m", "sglang_router.launch_router"]
    urls = router["command"][router["command"].index("--worker-urls") + 1]
    assert urls == "http://127.0.0.1:31000"
    assert router["depends_on"]["sglang"]["condition"] == "service_healthy"
    for service in (sglang, trainer):
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_desktop_service(profile: str) -> None:
    resolved = _resolved(profile, AGENTFLOW_DESKTOP_NOVNC_PORT="16080",
                         AGENTFLOW_DESKTOP_STATE_PORT="16090")  # fmt: skip
    services = resolved["services"]
    desktop = services["desktop"]
    assert desktop["image"] == "agentflow-desktop:local"
    assert desktop["build"]["dockerfile"] == "desktop.Dockerfile"
    assert Path(desktop["build"]["context"]) == ROOT / "docker"  # copies nothing: a small context
    assert desktop["build"]["args"]["AGENTFLOW_IMAGE"] == "agentflow:local"
    assert desktop["user"] == "agentflow"  # commands sent to it never run as root
    assert desktop["command"] == ["agentflow", "desktop", "serve"]
    environment = desktop["environment"]
    assert environment["AGENTFLOW_DESKTOP_NOVNC_PORT"] == "16080"
    assert environment["AGENTFLOW_DESKTOP_STATE_PORT"] == "16090"
    assert environment["AGENTFLOW_DESKTOP_DISPLAY"] == "99"
    assert environment["AGENTFLOW_DESKTOP_API_KEY"] == "change-me-desktop-key"
    # The gateway holds the same key, so a registered desktop spec need not carry it.
    gateway = services["gateway" if profile == "cpu" else "gateway-gpu"]
    assert gateway["environment"]["AGENTFLOW_DESKTOP_API_KEY"] == "change-me-desktop-key"
    test = desktop["healthcheck"]["test"]
    assert test[:2] == ["CMD", "agentflow-healthcheck"]
    assert test[2] == "http://127.0.0.1:16090/health"
    assert desktop["restart"] == "unless-stopped"
    assert "/tmp" in desktop["tmpfs"]  # no stale X lock after a restart
    assert "privileged" not in desktop and "cap_add" not in desktop


def test_vllm_profile_services() -> None:
    services = _resolved("vllm", AGENTFLOW_VLLM_PORT="18100")["services"]
    assert set(services) == {"postgres", "gateway", "model", "vllm", "trainer-vllm"}
    model, vllm, trainer = services["model"], services["vllm"], services["trainer-vllm"]
    # The warm start writes the checkpoint once; the server starts after it, from it.
    command = " ".join(model["command"])
    assert "agentflow sft /config/run.toml --from-init --out /data/models/warm" in command
    assert "untie-head /data/models/warm --out /data/models/policy" in command
    assert vllm["depends_on"]["model"]["condition"] == "service_completed_successfully"
    command = vllm["command"]
    assert command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--model") + 1] == "/data/models/policy"
    assert command[command.index("--port") + 1] == "18100"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    for flag in ("--enable-scale-out", "--enable-prefix-caching", "--logprobs-mode"):
        assert flag in command
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"  # the RL routes
    # The engine core's shared-memory ring (160 MiB) does not fit the default 64 MiB.
    assert vllm["shm_size"] in ("1gb", 1 << 30, "1073741824")
    assert vllm["environment"]["TORCHDYNAMO_DISABLE"] == "1"  # no compiler in the image
    assert vllm["user"] == "agentflow" and "18100/health" in " ".join(vllm["healthcheck"]["test"])
    assert trainer["depends_on"]["vllm"]["condition"] == "service_healthy"
    # Published weights and the checkpoint are at the same paths for all three.
    gateway = services["gateway"]
    assert _mounts(vllm)["/data"] == _mounts(gateway)["/data"] == _mounts(trainer)["/data"]


@pytest.mark.parametrize("secret", ["AGENTFLOW_API_KEY", "AGENTFLOW_DESKTOP_API_KEY"])
def test_a_missing_secret_is_refused_by_name(tmp_path: Path, secret: str) -> None:
    env = tmp_path / ".env"
    lines = (ROOT / ".env.example").read_text().splitlines()
    env.write_text("\n".join(ln for ln in lines if not ln.startswith(f"{secret}=")))
    saved = os.environ.pop(secret, None)
    try:
        stack = Stack(ROOT, name="agentflow-config-check", env_file=env)
        with pytest.raises(StackError, match=f"set {secret}"):
            stack.config()
    finally:
        if saved is not None:
            os.environ[secret] = saved


def test_an_unknown_profile_is_refused() -> None:
    with pytest.raises(StackError, match="unknown profiles"):
        Stack(ROOT, profiles=("tpu",))
