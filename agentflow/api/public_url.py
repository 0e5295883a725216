"""The URL black-box agents are handed to reach this gateway, and the check that it does.

With `AGENTFLOW_PUBLIC_URL` unset, `agentflow serve` hands agents the address it actually
binds (`served_url`): a port change can no longer leave every `http` and `container`
agent calling a port where nothing listens. When it is set (a proxy, another host name),
the gateway checks at startup that the URL reaches *this* gateway: `/livez` answers with
the instance id in `INSTANCE_HEADER`, and a URL that does not answer, or reaches another
gateway, is logged as an error naming what black-box agents will then do (time out).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

INSTANCE_HEADER = "x-agentflow-instance"
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def served_url(host: str, port: int) -> str:
    """The base URL a local agent reaches a server bound to `host:port` at."""
    host = _WILDCARDS.get(host, host)
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"http://{host}:{port}"


@dataclass
class PublicUrlCheck:
    """What the startup check found: `ok` None while it runs."""

    url: str
    ok: bool | None = None
    detail: str = ""


async def check_public_url(
    check: PublicUrlCheck, instance_id: str, *, timeout_s: float = 15.0
) -> PublicUrlCheck:
    """GET `{url}/livez` until it answers (the server may still be starting) or
    `timeout_s` passes; record whether the answer came from this gateway."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last = "no answer"
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while asyncio.get_running_loop().time() < deadline:
            try:
                response = await client.get(check.url.rstrip("/") + "/livez")
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.25)
                continue
            answered = response.headers.get(INSTANCE_HEADER)
            if answered == instance_id:
                check.ok, check.detail = True, "reaches this gateway"
                log.info("public URL %s reaches this gateway", check.url)
                return check
            last = (
                f"another gateway answered (instance {answered})"
                if answered
                else f"something that is not an AgentFlow gateway answered {response.status_code}"
            )
            break
    check.ok, check.detail = False, last
    log.error(
        "AGENTFLOW_PUBLIC_URL=%s does not reach this gateway (%s): every `http` or "
        "`container` agent is handed this URL and will fail when it calls back. Unset it "
        "to hand agents the address the gateway serves, or fix it.",
        check.url,
        last,
    )
    return check
