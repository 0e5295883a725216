from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable

import pytest

from sandbox import SandboxLimits
from sandbox.bwrap import BwrapSandbox

from .procscan import sandbox_processes

if shutil.which("bwrap") is None:  # pragma: no cover - bwrap is a documented requirement
    pytest.fail("bubblewrap (bwrap) must be installed for the sandbox integration tests")


@pytest.fixture
async def make_sandbox() -> AsyncIterator[Callable[..., BwrapSandbox]]:
    """Open bwrap sandboxes; on teardown close them and prove nothing is left running."""
    opened: list[BwrapSandbox] = []

    def make(**kwargs) -> BwrapSandbox:
        kwargs.setdefault("limits", SandboxLimits(wall_time_s=5, cpu_time_s=5))
        sb = BwrapSandbox(**kwargs)
        opened.append(sb)
        return sb

    yield make
    for sb in opened:
        await sb.close()
        assert sandbox_processes(sb.id) == [], f"processes left behind by sandbox {sb.id}"
        assert sandbox_processes(sb.workdir) == []
