"""The bubblewrap work dir on a capped tmpfs: sandboxed code that writes past the byte or
file cap gets ENOSPC, the host disk pays nothing, the sandbox keeps working, and close
(or the finalizer) leaves no mount and no directory behind."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox import ExecStatus, SandboxFileError, SandboxLimits
from sandbox import bwrap as bwrap_backend
from sandbox.bwrap import BwrapSandbox

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
CAP_BYTES = 4 * MIB
CAP_FILES = 200
CAPPED = SandboxLimits(
    wall_time_s=10, cpu_time_s=5, max_workdir_bytes=CAP_BYTES, max_workdir_files=CAP_FILES
)

# Writes 1 MiB at a time, never more than sys.argv[1] bytes, and says how it stopped.
FILL = """
import errno, sys
written = 0
try:
    with open("fill.bin", "wb", buffering=0) as f:
        while written < int(sys.argv[1]):
            written += f.write(bytes(1 << 20))
except OSError as exc:
    print(errno.errorcode[exc.errno], written, file=sys.stderr)
    sys.exit(1)
"""
# Creates at most sys.argv[1] empty files and says how it stopped.
MAKE_FILES = """
import errno, sys
made = 0
try:
    for i in range(int(sys.argv[1])):
        open(f"f{i}", "x").close()
        made += 1
except OSError as exc:
    print(errno.errorcode[exc.errno], made, file=sys.stderr)
    sys.exit(1)
"""


def is_mount_point(path: str) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4] == target for line in f)


def capped(sb: BwrapSandbox) -> BwrapSandbox:
    if not sb.workdir_capped:
        pytest.skip("this process may not mount a tmpfs (not root, no CAP_SYS_ADMIN)")
    return sb


async def test_writing_past_the_byte_cap_is_enospc_and_spares_the_host_disk(make_sandbox):
    sb = capped(make_sandbox(limits=CAPPED))
    st = os.statvfs(sb.workdir)
    assert st.f_blocks * st.f_frsize == CAP_BYTES  # the work dir is its own capped filesystem
    host_root = os.path.dirname(sb.workdir)
    assert os.stat(sb.workdir).st_dev != os.stat(host_root).st_dev  # not the host disk's
    result = await sb.exec(["python3", "-c", FILL, str(2 * CAP_BYTES)])
    assert result.status is ExecStatus.FINISHED and result.exit_code == 1, result
    code, written = result.stderr.split()
    assert code == "ENOSPC" and CAP_BYTES - MIB <= int(written) <= CAP_BYTES
    # Every byte written sits in the work dir's own filesystem, so the host disk paid for
    # none of them. (Read there, not as the host disk's free space, which moves with
    # whatever else the machine writes meanwhile: other tests, other workers.)
    full = os.statvfs(sb.workdir)
    held = (full.f_blocks - full.f_bfree) * full.f_frsize
    assert held >= int(written), f"the work dir's filesystem holds {held} of {written} bytes"

    # Full, the sandbox still runs commands, and host-side writes fail cleanly.
    again = await sb.exec("ls fill.bin && echo alive")
    assert again.status is ExecStatus.FINISHED and again.stdout == "fill.bin\nalive\n"
    with pytest.raises(SandboxFileError, match="the work dir is full"):
        await sb.write_file("more.bin", bytes(MIB))
    assert await sb.list_files() == ["fill.bin"]  # no truncated more.bin left behind

    assert (await sb.exec("rm fill.bin")).exit_code == 0
    await sb.write_file("more.bin", bytes(MIB))
    assert await sb.read_file("more.bin") == bytes(MIB)


async def test_creating_past_the_file_cap_is_enospc(make_sandbox):
    sb = capped(make_sandbox(limits=CAPPED))
    result = await sb.exec(["python3", "-c", MAKE_FILES, str(2 * CAP_FILES)])
    assert result.status is ExecStatus.FINISHED and result.exit_code == 1, result
    code, made = result.stderr.split()
    assert code == "ENOSPC" and int(made) == CAP_FILES

    again = await sb.exec("ls | wc -l")
    assert again.status is ExecStatus.FINISHED and again.stdout.strip() == str(CAP_FILES)
    with pytest.raises(SandboxFileError, match="the work dir is full"):
        await sb.write_file("one-more.txt", "x")

    assert (await sb.exec("rm f0")).exit_code == 0
    await sb.write_file("one-more.txt", "x")
    assert await sb.read_file("one-more.txt") == b"x"


async def test_reset_frees_the_capped_work_dir(make_sandbox):
    sb = capped(make_sandbox(limits=CAPPED))
    await sb.exec(["python3", "-c", FILL, str(2 * CAP_BYTES)])
    await sb.exec(["python3", "-c", "import os; os.makedirs('a/b'); open('a/b/c', 'w').close()"])
    await sb.reset()
    assert await sb.list_files() == []
    st = os.statvfs(sb.workdir)
    assert st.f_bfree == st.f_blocks and st.f_ffree == CAP_FILES
    assert (await sb.exec(["python3", "-c", FILL, str(MIB)])).exit_code == 0


async def test_memory_cgroup_gets_the_work_dir_and_tmp_on_top_and_processes_keep_memory_mb(
    make_sandbox,
):
    sb = capped(make_sandbox(limits=CAPPED))
    rlimit = await sb.exec(
        ["python3", "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0])"]
    )
    assert rlimit.stdout == f"{CAPPED.memory_mb * MIB}\n"
    if sb.cgroup is None:
        pytest.skip("no writable cgroup on this host: memory is bounded per process only")
    if sb.cgroup.version == 2:
        limit = (sb.cgroup.dirs[""] / "memory.max").read_text()
    else:
        limit = (sb.cgroup.dirs["memory"] / "memory.limit_in_bytes").read_text()
    assert int(limit) == CAPPED.memory_mb * MIB + CAP_BYTES + 64 * MIB  # /tmp's default


async def test_close_unmounts_and_removes_the_work_dir(make_sandbox):
    sb = capped(make_sandbox(limits=CAPPED))
    await sb.exec("echo x > kept.txt")
    assert is_mount_point(sb.workdir)
    await sb.close()
    assert not is_mount_point(sb.workdir)
    assert not os.path.exists(sb.workdir)


async def test_a_dropped_sandbox_is_unmounted_by_its_finalizer():
    sb = BwrapSandbox(limits=CAPPED)
    workdir, was_capped = sb.workdir, sb.workdir_capped
    assert (await sb.exec("echo x > kept.txt")).exit_code == 0
    del sb
    gc.collect()
    assert not is_mount_point(workdir)
    assert not os.path.exists(workdir)
    if not was_capped:
        pytest.skip("this process may not mount a tmpfs: only the plain directory was checked")


async def test_without_mount_rights_it_falls_back_to_a_plain_directory(make_sandbox, monkeypatch):
    monkeypatch.setattr(bwrap_backend, "mount_tmpfs", lambda *args, **kwargs: False)
    sb = make_sandbox(limits=CAPPED)
    assert not sb.workdir_capped and not is_mount_point(sb.workdir)
    assert (await sb.exec("echo plain > a.txt")).exit_code == 0
    assert await sb.read_file("a.txt") == b"plain\n"
    if sb.cgroup is not None and sb.cgroup.version == 1:
        limit = (sb.cgroup.dirs["memory"] / "memory.limit_in_bytes").read_text()
        # No work-dir tmpfs pages to make room for; /tmp's (bwrap's own tmpfs) still.
        assert int(limit) == CAPPED.memory_mb * MIB + 64 * MIB
    await sb.close()
    assert not os.path.exists(sb.workdir)


def test_a_process_without_mount_rights_gets_false_not_an_error(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to an unprivileged uid")
    target = tmp_path / "wd"
    target.mkdir()
    # Imports happen as root; then the process drops to nobody (and so loses
    # CAP_SYS_ADMIN) before it asks for the mount.
    code = (
        "import os, sys\n"
        "from sandbox.tmpfs import mount_tmpfs\n"
        "os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)\n"
        "print(mount_tmpfs(sys.argv[1], size_bytes=1 << 20, max_inodes=16, uid=65534, gid=65534))\n"
    )
    repo = Path(__file__).resolve().parents[3]
    run = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "False\n"
    assert not is_mount_point(str(target))


# /tmp: its own capped filesystem, charged beside memory_mb and not against it.
TMP_MB = 48
TMP_LIMITS = SandboxLimits(
    wall_time_s=20, cpu_time_s=10, memory_mb=192, max_workdir_bytes=CAP_BYTES
)
# Holds sys.argv[1] MiB of touched memory, then says so.
HOLD = """
import sys
block = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("held", len(block) >> 20)
"""


async def test_tmp_is_capped_and_not_charged_to_memory_mb(make_sandbox):
    sb = capped(make_sandbox(limits=TMP_LIMITS, tmp_size_mb=TMP_MB, tmp_max_files=CAP_FILES))
    assert sb.tmp_capped and is_mount_point(sb.tmpdir)
    fill = await sb.exec(f"cd /tmp && python3 -c '{FILL}' {2 * TMP_MB * MIB}")
    assert fill.exit_code == 1, fill
    code, written = fill.stderr.split()
    assert code == "ENOSPC" and TMP_MB * MIB - MIB <= int(written) <= TMP_MB * MIB
    # With /tmp full, the processes still have their whole memory_mb (less the
    # interpreter's own): /tmp's pages are charged on top of it, not against it.
    held = await sb.exec(["python3", "-c", HOLD, "150"])
    assert held.status is ExecStatus.FINISHED and held.stdout == "held 150\n", held
    files = await sb.exec(f"cd /tmp && rm fill.bin && python3 -c '{MAKE_FILES}' {2 * CAP_FILES}")
    code, made = files.stderr.split()
    assert code == "ENOSPC" and int(made) == CAP_FILES
    await sb.reset()  # the next user of the sandbox finds /tmp empty
    assert (await sb.exec("ls -A /tmp | wc -l")).stdout.strip() == "0"


async def test_tmp_mount_goes_with_the_sandbox(make_sandbox):
    sb = capped(make_sandbox(limits=TMP_LIMITS))
    tmpdir = sb.tmpdir
    assert (await sb.exec("echo x > /tmp/kept && cat /tmp/kept")).stdout == "x\n"
    await sb.close()
    assert not is_mount_point(tmpdir) and not os.path.exists(tmpdir)
