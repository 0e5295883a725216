"""Processes a test started, found by a tag in their environment: `AGENTFLOW_TEST_TAG`,
set on the command the test runs and inherited by whatever that starts (a gateway's
browsers, a Ray cluster's daemons and actors). Other tests' processes on the machine
never carry it, so the suite's parallel workers cannot disturb the count."""

from __future__ import annotations

import os

TAG_ENV = "AGENTFLOW_TEST_TAG"


def tagged(tag: str) -> dict[int, str]:
    """Live processes whose environment carries `AGENTFLOW_TEST_TAG=tag`: pid -> command
    line (Ray names an actor's process after it: `ray::TrainerRank...`). Zombies are left
    out: they hold nothing, and their parent reaps them."""
    marker = f"{TAG_ENV}={tag}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if marker not in environ.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                found[int(entry)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone while we looked
            continue
    return found
