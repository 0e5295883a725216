"""`agentflow stack`: the docker-compose stack's images, built offline; a profile up, healthy,
and down again.

Nothing here needs an image registry or a package index inside a container:

* the base image is Debian bookworm made with ``debootstrap`` from the mirror the host's
  apt uses, then ``docker import``-ed (:func:`build_base_image`);
* the Python packages are a wheelhouse made on the host (:func:`build_wheelhouse`):
  ``docker/wheels/deps/`` (every dependency, rebuilt only when ``pyproject.toml``
  changes) and ``docker/wheels/agentflow/`` (this project's wheel, rebuilt every time);
  the Dockerfiles install from it with ``--no-index``;
* the Docker engine is started in the background when none answers
  (:func:`start_engine`), with host networking only (``--bridge=none``): every service
  of the stack uses ``network_mode: host``, so no bridge network or private-range
  address is ever made.

docs/compose.md describes the services and the profiles.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentflow.errors import AgentFlowError

COMPOSE_FILE = "docker-compose.yml"
BASE_IMAGE = "agentflow-base:bookworm"
SANDBOX_RUNTIME_IMAGE = "agentflow-sandbox-runtime"
DEFAULT_TAG = "local"
SUITE = "bookworm"
PROFILES = ("cpu", "gpu", "vllm")
# The extras the images carry: the local engine and trainer (torch), the env suites, and
# the docker SDK (the sandbox service's backend in the stack).
IMAGE_EXTRAS = ("torch", "envs", "docker")
# The images' Python is Debian bookworm's; the wheelhouse must be built for the same one.
IMAGE_PYTHON = (3, 11)
WHEEL_DATE_EPOCH = "315532800"  # 1980-01-01, the earliest date a zip file holds
PROJECT_LABEL = "com.docker.compose.project"
ONEOFF_LABEL = "com.docker.compose.oneoff"  # "True" on a `docker-compose run` container
SERVICE_LABEL = "com.docker.compose.service"


class StackError(AgentFlowError):
    """A step of building, starting or stopping the stack failed; the message says which."""


def _run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    capture: bool = True,
    timeout: float | None = None,
    what: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command; a non-zero exit is a StackError carrying its last output lines."""
    try:
        done = subprocess.run(
            list(argv),
            env={**os.environ, **(env or {})},
            capture_output=capture,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as exc:
        raise StackError(f"{argv[0]} is not installed (see README: the set-up command)") from exc
    except subprocess.TimeoutExpired as exc:
        raise StackError(f"{what or argv[0]} did not finish within {timeout:.0f} s") from exc
    if done.returncode != 0:
        tail = "\n".join(((done.stdout or "") + (done.stderr or "")).splitlines()[-20:])
        raise StackError(f"{what or ' '.join(argv[:3])} failed (exit {done.returncode}):\n{tail}")
    return done


# --- the engine ------------------------------------------------------------------------


def engine_running() -> bool:
    """Whether a Docker engine answers the client."""
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@dataclass
class StartedEngine:
    """A dockerd this process started; :meth:`stop` ends it (containers stop with it)."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, timeout: float = 60.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_engine(log_path: Path, timeout: float = 60.0) -> StartedEngine | None:
    """Start dockerd with host networking only, unless an engine already answers (None).

    ``--bridge=none --iptables=false --ip-masq=false``: no ``docker0`` bridge, no NAT
    rules. Containers can still ask for a bridge network by name; the stack never does.
    """
    if engine_running():
        return None
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise StackError("no Docker engine answers and dockerd is not installed (docker.io)")
    if os.geteuid() != 0:
        raise StackError("no Docker engine answers, and starting dockerd needs root")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [dockerd, "--bridge=none", "--iptables=false", "--ip-masq=false"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for the caller does not reach it
        )
    started = StartedEngine(process, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"dockerd exited with {process.returncode}; see {log_path}")
        if engine_running():
            return started
        time.sleep(0.5)
    started.stop()
    raise StackError(f"dockerd did not answer within {timeout:.0f} s; see {log_path}")


# --- images ----------------------------------------------------------------------------


def image_exists(name: str) -> bool:
    probe = subprocess.run(
        ["docker", "image", "inspect", name], capture_output=True, timeout=60, check=False
    )
    return probe.returncode == 0


def debian_mirror(etc_apt: Path = Path("/etc/apt")) -> str:
    """The Debian mirror for debootstrap: AGENTFLOW_DEBIAN_MIRROR, else the host apt's own."""
    if mirror := os.environ.get("AGENTFLOW_DEBIAN_MIRROR"):
        return mirror
    sources = etc_apt / "sources.list.d"
    for path in sorted(sources.glob("*.sources")) if sources.is_dir() else []:
        for stanza in path.read_text().split("\n\n"):
            lines = [ln for ln in stanza.splitlines() if ":" in ln and not ln.startswith("#")]
            fields = dict(ln.split(":", 1) for ln in lines)
            suites = fields.get("Suites", "").split()
            if SUITE in suites and "main" in fields.get("Components", "").split():
                return fields["URIs"].split()[0]
    for path in [etc_apt / "sources.list", *sorted(sources.glob("*.list"))]:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = [w for w in line.split() if not w.startswith("[")]
            if len(words) >= 4 and words[0] == "deb" and words[2] == SUITE:
                return words[1]
    raise StackError(f"no apt source for Debian {SUITE} on this host: set AGENTFLOW_DEBIAN_MIRROR")


def build_base_image(name: str = BASE_IMAGE, *, force: bool = False) -> bool:
    """debootstrap a minimal bookworm and import it as ``name``; False if it was there."""
    if not force and image_exists(name):
        return False
    if shutil.which("debootstrap") is None:
        raise StackError("debootstrap is not installed (see README: the set-up command)")
    with tempfile.TemporaryDirectory(prefix="agentflow-rootfs-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(
            ["debootstrap", "--variant=minbase", SUITE, str(rootfs), debian_mirror()],
            timeout=1800,
            what="debootstrap",
        )
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(
                ["docker", "import", "-", name],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise StackError(f"docker import of the base image failed: {imported.stderr.strip()}")
    return True


def build_sandbox_runtime_image(
    project_dir: Path, base_image: str = BASE_IMAGE, tag: str = DEFAULT_TAG
) -> str:
    """The image Docker sandboxes run commands in (docker/sandbox-runtime.Dockerfile)."""
    name = f"{SANDBOX_RUNTIME_IMAGE}:{tag}"
    build_base_image(base_image)
    with tempfile.TemporaryDirectory() as empty_context:  # the Dockerfile copies nothing
        _run(
            [
                "docker", "build", "--network", "host",
                "--build-arg", f"BASE_IMAGE={base_image}",
                "-t", name,
                "-f", str(project_dir / "docker" / "sandbox-runtime.Dockerfile"),
                empty_context,
            ],
            timeout=1800,
            what="docker build (sandbox runtime)",
        )  # fmt: skip
    return name


def _image_requirements(project: Mapping[str, Any], extras: Sequence[str]) -> list[str]:
    """The requirements the images install: the project's and those of `extras`, an
    extra that names this project's own extras (`agentflow[docker]`) followed."""
    optional = project.get("optional-dependencies", {})
    found, todo, seen = list(project.get("dependencies", [])), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in optional.get(extra, []):
            name, _, rest = requirement.partition("[")
            if name.strip() == project["name"]:
                todo += [e.strip() for e in rest.partition("]")[0].split(",")]
            else:
                found.append(requirement)
    return sorted(found)


def _deps_key(project_dir: Path) -> str:
    """What the deps wheelhouse (and the image layer that installs it) is built from: the
    requirements alone, so a change elsewhere in pyproject.toml (a tool's settings, a
    test dependency) rebuilds neither."""
    project = tomllib.loads((project_dir / "pyproject.toml").read_text())["project"]
    requirements = _image_requirements(project, IMAGE_EXTRAS)
    return hashlib.sha256("\n".join(requirements).encode()).hexdigest()


def build_wheelhouse(project_dir: Path) -> Path:
    """``docker/wheels/``: deps (when the requirements changed) and this project's wheel."""
    if sys.version_info[:2] != IMAGE_PYTHON:
        version = ".".join(map(str, IMAGE_PYTHON))
        raise StackError(
            f"the images run Python {version} (Debian {SUITE}); build them from a Python "
            f"{version} environment so the wheels match"
        )
    wheels = project_dir / "docker" / "wheels"
    deps, own = wheels / "deps", wheels / "agentflow"
    stamp = deps / ".requirements-sha256"
    key = _deps_key(project_dir)
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check"]
    # Wheels built here carry this date, not the files' own: the same source gives the
    # same bytes, so the image layer that installs them is reused, and the layers after it
    # (the desktop image's packages) with it.
    reproducible = {"SOURCE_DATE_EPOCH": WHEEL_DATE_EPOCH}
    if not (stamp.is_file() and stamp.read_text() == key):

        def build_deps(into: Path) -> None:
            _run(
                [*pip, "--wheel-dir", str(into), f"{project_dir}[{','.join(IMAGE_EXTRAS)}]"],
                env=reproducible,
                timeout=3600,
                what="pip wheel (deps)",
            )
            for built in into.glob("agentflow-*.whl"):
                built.unlink()  # this project's wheel goes in its own layer

        _cached_wheels("deps", key, deps, build_deps)
        stamp.write_text(key)
    shutil.rmtree(own, ignore_errors=True)
    own.mkdir(parents=True)
    # setuptools builds in the checkout's build/ and keeps what it built before: a module
    # deleted since would still ship in the wheel.
    shutil.rmtree(project_dir / "build", ignore_errors=True)
    _run(
        [*pip, "--no-deps", "--wheel-dir", str(own), str(project_dir)],
        env=reproducible,
        timeout=600,
        what="pip wheel (agentflow)",
    )
    return wheels


def build_vllm_wheelhouse(project_dir: Path) -> Path:
    """``docker/wheels/vllm/``: vLLM's CPU build and everything it needs, for the `vllm`
    image (made once per vLLM release; its stamp names the release)."""
    from agentflow.inference.vllm_install import CPU_PACKAGE
    from agentflow.inference.vllm_wire import VLLM_VERSION

    if sys.version_info[:2] != IMAGE_PYTHON:
        version = ".".join(map(str, IMAGE_PYTHON))
        raise StackError(f"the vLLM image runs Python {version}; build it from Python {version}")
    wheels = project_dir / "docker" / "wheels" / "vllm"
    stamp = wheels / ".requirement"
    requirement = f"{CPU_PACKAGE}=={VLLM_VERSION}"
    if stamp.is_file() and stamp.read_text() == requirement:
        return wheels

    def download(into: Path) -> None:
        _run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                "--only-binary", ":all:", "--dest", str(into), requirement,
            ],
            timeout=3600,
            what="pip download (vllm)",
        )  # fmt: skip

    key = hashlib.sha256(requirement.encode()).hexdigest()
    _cached_wheels("vllm", key, wheels, download)
    stamp.write_text(requirement)
    return wheels


def wheel_cache() -> Path:
    """Where built wheelhouses are kept between checkouts (`AGENTFLOW_WHEEL_CACHE`)."""
    configured = os.environ.get("AGENTFLOW_WHEEL_CACHE")
    if configured:
        return Path(configured)
    home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(home) / "agentflow" / "wheels"


def _cached_wheels(name: str, key: str, target: Path, build: Callable[[Path], None]) -> None:
    """Fill `target` with the wheels `build` writes into a directory, reusing the set kept
    in `wheel_cache()` for `key` (the requirements they were built from): a fresh
    checkout, or a second one, copies them instead of building them again. The bytes
    are the same either way, so the image layers that install them stay cached too."""
    cache = wheel_cache()
    kept = cache / f"{name}-{key[:16]}"
    if not (kept / ".complete").is_file():
        building = cache / f".{name}-{key[:16]}-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        try:
            build(building)
            (building / ".complete").write_text(key)
            for stale in cache.glob(f"{name}-*"):  # older requirements' wheels
                shutil.rmtree(stale, ignore_errors=True)
            building.rename(kept)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for wheel in kept.iterdir():
        if wheel.name == ".complete":
            continue
        try:
            os.link(wheel, target / wheel.name)  # same file system: no copy at all
        except OSError:
            shutil.copy2(wheel, target / wheel.name)


# --- the compose project ---------------------------------------------------------------


def compose_command() -> list[str]:
    """docker-compose (v1) where installed, else the engine's `docker compose` plug-in."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


@dataclass(frozen=True)
class Stack:
    """One compose project: this checkout's docker-compose.yml under a project name."""

    project_dir: Path
    name: str = "agentflow"
    env_file: Path | None = None
    tag: str = DEFAULT_TAG
    base_image: str = BASE_IMAGE
    profiles: tuple[str, ...] = ("cpu",)
    environment: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.project_dir / COMPOSE_FILE).is_file():
            raise StackError(f"{self.project_dir}: no {COMPOSE_FILE} (run from the checkout)")
        unknown = sorted(set(self.profiles) - set(PROFILES))
        if unknown:
            raise StackError(f"unknown profiles {unknown}; known: {list(PROFILES)}")

    def _env(self) -> dict[str, str]:
        # The shell environment outranks .env for compose: the tag and base set here win.
        return {
            **self.environment,
            "AGENTFLOW_IMAGE_TAG": self.tag,
            "AGENTFLOW_BASE_IMAGE": self.base_image,
        }

    def compose(
        self,
        *args: str,
        profiles: Sequence[str] | None = None,
        timeout: float | None = 600,
        capture: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        argv = [
            *compose_command(),
            "--project-directory", str(self.project_dir),
            "-f", str(self.project_dir / COMPOSE_FILE),
            "-p", self.name,
        ]  # fmt: skip
        if self.env_file is not None:
            argv += ["--env-file", str(self.env_file)]
        for profile in self.profiles if profiles is None else profiles:
            argv += ["--profile", profile]
        return _run(
            [*argv, *args],
            env=self._env(),
            timeout=timeout,
            capture=capture,
            what=f"compose {args[0]}",
        )

    def config(self) -> str:
        """The resolved compose file for these profiles (fails on an invalid file)."""
        return self.compose("config").stdout

    def build(self) -> None:
        """Every image the cpu profile runs, from the base image and the wheelhouse, and
        the vLLM image when the `vllm` profile is one of these.

        The desktop image is built FROM the agentflow image, so in a second step, after it.
        """
        build_base_image(self.base_image)
        build_wheelhouse(self.project_dir)
        build_sandbox_runtime_image(self.project_dir, self.base_image, self.tag)
        self.compose("build", "postgres", "gateway", profiles=["cpu"], timeout=3600)
        self.compose("build", "desktop", profiles=["cpu"], timeout=3600)
        if "vllm" in self.profiles:
            build_vllm_wheelhouse(self.project_dir)
            self.compose("build", "vllm", profiles=["vllm"], timeout=3600)

    def up(self, *services: str, timeout: float = 600) -> None:
        """Start the profile's services (or the ones named), then wait until each is healthy."""
        self.compose("up", "-d", "--no-build", *services, timeout=timeout)
        self.wait_healthy(services or self.services(), timeout=timeout)

    def services(self) -> tuple[str, ...]:
        """The services these profiles run (docker-compose v1's ``config`` lists them all)."""
        resolved = yaml.safe_load(self.config())["services"]
        return tuple(
            name
            for name, service in resolved.items()
            if not service.get("profiles") or set(service["profiles"]) & set(self.profiles)
        )

    def container(self, service: str) -> str | None:
        """The service's container (not a one-off `run`), by the labels compose puts on
        it: the docker CLI answers in a few ms where `docker-compose ps` takes most of a
        second of CPU, and health is polled with this once a second per service."""
        labels = {PROJECT_LABEL: self.name, SERVICE_LABEL: service, ONEOFF_LABEL: "False"}
        filters = [arg for k, v in labels.items() for arg in ("--filter", f"label={k}={v}")]
        ids = _run(["docker", "ps", "-a", "-q", *filters], timeout=60).stdout.split()
        return ids[0] if ids else None

    def state(self, service: str) -> dict[str, str]:
        """The service's container state: status, health (or ""), exit code, pid."""
        cid = self.container(service)
        if cid is None:
            return {"status": "absent", "health": "", "exit_code": "", "pid": "0"}
        fmt = (
            "{{.State.Status}}|{{if .State.Health}}{{.State.Health.Status}}{{end}}"
            "|{{.State.ExitCode}}|{{.State.Pid}}|{{.RestartCount}}"
        )
        out = _run(["docker", "inspect", "-f", fmt, cid], timeout=60).stdout.strip()
        status, health, exit_code, pid, restarts = out.split("|")
        return {
            "status": status,
            "health": health,
            "exit_code": exit_code,
            "pid": pid,
            "restarts": restarts,
        }

    def wait_healthy(self, services: Sequence[str], timeout: float = 600) -> None:
        """Wait until each service with a healthcheck is healthy and the others run.

        A one-shot service (the trainer) that already exited 0 counts as done.
        """
        deadline = time.monotonic() + timeout
        pending = list(services)
        while pending:
            for service in list(pending):
                state = self.state(service)
                if state["health"] == "healthy" or (
                    not state["health"] and state["status"] == "running"
                ):
                    pending.remove(service)
                elif state["status"] == "exited" and state["exit_code"] == "0":
                    pending.remove(service)
            if not pending:
                return
            if time.monotonic() > deadline:
                logs = self.compose("logs", "--tail", "30", *pending).stdout
                raise StackError(f"not healthy after {timeout:.0f} s: {pending}\n{logs}")
            time.sleep(1.0)

    def containers(self) -> list[str]:
        """Every container of this project, running or not (by compose's project label)."""
        out = _run(
            ["docker", "ps", "-a", "-q", "--filter", f"label={PROJECT_LABEL}={self.name}"],
            timeout=60,
        ).stdout
        return out.split()

    def down(self, *, volumes: bool = True, timeout: float = 300) -> None:
        """Stop and remove every container of the project (both profiles), and its volumes."""
        args = ["down", "--remove-orphans", "--timeout", "20"]
        if volumes:
            args.append("-v")
        self.compose(*args, profiles=PROFILES, timeout=timeout)
        left = self.containers()
        if left:
            raise StackError(f"containers left after down: {left}")
