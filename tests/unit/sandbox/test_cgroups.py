"""Cgroup bookkeeping against a directory laid out like cgroupfs (v2 and v1), so both
layouts are covered on hosts that only have one of them; the real cgroup is exercised by
the bwrap integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox import cgroups
from sandbox.cgroups import SandboxCgroup, create_cgroup


def test_v2_limits_events_and_kill_switch(tmp_path):
    d = tmp_path / "sbx"
    d.mkdir()
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    (d / "cgroup.procs").write_text("")
    cg = SandboxCgroup({"": d}, version=2)
    cg.set_limits(64 << 20, 16)
    assert (d / "memory.max").read_text() == str(64 << 20)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "16"
    assert cg.oom_kills() == 2 and cg.pids() == set()
    assert cg.kill_all(timeout_s=0.1)
    assert (d / "cgroup.kill").read_text() == "1"
    assert cg.procs_files == [str(d / "cgroup.procs")]


def test_v1_limits_and_oom_counter(tmp_path):
    mem, pids = tmp_path / "memory", tmp_path / "pids"
    mem.mkdir()
    pids.mkdir()
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    cg = SandboxCgroup({"memory": mem, "pids": pids}, version=1)
    cg.set_limits(32 << 20, 8)
    assert (mem / "memory.limit_in_bytes").read_text() == str(32 << 20)
    assert (mem / "memory.memsw.limit_in_bytes").read_text() == str(32 << 20)
    assert (pids / "pids.max").read_text() == "8"
    assert cg.oom_kills() == 5


def _fake_v2_root(tmp_path: Path, controllers: str, subtree: str) -> Path:
    root = tmp_path / "cgroup"
    own = root / "own"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers)
    (own / "cgroup.controllers").write_text(controllers)
    (own / "cgroup.subtree_control").write_text(subtree)
    return root


def test_create_v2_under_a_delegated_parent(tmp_path, monkeypatch):
    root = _fake_v2_root(tmp_path, "cpu memory pids", "")
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", root)
    cg = create_cgroup("sbx-1", parent=root / "own")
    assert cg is not None and cg.version == 2 and cg.dirs[""] == root / "own" / "sbx-1"
    assert (root / "own" / "cgroup.subtree_control").read_text() == "+memory +pids"


@pytest.mark.parametrize("controllers", ["cpu", "memory"])
def test_create_v2_without_memory_and_pids_falls_back(tmp_path, monkeypatch, controllers):
    root = _fake_v2_root(tmp_path, controllers, "")
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", root)
    assert create_cgroup("sbx-2", parent=root / "own") is None


def test_unwritable_host_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path / "absent")
    assert create_cgroup("sbx-3") is None
