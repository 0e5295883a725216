from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from sandbox import ExecResult, ExecStatus, Sandbox, SandboxFileError, SandboxLimits, open_sandbox
from sandbox.commands import argv_of, cwd_of, env_of, looks_like_memory_error, timeout_of
from sandbox.workdir import read_beneath, relative_path, write_beneath

from .memory_sandbox import MemorySandbox


def test_limits_have_bounds_and_are_frozen():
    limits = SandboxLimits()
    assert (limits.wall_time_s, limits.memory_mb, limits.max_file_bytes) == (10, 512, 64 << 20)
    assert (limits.max_workdir_bytes, limits.max_workdir_files) == (1 << 30, 100_000)
    for bad in (
        {"wall_time_s": 0},
        {"memory_mb": 1},
        {"max_processes": 0},
        {"max_output_bytes": 10},
        {"cpu_time_s": -1},
        {"max_workdir_bytes": 4096},  # under 1 MiB: not a useful work dir
        {"max_workdir_bytes": 65 << 30},  # tmpfs is memory: over 64 GiB is a mistake
        {"max_workdir_files": 0},
        {"max_workdir_files": 10**9},
        {"unknown": 1},
    ):
        with pytest.raises(ValidationError):
            SandboxLimits(**bad)
    with pytest.raises(ValidationError):
        limits.memory_mb = 1


def test_exec_result_round_trips_as_json():
    r = ExecResult(
        stdout="a",
        stderr="",
        exit_code=None,
        status=ExecStatus.TIME_LIMIT,
        duration_s=1.5,
        output_truncated=True,
    )
    assert ExecResult.model_validate_json(r.model_dump_json()) == r
    assert r.model_dump(mode="json")["status"] == "time_limit"


def test_memory_sandbox_satisfies_the_protocol():
    assert isinstance(MemorySandbox(), Sandbox)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        open_sandbox("chroot")


def test_argv_env_cwd_timeout_rules():
    assert argv_of("echo hi") == ["/bin/sh", "-c", "echo hi"]
    assert argv_of(("python3", "-V")) == ["python3", "-V"]
    for bad in ([], "", "  ", [""], ["a\0b"], [1]):
        with pytest.raises(ValueError):
            argv_of(bad)  # type: ignore[arg-type]
    env = env_of({"FOO": "1", "PATH": "/x"})
    assert env["FOO"] == "1" and env["PATH"] == "/x" and env["HOME"] == "/work"
    for bad_env in ({"A=B": "1"}, {"1A": "1"}, {"A": "x\0"}):
        with pytest.raises(ValueError):
            env_of(bad_env)
    assert cwd_of(None) == "/work" and cwd_of("a/./b") == "/work/a/b"
    with pytest.raises(SandboxFileError):
        cwd_of("../up")
    limits = SandboxLimits(wall_time_s=5)
    assert timeout_of(None, limits) == 5 and timeout_of(2, limits) == 2
    assert timeout_of(50, limits) == 5  # never extends the limit
    with pytest.raises(ValueError):
        timeout_of(0, limits)


def test_memory_error_markers():
    assert looks_like_memory_error(b"Traceback...\nMemoryError\n")
    assert looks_like_memory_error(b"terminate called after throwing 'std::bad_alloc'")
    assert not looks_like_memory_error(b"ZeroDivisionError: division by zero")


@pytest.mark.parametrize("bad", ["", "/abs", "../x", "a/../../x", "..", ".", "a\0b"])
def test_relative_path_refuses_escapes(bad):
    with pytest.raises(SandboxFileError):
        relative_path(bad)


def test_host_file_access_never_follows_symlinks(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    root = tmp_path / "work"
    root.mkdir()
    write_beneath(str(root), "d/e/f.txt", b"ok", max_bytes=10)
    assert read_beneath(str(root), "d/e/f.txt", max_bytes=10) == b"ok"
    os.symlink(secret, root / "leak")
    os.symlink(tmp_path, root / "up")
    os.mkfifo(root / "fifo")
    for path in ("leak", "up/secret", "fifo"):
        with pytest.raises(SandboxFileError):
            read_beneath(str(root), path, max_bytes=100)
    with pytest.raises(SandboxFileError):
        write_beneath(str(root), "leak", b"overwrite", max_bytes=100)
    with pytest.raises(SandboxFileError):
        write_beneath(str(root), "up/new", b"x", max_bytes=100)
    with pytest.raises(SandboxFileError):
        write_beneath(str(root), "big", b"x" * 11, max_bytes=10)
    with pytest.raises(SandboxFileError):
        read_beneath(str(root), "d/e/f.txt", max_bytes=1)
    assert secret.read_text() == "s3cret" and not (tmp_path / "new").exists()
