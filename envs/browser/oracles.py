"""Scripted players that solve MiniWoB++ tasks from what an agent sees.

Each oracle reads the newest observation's message (the goal and the compact page text,
envs/browser/axtree.py) and answers the next action as the call string an agent would
write: `TextAction(text="click('12')")`. They act through the same action API as any
agent, so a warm start on their episodes teaches exactly the format RL samples.

`noisy_oracle(p_oracle, seed, oracle=...)` plays the oracle's move with probability
`p_oracle`, else a random plausible one (a click on some element of the page): the
imperfect player a warm start learns from (trainer/sft.py).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from envs.base import Observation, TextAction

Oracle = Callable[[Sequence[Observation]], TextAction]

_LINE = re.compile(r"^\[(?P<bid>[^\]]+)\] (?P<rest>.*)$")
_ROLES = ("button", "link", "textbox", "checkbox", "radio", "tab", "combobox", "option")


@dataclass(frozen=True)
class Element:
    bid: str
    role: str  # "text" for a line of text
    name: str
    value: str | None = None
    checked: bool = False


@dataclass(frozen=True)
class View:
    goal: str
    elements: tuple[Element, ...]

    def find(self, role: str, name: str | None = None) -> list[Element]:
        return [e for e in self.elements if e.role == role and (name is None or e.name == name)]

    def first(self, role: str, name: str | None = None) -> Element:
        found = self.find(role, name)
        if not found:
            raise LookupError(f"no {role} {name or ''!r} on the page")
        return found[0]


def parse_view(observation: Observation) -> View:
    """The goal and the elements of an observation's message (the compact page text)."""
    content = observation.messages[-1].content if observation.messages else ""
    lines = content.splitlines()
    goal = lines[0].removeprefix("Goal: ") if lines else ""
    elements = []
    for line in lines[1:]:
        match = _LINE.match(line)
        if not match:
            continue
        bid, rest = match["bid"], match["rest"]
        checked = " (checked)" in rest
        rest = re.sub(r"( \((checked|focused|selected)\))+$", "", rest)
        role, _, tail = rest.partition(" ")
        if role not in _ROLES:
            elements.append(Element(bid, "text", rest))
            continue
        name, _, value = (
            tail.partition(" =") if " =" in tail or tail.startswith("=") else (tail, "", "")
        )
        if tail.startswith("="):
            name, value = "", tail[1:]
        elements.append(Element(bid, role, name.strip(), value or None, checked))
    return View(goal, tuple(elements))


def _quoted(goal: str) -> list[str]:
    return re.findall(r'"([^"]*)"', goal)


def _act(call: str) -> TextAction:
    return TextAction(text=call)


def _click(element: Element) -> TextAction:
    return _act(f"click('{element.bid}')")


def _fill(element: Element, text: str) -> TextAction:
    return _act(f"fill('{element.bid}', {text!r})")


def _view(observations: Sequence[Observation]) -> View:
    return parse_view(observations[-1])


# -- one function per task ----------------------------------------------------------------


def click_button(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    return _click(view.first("button", _quoted(view.goal)[0]))


def click_link(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    target = _quoted(view.goal)[0]
    return _click(next(e for e in view.elements if e.name == target))


def click_dialog(observations: Sequence[Observation]) -> TextAction:
    return _click(_view(observations).first("button", "Close"))


def click_test(observations: Sequence[Observation]) -> TextAction:
    return _click(_view(observations).first("button"))


def click_test_2(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    name = re.search(r"Click button (\w+)\.", view.goal)
    return _click(view.first("button", name[1] if name else None))


def click_button_sequence(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    return _click(view.first("button", "ONE" if len(observations) == 1 else "TWO"))


def focus_text(observations: Sequence[Observation]) -> TextAction:
    return _click(_view(observations).first("textbox"))


def focus_text_2(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    nth = re.search(r"(\d+)(st|nd|rd|th) input", view.goal)
    boxes = view.find("textbox")
    return _click(boxes[int(nth[1]) - 1] if nth else boxes[0])


def _fill_then_submit(view: View, texts: Sequence[str], submit: str) -> TextAction:
    """Fill the text fields in order with `texts`, then click the `submit` button."""
    for box, text in zip(view.find("textbox"), texts, strict=False):
        shown = box.value or ""
        if shown != text and shown != "\u2022" * len(text):  # a password field shows bullets
            return _fill(box, text)
    return _click(view.first("button", submit))


def enter_text(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    return _fill_then_submit(view, _quoted(view.goal)[:1], "Submit")


def enter_text_2(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    text = _quoted(view.goal)[0]
    text = text.upper() if "upper case" in view.goal else text.lower()
    return _fill_then_submit(view, [text], "Submit")


def enter_password(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    password = _quoted(view.goal)[0]
    return _fill_then_submit(view, [password, password], "Submit")


def login_user(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    username, password = _quoted(view.goal)[:2]
    return _fill_then_submit(view, [username, password], "Login")


def click_checkboxes(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    match = re.search(r"Select (.*) and click Submit", view.goal)
    wanted = set() if not match or match[1] == "nothing" else set(match[1].split(", "))
    for box in view.find("checkbox"):
        if (box.name in wanted) != box.checked:
            return _click(box)
    return _click(view.first("button", "Submit"))


def click_option(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    match = re.search(r"Select (.*) and click Submit", view.goal)
    wanted = match[1] if match else ""
    for radio in view.find("radio", wanted):
        if not radio.checked:
            return _click(radio)
    return _click(view.first("button", "Submit"))


def click_tab(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    match = re.search(r"Click on (Tab #\d+)", view.goal)
    return _click(view.first("tab", match[1] if match else None))


def click_collapsible(observations: Sequence[Observation]) -> TextAction:
    view = _view(observations)
    submit = view.find("button", "Submit")
    if len(observations) > 1 and submit:
        return _click(submit[0])
    return _click(view.first("tab"))


ORACLES: dict[str, Oracle] = {
    "click-button": click_button,
    "click-link": click_link,
    "click-dialog": click_dialog,
    "click-test": click_test,
    "click-test-2": click_test_2,
    "click-button-sequence": click_button_sequence,
    "focus-text": focus_text,
    "focus-text-2": focus_text_2,
    "enter-text": enter_text,
    "enter-text-2": enter_text_2,
    "enter-text-dynamic": enter_text,
    "enter-password": enter_password,
    "login-user": login_user,
    "click-checkboxes": click_checkboxes,
    "click-option": click_option,
    "click-tab": click_tab,
    "click-collapsible": click_collapsible,
    "unicode-test": click_button,
}


def noisy_oracle(p_oracle: float, seed: int, *, oracle: Oracle) -> Oracle:
    """`oracle`'s move with probability `p_oracle`, else a click on a random control of
    the page (any element when it shows none). Seeded: one per episode replays exactly."""
    if not 0.0 <= p_oracle <= 1.0:
        raise ValueError("p_oracle must be in [0, 1]")
    rng = random.Random(seed)

    def play(observations: Sequence[Observation]) -> TextAction:
        if rng.random() < p_oracle:
            return oracle(observations)
        elements = _view(observations).elements
        controls = [e for e in elements if e.role != "text"] or list(elements)
        if not controls:
            return _act("noop()")
        return _click(rng.choice(controls))

    return play
