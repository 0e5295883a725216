"""A recording fake of the docker SDK surface the Docker backend uses (no engine here).

It keeps an in-memory file tree for put_archive/get_archive and runs scripted execs, so
tests can assert the exact parameters the backend sends and what it does with answers.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScriptedExec:
    """What one exec does: the output chunks it streams, its exit code, how long it takes."""

    chunks: list[tuple[bytes | None, bytes | None]] = field(default_factory=list)
    exit_code: int = 0
    delay_s: float = 0.0


class NotFound(Exception):
    pass


class FakeVolume:
    def __init__(self, client: FakeDockerClient, name: str, labels: dict[str, str]) -> None:
        self.client, self.name, self.labels = client, name, labels

    def remove(self, force: bool = False) -> None:
        self.client.calls.append(("volumes.remove", self.name, {"force": force}))
        self.client.volume_list.remove(self)


class FakeContainer:
    def __init__(self, client: FakeDockerClient, kwargs: dict[str, Any]) -> None:
        self.client = client
        self.id = f"c{len(client.container_list)}"
        self.labels = kwargs.get("labels", {})
        self.files: dict[str, bytes] = {}
        self.owners: dict[str, tuple[int, int]] = {}
        self.attrs: dict[str, Any] = {"State": {"OOMKilled": False}}
        self.removed = False

    def put_archive(self, path: str, data: bytes) -> bool:
        self.client.calls.append(("put_archive", path, {}))
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    f = tar.extractfile(member)
                    assert f is not None
                    self.files[f"{path}/{member.name}"] = f.read()
                self.owners[f"{path}/{member.name}"] = (member.uid, member.gid)
        return True

    def get_archive(self, path: str) -> tuple[Iterator[bytes], dict[str, Any]]:
        self.client.calls.append(("get_archive", path, {}))
        if path not in self.files:
            raise NotFound(path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(path.rsplit("/", 1)[-1])
            info.size = len(self.files[path])
            tar.addfile(info, io.BytesIO(self.files[path]))
        data = buf.getvalue()
        return iter([data[:700], data[700:]]), {"name": path}

    def exec_run(self, cmd: list[str], **kwargs: Any) -> tuple[int, bytes]:
        self.client.calls.append(("exec_run", cmd, kwargs))
        return 0, b""

    def reload(self) -> None:
        self.client.calls.append(("reload", self.id, {}))

    def remove(self, force: bool = False) -> None:
        self.client.calls.append(("containers.remove", self.id, {"force": force}))
        self.removed = True
        self.client.container_list.remove(self)


def _matches(labels: dict[str, str], filters: dict[str, str]) -> bool:
    key, _, value = filters["label"].partition("=")
    return key in labels and (not value or labels[key] == value)


class _Containers:
    def __init__(self, client: FakeDockerClient) -> None:
        self.client = client

    def run(self, image: str, command: list[str], **kwargs: Any) -> FakeContainer:
        self.client.calls.append(("containers.run", (image, command), kwargs))
        if self.client.fail_run:
            raise RuntimeError("image not found")
        container = FakeContainer(self.client, kwargs)
        self.client.container_list.append(container)
        return container

    def list(self, all: bool = False, filters: dict[str, str] | None = None) -> list[FakeContainer]:
        self.client.calls.append(("containers.list", None, {"all": all, "filters": filters}))
        return [c for c in self.client.container_list if _matches(c.labels, filters or {})]


class _Volumes:
    def __init__(self, client: FakeDockerClient) -> None:
        self.client = client

    def create(self, name: str, **kwargs: Any) -> FakeVolume:
        self.client.calls.append(("volumes.create", name, kwargs))
        volume = FakeVolume(self.client, name, kwargs.get("labels", {}))
        self.client.volume_list.append(volume)
        return volume

    def list(self, filters: dict[str, str] | None = None) -> list[FakeVolume]:
        return [v for v in self.client.volume_list if _matches(v.labels, filters or {})]


class _Api:
    def __init__(self, client: FakeDockerClient) -> None:
        self.client = client
        self.execs: dict[str, ScriptedExec] = {}

    def exec_create(self, container: str, cmd: list[str], **kwargs: Any) -> dict[str, str]:
        self.client.calls.append(("exec_create", cmd, {"container": container, **kwargs}))
        exec_id = f"e{len(self.execs)}"
        self.execs[exec_id] = self.client.script(cmd)
        return {"Id": exec_id}

    def exec_start(
        self, exec_id: str, **kwargs: Any
    ) -> Iterator[tuple[bytes | None, bytes | None]]:
        self.client.calls.append(("exec_start", exec_id, kwargs))
        scripted = self.execs[exec_id]

        def stream() -> Iterator[tuple[bytes | None, bytes | None]]:
            time.sleep(scripted.delay_s)
            yield from scripted.chunks

        return stream()

    def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        return {"ExitCode": self.execs[exec_id].exit_code, "Running": False}


class FakeDockerClient:
    def __init__(self, script: Callable[[list[str]], ScriptedExec] | None = None) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self.container_list: list[FakeContainer] = []
        self.volume_list: list[FakeVolume] = []
        self.script = script or (lambda cmd: ScriptedExec())
        self.fail_run = False
        self.containers = _Containers(self)
        self.volumes = _Volumes(self)
        self.api = _Api(self)

    def named(self, name: str) -> list[tuple[str, Any, dict[str, Any]]]:
        return [c for c in self.calls if c[0] == name]
