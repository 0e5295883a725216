"""`agentflow/lookup-v0`: answer a question by chaining `lookup` calls on a key-value store.

Each episode builds a fresh random store over a few people: ``<name>.friend`` holds
another person, ``<name>.pet`` an animal. The question asks for the pet of someone's
friend (``hops=2``) or friend's friend (``hops=3``), so the answer needs at least
``hops`` chained lookups; the store changes every episode, so it cannot be memorised.

Action formats (also stated in the first observation):
- a tool call: a ``tool_calls`` action naming ``lookup`` with ``{"key": "ann.friend"}``,
  or the text ``lookup(ann.friend)`` (quotes around the key are optional);
- the answer: any other text; its last word after the last ``answer`` marker, else the
  last word of the text, compared case-insensitively (``"answer: owl"`` -> ``owl``).

Reward: 1 when the answer is right, else 0; an answer ends the episode. At most
``hops + 2`` turns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from envs.base import (
    Action,
    Message,
    Observation,
    TextAction,
    ToolCall,
    ToolCallsAction,
    tool_schema,
)
from envs.turn_env import Outcome, TurnEnv, answer_part, text_tool_call

NAMES = ("ann", "bob", "cy", "dan", "eve", "fay", "gus", "hal", "ivy", "joe")
PETS = ("cat", "dog", "owl", "fox", "eel", "bee", "yak", "ant")
_WORD = re.compile(r"[a-z]+")
_QUESTION = re.compile(r"What pet does (\w+)'s ((?:friend's )*)friend have\?")


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


class LookupEnv(TurnEnv):
    """A random friend/pet store per episode; the question needs ``hops`` lookups."""

    env_id = "agentflow/lookup-v0"
    accepted_actions = frozenset({"text", "tool_calls"})

    def __init__(self, hops: int = 2, people: int = 6) -> None:
        if not 2 <= hops <= 4:
            raise ValueError("hops must be in 2..4")
        if not hops <= people <= len(NAMES):
            raise ValueError(f"people must be in {hops}..{len(NAMES)}")
        super().__init__(max_turns=hops + 2)
        self.hops, self.people = hops, people
        self.store: dict[str, str] = {}
        self.answer = ""
        self.question = ""

    def tools(self) -> list[dict[str, Any]]:
        return [
            tool_schema(
                "lookup",
                "Read one key of the store, e.g. ann.friend or bob.pet.",
                {
                    "type": "object",
                    "properties": {"key": {"type": "string", "description": "name.field"}},
                    "required": ["key"],
                },
            )
        ]

    async def _start(self, options: dict[str, Any]) -> Observation:
        names = self.rng.sample(NAMES, self.people)
        self.store = {}
        for index, name in enumerate(names):
            # A derangement via rotation of a shuffled list: nobody is their own friend.
            self.store[f"{name}.friend"] = names[(index + 1) % len(names)]
            self.store[f"{name}.pet"] = self.rng.choice(PETS)
        start = self.rng.choice(names)
        person = start
        for _ in range(self.hops - 1):
            person = self.store[f"{person}.friend"]
        self.answer = self.store[f"{person}.pet"]
        chain = "friend's " * (self.hops - 2)
        self.question = f"What pet does {start}'s {chain}friend have?"
        return _user(f"{self.question}\nUse lookup(name.field), then reply: answer PET")

    async def _turn(self, action: Action) -> Outcome:
        if isinstance(action, ToolCallsAction):
            calls = [(call.id, call.name, call.arguments) for call in action.calls]
        else:
            assert isinstance(action, TextAction)
            parsed = text_tool_call(action.text, {"lookup"})
            if parsed is None:
                return self._judge(action.text)
            calls = [(f"call_{self.turns}", "lookup", {"key": parsed[1]})]
        messages = [
            Message(role="tool", tool_call_id=cid, name=name, content=self._lookup(name, args))
            for cid, name, args in calls
        ]
        text = "\n".join(m.content for m in messages)
        return Outcome(Observation(messages=messages, text=text), info={"tool_calls": len(calls)})

    def _lookup(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "lookup":
            return f"error: unknown tool {name!r}; the only tool is lookup"
        key = arguments.get("key")
        if not isinstance(key, str):
            return 'error: lookup needs {"key": "name.field"}'
        return self.store.get(key.strip().lower(), "not found")

    def _judge(self, text: str) -> Outcome:
        words = _WORD.findall(answer_part(text).lower())
        if not words:
            return Outcome(_user("Reply: answer PET, or call lookup(name.field)."))
        success = words[-1] == self.answer
        return Outcome(
            _user("correct" if success else "wrong"),
            reward=1.0 if success else 0.0,
            terminated=True,
            info={"success": success, "answer": self.answer},
        )

    def _state(self) -> dict[str, Any]:
        return {"question": self.question}


def oracle(history: Sequence[Observation]) -> Action:
    """Follow the friend chain one lookup at a time, then answer the pet it reaches."""
    match = _QUESTION.search(history[0].messages[0].content)
    if match is None:
        raise ValueError("oracle does not know this question")
    hops = 2 + match.group(2).count("friend's ")
    replies = [obs.messages[-1].content.strip() for obs in history[1:]]
    if len(replies) == hops:
        return TextAction(text=f"answer: {replies[-1]}")
    person = replies[-1] if replies else match.group(1)
    field = "friend" if len(replies) < hops - 1 else "pet"
    call = ToolCall(
        id=f"call_{len(replies) + 1}", name="lookup", arguments={"key": f"{person}.{field}"}
    )
    return ToolCallsAction(calls=[call])
