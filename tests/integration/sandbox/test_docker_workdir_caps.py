"""The Docker backend's capped work dir against a real engine: ENOSPC past the byte and
file caps from inside, clean file errors outside, and the sandbox keeps working.

Runs in the sandbox runtime image (``docker/sandbox-runtime.Dockerfile``), built or found
in the engine's cache by the ``sandbox_runtime_image`` session fixture; nothing is pulled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from sandbox import ExecStatus, SandboxFileError, SandboxLimits
from sandbox.docker_backend import DockerSandbox

from .leftovers import assert_docker_sandbox_gone

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
CAP_BYTES = 4 * MIB
CAP_FILES = 200
CAPPED = SandboxLimits(
    wall_time_s=10, cpu_time_s=5, max_workdir_bytes=CAP_BYTES, max_workdir_files=CAP_FILES
)


@pytest.fixture
async def sandbox(docker_client: Any, sandbox_runtime_image: str) -> AsyncIterator[DockerSandbox]:
    sb = DockerSandbox(limits=CAPPED, image=sandbox_runtime_image, client=docker_client)
    try:
        yield sb
    finally:
        await sb.close()
    assert_docker_sandbox_gone(docker_client, sb)


async def test_work_dir_caps_hold_inside_and_out(sandbox):
    sb = sandbox
    fs = await sb.exec("stat -f -c '%T %b %S %c' /work")
    kind, blocks, block_size, inodes = fs.stdout.split()
    assert kind == "tmpfs" and int(blocks) * int(block_size) == CAP_BYTES
    assert int(inodes) == CAP_FILES + 1  # the root dir takes one

    # At most twice the cap: dd stops at ENOSPC.
    fill = await sb.exec(f"dd if=/dev/zero of=fill.bin bs=1M count={2 * CAP_BYTES // MIB}")
    assert fill.status is ExecStatus.FINISHED and fill.exit_code == 1
    assert "No space left on device" in fill.stderr
    with pytest.raises(SandboxFileError, match="the work dir is full"):
        await sb.write_file("more.bin", bytes(MIB))
    listing = await sb.exec("ls -A")
    assert listing.stdout == "fill.bin\n"  # alive, and no truncated more.bin

    make = (
        f"rm fill.bin; i=0; while [ $i -lt {2 * CAP_FILES} ]; do "
        'touch "f$i" 2>/dev/null || break; i=$((i+1)); done; echo "$i"'
    )
    made = await sb.exec(make)
    assert made.stdout == f"{CAP_FILES}\n"
    with pytest.raises(SandboxFileError, match="the work dir is full"):
        await sb.write_file("one-more.txt", "x")

    await sb.reset()
    assert (await sb.exec("ls -A")).stdout == ""
    await sb.write_file("sub/out.txt", "hello")
    assert await sb.read_file("sub/out.txt") == b"hello"
    assert (await sb.exec(["cat", "sub/out.txt"], stdin="ignored")).stdout == "hello"
