"""`agentflow/calc-tool-v0`: arithmetic word problems solved with a sandboxed `python` tool.

Each episode draws one short word problem with two-digit numbers (hard to do in one's
head, trivial in Python). The env offers one tool, ``python(code)``, that runs the code
with ``python3`` in a sandbox (bubblewrap by default: no network, private work dir,
time/memory/output limits) and replies with its stdout.

Action formats (also stated in the first observation):
- a tool call: a ``tool_calls`` action naming ``python`` with ``{"code": "..."}``, or the
  text ``python(print(37*24))`` (everything between the first ``(`` and the last ``)``
  is the code);
- the answer: any other text; the last integer after the last ``answer`` marker, else the
  last integer in the text (``"answer: 888"`` -> 888). Text without an integer costs a
  turn and is answered with the format reminder.

Reward: 1 when the answer is right, else 0; an answer ends the episode. At most 4 turns.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
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
from envs.turn_env import Outcome, TurnEnv, answer_part, last_integer, text_tool_call
from sandbox import ExecStatus, Sandbox, SandboxLimits, open_sandbox

Values = dict[str, int]


def _product(rng: random.Random) -> Values:
    return {"a": rng.randint(12, 99), "b": rng.randint(12, 99)}


def _coins(rng: random.Random) -> Values:
    a = rng.randint(30, 99)
    return {"a": a, "b": rng.randint(10, a), "c": rng.randint(12, 99)}


def _seats(rng: random.Random) -> Values:
    a, b = rng.randint(12, 40), rng.randint(12, 40)
    return {"a": a, "b": b, "c": rng.randint(10, a * b // 2)}


def _share(rng: random.Random) -> Values:
    a = rng.randint(3, 19)
    return {"a": a, "n": a * rng.randint(12, 60)}


# (question, the Python expression that answers it, how its numbers are drawn, its value).
# The oracle reads the numbers back with the question's regex, so each question must be
# unambiguous.
Problem = tuple[str, str, Callable[[random.Random], Values], Callable[[Values], int]]
PROBLEMS: tuple[Problem, ...] = (
    (
        "{a} boxes hold {b} pens each. How many pens?",
        "{a}*{b}",
        _product,
        lambda v: v["a"] * v["b"],
    ),
    (
        "Tom had {a} coins, spent {b}, then got {c}. How many now?",
        "{a}-{b}+{c}",
        _coins,
        lambda v: v["a"] - v["b"] + v["c"],
    ),
    (
        "A hall has {a} rows of {b} seats and {c} are taken. How many are free?",
        "{a}*{b}-{c}",
        _seats,
        lambda v: v["a"] * v["b"] - v["c"],
    ),
    (
        "{a} kids share {n} sweets equally. How many each?",
        "{n}//{a}",
        _share,
        lambda v: v["n"] // v["a"],
    ),
)
TOOL_OUTPUT_CHARS = 200
PYTHON_TIMEOUT_S = 5.0


def _question_regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template)
    for name in ("a", "b", "c", "n"):
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>\\d+)")
    return re.compile(pattern)


_QUESTION_REGEXES = [(_question_regex(q), expr) for q, expr, _, _ in PROBLEMS]
_INSTRUCTIONS = "Use python(code) to compute, then reply: answer N"


def default_sandbox() -> Sandbox:
    limits = SandboxLimits(
        wall_time_s=PYTHON_TIMEOUT_S,
        cpu_time_s=PYTHON_TIMEOUT_S,
        memory_mb=256,
        max_processes=16,
        max_output_bytes=64 * 1024,
        max_file_bytes=1024 * 1024,
    )
    return open_sandbox("bwrap", limits=limits, network=False)


def _user(text: str) -> Observation:
    return Observation(messages=[Message(role="user", content=text)], text=text)


class CalcToolEnv(TurnEnv):
    """One word problem per episode; answer after computing it with the `python` tool."""

    env_id = "agentflow/calc-tool-v0"
    accepted_actions = frozenset({"text", "tool_calls"})

    def __init__(
        self,
        max_turns: int = 4,
        sandbox_factory: Callable[[], Sandbox] | None = None,
        tool_timeout_s: float = PYTHON_TIMEOUT_S,
    ) -> None:
        super().__init__(max_turns=max_turns)
        if not 0 < tool_timeout_s <= 60:
            raise ValueError("tool_timeout_s must be in (0, 60]")
        self._sandbox_factory = sandbox_factory or default_sandbox
        self.tool_timeout_s = tool_timeout_s
        self._sandbox: Sandbox | None = None
        self.question = ""
        self.target = 0
        self.tool_calls = 0

    def tools(self) -> list[dict[str, Any]]:
        return [
            tool_schema(
                "python",
                "Run Python 3 code in a sandbox and return what it prints.",
                {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the program"}},
                    "required": ["code"],
                },
            )
        ]

    async def _start(self, options: dict[str, Any]) -> Observation:
        await self._release()  # a fresh sandbox per episode: no files carry over
        question, _, draw, value_of = PROBLEMS[self.rng.randrange(len(PROBLEMS))]
        values = draw(self.rng)
        self.question = question.format(**values)
        self.target = value_of(values)
        self.tool_calls = 0
        return _user(f"{self.question}\n{_INSTRUCTIONS}")

    async def _turn(self, action: Action) -> Outcome:
        if isinstance(action, ToolCallsAction):
            calls = [(call.id, call.name, call.arguments) for call in action.calls]
        else:
            assert isinstance(action, TextAction)
            parsed = text_tool_call(action.text, {"python"})
            if parsed is None:
                return self._answer(action.text)
            calls = [(f"call_{self.turns}", "python", {"code": parsed[1]})]
        messages = [
            Message(role="tool", tool_call_id=cid, name=name, content=await self._run(name, args))
            for cid, name, args in calls
        ]
        text = "\n".join(m.content for m in messages)
        return Outcome(Observation(messages=messages, text=text), info={"tool_calls": len(calls)})

    def _answer(self, text: str) -> Outcome:
        value = last_integer(answer_part(text))
        if value is None:
            reminder = "Reply: answer N (a whole number), or call python(code)."
            return Outcome(_user(reminder))
        success = value == self.target
        verdict = "correct" if success else "wrong"
        return Outcome(
            _user(verdict),
            reward=1.0 if success else 0.0,
            terminated=True,
            info={"success": success, "target": self.target, "tool_calls_total": self.tool_calls},
        )

    async def _run(self, name: str, arguments: dict[str, Any]) -> str:
        if name != "python":
            return f"error: unknown tool {name!r}; the only tool is python"
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return 'error: python needs {"code": "..."}'
        self.tool_calls += 1
        if self._sandbox is None:
            self._sandbox = self._sandbox_factory()
        result = await self._sandbox.exec(
            ["python3", "-I", "-"], stdin=code, timeout_s=self.tool_timeout_s
        )
        if result.status is not ExecStatus.FINISHED:
            return f"error: {result.status.value.replace('_', ' ')}"
        if result.exit_code != 0:
            lines = result.stderr.strip().splitlines()
            last = lines[-1] if lines else f"exit code {result.exit_code}"
            return "error: " + last[:TOOL_OUTPUT_CHARS]
        output = result.stdout.strip()
        return output[:TOOL_OUTPUT_CHARS] if output else "(no output; use print)"

    def _state(self) -> dict[str, Any]:
        return {"question": self.question, "tool_calls": self.tool_calls}

    async def _release(self) -> None:
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            await sandbox.close()


def oracle(history: Sequence[Observation]) -> Action:
    """Compute the problem's expression with the `python` tool, then answer its output."""
    question = history[0].messages[0].content.splitlines()[0]
    if len(history) == 1:
        for regex, expression in _QUESTION_REGEXES:
            match = regex.fullmatch(question)
            if match:
                code = f"print({expression.format(**match.groupdict())})"
                call = ToolCall(id="call_1", name="python", arguments={"code": code})
                return ToolCallsAction(calls=[call])
        raise ValueError(f"oracle does not know this question: {question!r}")
    return TextAction(text=f"answer: {history[-1].messages[-1].content.strip()}")
