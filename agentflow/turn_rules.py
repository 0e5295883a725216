"""Built-in per-turn routing rules for distillation (`distill.rule`, `trainer.teachers`).

A rule is `fn(TurnContext) -> tag | None`: the Teacher Manager gives the policy turn to
the teacher whose `tags` (or name) hold the tag; None keeps the turn's episode teacher.
A rule of one's own is any `pkg.mod:fn` on the plug-in allow-list (`agentflow.plugins`).
"""

from __future__ import annotations

import re
from typing import Any

_SENTENCES = re.compile(r"[.\n!?]")
_WORD = re.compile(r"[A-Za-z][\w-]*")


def command_word(context: Any) -> str | None:
    """The first word of the observation's last sentence, lower-cased: the task a turn is
    asked to do when an env ends each observation with ``<task> <arguments>``
    (``"wrong. shift 041"`` -> ``"shift"``). None when the observation has no word."""
    text: str = context.observation
    for sentence in reversed(_SENTENCES.split(text)):
        found = _WORD.search(sentence)
        if found is not None:
            return found.group(0).lower()
    return None
