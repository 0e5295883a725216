"""The Docker backend's capped work dir against a real engine: ENOSPC past the byte and
file caps from inside, clean file errors outside, and the sandbox keeps working.

Skipped unless a Docker engine answers and the image (``AGENTFLOW_SANDBOX_TEST_IMAGE``,
default the backend's own) is already present: nothing is pulled. The image needs only
``sh``, coreutils and ``kill``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from sandbox import ExecStatus, SandboxFileError, SandboxLimits
from sandbox.docker_backend import DEFAULT_IMAGE, LABEL, DockerSandbox

pytestmark = pytest.mark.integration

IMAGE = os.environ.get("AGENTFLOW_SANDBOX_TEST_IMAGE", DEFAULT_IMAGE)
MIB = 1024 * 1024
CAP_BYTES = 4 * MIB
CAP_FILES = 200
CAPPED = SandboxLimits(
    wall_time_s=10, cpu_time_s=5, max_workdir_bytes=CAP_BYTES, max_workdir_files=CAP_FILES
)


@pytest.fixture
async def sandbox() -> AsyncIterator[DockerSandbox]:
    docker = pytest.importorskip("docker")
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        # Checked first: the client's failed version probe would leak its socket.
        pytest.skip("no Docker engine socket")
    try:
        client = docker.from_env()
    except docker.errors.DockerException as exc:
        pytest.skip(f"no Docker engine reachable: {exc}")
    try:
        try:
            client.ping()
        except Exception as exc:
            pytest.skip(f"no Docker engine reachable: {exc}")
        try:
            client.images.get(IMAGE)
        except docker.errors.ImageNotFound:
            pytest.skip(f"image {IMAGE} is not present (set AGENTFLOW_SANDBOX_TEST_IMAGE)")
        sb = DockerSandbox(limits=CAPPED, image=IMAGE, client=client)
        yield sb
        await sb.close()
        assert client.containers.list(all=True, filters={"label": f"{LABEL}={sb.id}"}) == []
        assert client.volumes.list(filters={"label": f"{LABEL}={sb.id}"}) == []
    finally:
        client.close()  # its pooled engine connections would otherwise leak (ResourceWarning)


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
