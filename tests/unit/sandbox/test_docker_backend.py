"""The Docker backend at the SDK boundary: exact container/exec parameters, timeouts,
status mapping, files and clean-up, against a recording fake client."""

from __future__ import annotations

from typing import Any

import pytest
from docker.types import Ulimit

from sandbox import (
    ExecStatus,
    SandboxClosed,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
    docker_backend,
    open_sandbox,
)
from sandbox.docker_backend import LABEL, DockerSandbox, remove_by_label

from .fake_docker import FakeDockerClient, ScriptedExec

LIMITS = SandboxLimits(
    wall_time_s=5,
    cpu_time_s=3,
    memory_mb=256,
    max_processes=32,
    max_output_bytes=2048,
    max_file_bytes=1 << 20,
    max_workdir_bytes=8 << 20,
    max_workdir_files=500,
)
# Every command sets its own address-space limit of memory_mb (in KiB).
AS_256M = ["sh", "-c", 'ulimit -v 262144 && exec "$@"', "sh"]


def test_container_is_started_with_the_documented_limits():
    client = FakeDockerClient()
    sb = open_sandbox("docker", limits=LIMITS, client=client, image="img:1", cpus=0.5)
    assert isinstance(sb, DockerSandbox)
    ((_, name, volume_kwargs),) = client.named("volumes.create")
    assert name == f"agentflow-sandbox-{sb.id}"
    assert volume_kwargs == {
        "driver": "local",
        "driver_opts": {
            "type": "tmpfs",
            "device": "tmpfs",
            "o": "size=8388608,nr_inodes=501,uid=65534,gid=65534,mode=0755",
        },
        "labels": {LABEL: sb.id},
    }
    ((_, (image, command), kwargs),) = client.named("containers.run")
    assert (image, command) == ("img:1", ["sleep", "infinity"])
    assert kwargs == {
        "detach": True,
        "name": f"agentflow-sandbox-{sb.id}",
        "init": True,
        "user": "65533:65533",  # not the exec user: `kill -9 -1` must not end the container
        "working_dir": "/work",
        # The work dir's tmpfs pages are charged to the container: their own budget on top.
        "mem_limit": (256 << 20) + (8 << 20),
        "memswap_limit": (256 << 20) + (8 << 20),
        "nano_cpus": 500_000_000,
        "pids_limit": 32,
        "ulimits": [
            Ulimit(name="cpu", soft=3, hard=4),
            Ulimit(name="fsize", soft=1 << 20, hard=1 << 20),
            Ulimit(name="core", soft=0, hard=0),
        ],
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {"/tmp": "size=64m,mode=1777"},
        "volumes": {f"agentflow-sandbox-{sb.id}": {"bind": "/work", "mode": "rw"}},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "labels": {LABEL: sb.id},
        "environment": {},
    }


def test_network_only_when_asked():
    client = FakeDockerClient()
    DockerSandbox(client=client, network=True)
    assert client.named("containers.run")[0][2]["network_mode"] == "bridge"


async def test_exec_runs_under_timeout_kill_with_clean_env_and_cwd():
    client = FakeDockerClient(lambda cmd: ScriptedExec(chunks=[(b"4", None), (b"2\n", b"w")]))
    sb = DockerSandbox(client=client, limits=LIMITS)
    result = await sb.exec(["python3", "-c", "print(42)"], cwd="sub", env={"A": "1"}, timeout_s=2)
    assert (result.status, result.exit_code, result.stdout, result.stderr) == (
        ExecStatus.FINISHED,
        0,
        "42\n",
        "w",
    )
    ((_, argv, kwargs),) = client.named("exec_create")
    assert argv == ["timeout", "-s", "KILL", "2.000s", *AS_256M, "python3", "-c", "print(42)"]
    assert kwargs["user"] == "65534:65534" and kwargs["workdir"] == "/work/sub"
    assert kwargs["environment"]["A"] == "1" and kwargs["environment"]["HOME"] == "/work"
    assert client.named("exec_start")[0][2] == {"stream": True, "demux": True}


async def test_timeout_never_extends_the_wall_limit_and_strings_go_through_sh():
    client = FakeDockerClient()
    sb = DockerSandbox(client=client, limits=LIMITS)
    await sb.exec("echo hi", timeout_s=999)
    assert client.named("exec_create")[0][1] == [
        "timeout",
        "-s",
        "KILL",
        "5.000s",
        *AS_256M,
        "/bin/sh",
        "-c",
        "echo hi",
    ]


async def test_kill_by_inner_timeout_is_time_limit():
    client = FakeDockerClient(lambda cmd: ScriptedExec(exit_code=137, delay_s=0.2))
    sb = DockerSandbox(client=client, limits=LIMITS)
    result = await sb.exec("sleep 100", timeout_s=0.2)
    assert result.status is ExecStatus.TIME_LIMIT and result.exit_code is None


async def test_engine_that_misses_the_outer_deadline_is_killed(monkeypatch):
    monkeypatch.setattr(docker_backend, "OUTER_GRACE_S", 0.1)
    client = FakeDockerClient(
        lambda cmd: ScriptedExec(delay_s=1.0) if cmd[0] == "timeout" else ScriptedExec()
    )
    sb = DockerSandbox(client=client, limits=LIMITS)
    result = await sb.exec("sleep 100", timeout_s=0.1)
    assert result.status is ExecStatus.TIME_LIMIT
    assert ("exec_run", ["kill", "-9", "-1"], {"user": "65534:65534"}) in client.calls


async def test_oom_kill_is_memory_limit():
    client = FakeDockerClient(lambda cmd: ScriptedExec(exit_code=137))
    sb = DockerSandbox(client=client, limits=LIMITS)
    sb.container.attrs["State"]["OOMKilled"] = True
    result = await sb.exec("python3 -c 'x = bytearray(10**10)'")
    assert result.status is ExecStatus.MEMORY_LIMIT
    assert client.named("reload")


async def test_signal_without_oom_is_error_and_cpu_limit_is_time_limit():
    codes = iter([137, 152])
    client = FakeDockerClient(lambda cmd: ScriptedExec(exit_code=next(codes)))
    sb = DockerSandbox(client=client, limits=LIMITS)
    assert (await sb.exec("kill -9 $$")).status is ExecStatus.ERROR
    assert (await sb.exec("spin")).status is ExecStatus.TIME_LIMIT


async def test_output_past_the_cap_is_cut_and_the_command_killed():
    client = FakeDockerClient(lambda cmd: ScriptedExec(chunks=[(b"x" * 1500, None)] * 100))
    sb = DockerSandbox(client=client, limits=LIMITS)
    result = await sb.exec("yes")
    assert result.status is ExecStatus.ERROR and result.output_truncated
    assert len(result.stdout) == LIMITS.max_output_bytes
    assert ("exec_run", ["kill", "-9", "-1"], {"user": "65534:65534"}) in client.calls


async def test_files_round_trip_through_archives_owned_by_nobody():
    client = FakeDockerClient()
    sb = DockerSandbox(client=client, limits=LIMITS)
    await sb.write_file("pkg/mod.py", "x = 1\n")
    assert sb.container.files["/work/pkg/mod.py"] == b"x = 1\n"
    assert sb.container.owners["/work/pkg"] == (65534, 65534)
    assert sb.container.owners["/work/pkg/mod.py"] == (65534, 65534)
    assert await sb.read_file("pkg/mod.py") == b"x = 1\n"
    with pytest.raises(SandboxFileError):
        await sb.read_file("missing")
    for bad in ("/etc/passwd", "../x", "a/../../x", ""):
        with pytest.raises(SandboxFileError):
            await sb.write_file(bad, "x")
    with pytest.raises(SandboxFileError):
        await sb.write_file("big", b"x" * (LIMITS.max_file_bytes + 1))


async def test_a_full_work_dir_is_a_file_error():
    client = FakeDockerClient()
    sb = DockerSandbox(client=client, limits=LIMITS)

    def full(path: str, data: bytes) -> bool:
        raise RuntimeError(
            '500 Server Error: ("Error processing tar file(exit status 1): write /big: '
            'no space left on device")'
        )

    sb.container.put_archive = full  # type: ignore[method-assign]
    with pytest.raises(SandboxFileError, match="the work dir is full"):
        await sb.write_file("big", b"x")


async def test_stdin_is_staged_as_a_file_and_redirected():
    client = FakeDockerClient()
    sb = DockerSandbox(client=client, limits=LIMITS)
    await sb.exec(["cat"], stdin="hello")
    staged = [p for p in sb.container.files if p.startswith("/work/.sandbox/stdin-")]
    assert len(staged) == 1 and sb.container.files[staged[0]] == b"hello"
    argv = client.named("exec_create")[0][1]
    assert argv[:2] == ["sh", "-c"] and argv[4] == staged[0]
    assert argv[5:] == ["timeout", "-s", "KILL", "5.000s", *AS_256M, "cat"]


async def test_close_removes_container_and_volume_by_label_and_is_idempotent():
    client = FakeDockerClient()
    keep = DockerSandbox(client=client)
    sb = DockerSandbox(client=client)
    await sb.close()
    await sb.close()
    assert client.named("containers.list")[0][2] == {
        "all": True,
        "filters": {"label": f"{LABEL}={sb.id}"},
    }
    assert ("containers.remove", sb.container.id, {"force": True}) in client.calls
    assert [c.id for c in client.container_list] == [keep.container.id]
    assert [v.name for v in client.volume_list] == [f"agentflow-sandbox-{keep.id}"]
    with pytest.raises(SandboxClosed):
        await sb.exec("true")
    assert remove_by_label(client) == 1  # crash recovery: every sandbox container
    assert client.container_list == [] and client.volume_list == []


def test_failed_start_cleans_up_and_raises():
    client = FakeDockerClient()
    client.fail_run = True
    with pytest.raises(SandboxError, match="could not start"):
        DockerSandbox(client=client)
    assert client.volume_list == []


async def test_bad_input_is_refused_before_reaching_the_engine():
    client = FakeDockerClient()
    sb = DockerSandbox(client=client)
    cases: list[dict[str, Any]] = [
        {"cmd": []},
        {"cmd": "  "},
        {"cmd": "x", "env": {"A=B": "1"}},
        {"cmd": "x", "timeout_s": 0},
    ]
    for kwargs in cases:
        with pytest.raises(ValueError):
            await sb.exec(**kwargs)
    assert client.named("exec_create") == []
