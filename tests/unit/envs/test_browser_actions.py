"""The browser action parser: every action parses, everything else is an ActionError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.browser.actions import (
    ACTIONS,
    ActionError,
    BrowserCall,
    GotoPolicy,
    action_text,
    check_key,
    parse_call,
)

TASK_ORIGIN = GotoPolicy.only(["http://miniwob.local/"])


@pytest.mark.parametrize(
    ("text", "name", "args"),
    [
        ("click('12')", "click", {"bid": "12", "button": "left"}),
        ("click(12)", "click", {"bid": "12", "button": "left"}),
        ("click('a1', button='right')", "click", {"bid": "a1", "button": "right"}),
        ("dblclick('3')", "dblclick", {"bid": "3", "button": "left"}),
        ("fill('7', \"hello world\")", "fill", {"bid": "7", "value": "hello world"}),
        ("select_option('4', 'Red')", "select_option", {"bid": "4", "options": ["Red"]}),
        ("select_option('4', ['a', 'b'])", "select_option", {"bid": "4", "options": ["a", "b"]}),
        ("press('5', 'Control+a')", "press", {"bid": "5", "key_comb": "Control+a"}),
        ("hover('9')", "hover", {"bid": "9"}),
        ("focus('9')", "focus", {"bid": "9"}),
        ("clear('9')", "clear", {"bid": "9"}),
        ("scroll(0, -200.5)", "scroll", {"delta_x": 0, "delta_y": -200.5}),
        ("mouse_click(10, 20)", "mouse_click", {"x": 10, "y": 20, "button": "left"}),
        ("mouse_move(x=1.5, y=2)", "mouse_move", {"x": 1.5, "y": 2}),
        ("keyboard_type('abc')", "keyboard_type", {"text": "abc"}),
        ("keyboard_press('Enter')", "keyboard_press", {"key": "Enter"}),
        ("keyboard_press('Shift+Tab')", "keyboard_press", {"key": "Shift+Tab"}),
        ("goto('http://miniwob.local/x.html')", "goto", {"url": "http://miniwob.local/x.html"}),
        ("go_back()", "go_back", {}),
        ("new_tab()", "new_tab", {}),
        ("tab_focus(0)", "tab_focus", {"index": 0}),
        ("send_msg_to_user('done')", "send_msg_to_user", {"text": "done"}),
        ("noop()", "noop", {"wait_ms": 0}),
        ("noop(100)", "noop", {"wait_ms": 100}),
    ],
)
def test_every_action_parses(text: str, name: str, args: dict[str, object]) -> None:
    call = parse_call(text, TASK_ORIGIN)
    assert call == BrowserCall(name, args)
    assert parse_call(str(call), TASK_ORIGIN) == call  # str() writes a call that parses back


def test_the_table_is_the_documented_action_set() -> None:
    assert set(ACTIONS) == {
        "click", "dblclick", "fill", "select_option", "press", "hover", "focus", "clear",
        "scroll", "mouse_click", "mouse_move", "keyboard_type", "keyboard_press", "goto",
        "go_back", "new_tab", "tab_focus", "send_msg_to_user", "noop",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__import__('os')", "unknown action '__import__'"),
        ("__import__('os').system('id')", "no attributes"),
        ("page.close()", "no attributes"),
        ("click(page)", "only literal arguments"),
        ("click(bid)", "only literal arguments"),
        ("click('1' + '2')", "only literal arguments"),
        ("click(f'{1}')", "only literal arguments"),
        ("fill('1', [c for c in 'ab'])", "only literal arguments"),
        ("fill('1', ''.join('ab'))", "only literal arguments"),
        ("click(*['1'])", "only literal arguments"),
        ("click(**{'bid': '1'})", "no argument '**'"),
        ("click('1'); click('2')", "not a valid action call"),
        ("x = click('1')", "not a valid action call"),
        ("lambda: click('1')", "an action is one call"),
        ("'12'", "an action is one call"),
        ("click(", "not a valid action call"),
        ("eval('1')", "unknown action 'eval'"),
        ("exec('import os')", "unknown action 'exec'"),
        ("click()", "needs its argument 'bid'"),
        ("click('1', 'left', 3)", "at most 2 arguments"),
        ("click('1', target='x')", "no argument 'target'"),
        ("click('1', bid='2')", "'bid' twice"),
        ("click('1', button='side')", "must be one of"),
        ("click('a b')", "element id"),
        ("click('1\"]')", "element id"),
        ("click(True)", "element id"),
        ("fill('1', 3)", "must be a string"),
        ("fill('1', 'x' * 3)", "only literal arguments"),
        ("scroll('a', 1)", "must be a number"),
        ("scroll(True, 1)", "must be a number"),
        ("scroll(1e9, 1)", "out of range"),
        ("tab_focus(1.5)", "must be an integer"),
        ("select_option('1', [])", "string or a list of strings"),
        ("select_option('1', [1])", "string or a list of strings"),
        ("keyboard_press('Enterr')", "unknown key"),
        ("keyboard_press('Hyper+a')", "unknown key"),
        ("press('1', '')", "unknown key"),
        ("press('1', 5)", "key name string"),
        ("goto('file:///etc/passwd')", "scheme 'file' is not allowed"),
        ("goto('javascript:alert(1)')", "scheme 'javascript' is not allowed"),
        ("goto('http://evil.example/')", "host 'evil.example' is not allowed"),
        ("noop(10000)", "wait_ms must be between"),
        ("", "empty action"),
        ("   \n ", "empty action"),
    ],
)
def test_refusals_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ActionError, match=message.replace("(", r"\(").replace("*", r"\*")):
        parse_call(text, TASK_ORIGIN)


def test_goto_default_policy_allows_no_host() -> None:
    with pytest.raises(ActionError, match="host"):
        parse_call("goto('http://miniwob.local/')")
    assert parse_call("goto('https://a.test/p')", GotoPolicy(hosts=frozenset({"a.test"})))


def test_keys() -> None:
    for combo in ("Enter", "a", "Z", "7", "F12", "Control+Shift+Tab", "+", "Shift++"):
        assert check_key(combo) == combo
    for combo in ("enter", "Ctrl+a", "Control+", "a+b", "x" * 65):
        with pytest.raises(ActionError):
            check_key(combo)


def test_reply_text_is_the_first_line_outside_a_code_fence() -> None:
    assert action_text("  click('3')  ") == "click('3')"
    assert action_text("click('3')\nI clicked the button.") == "click('3')"
    assert action_text("```python\nfill('2', 'x')\n```") == "fill('2', 'x')"
    assert action_text("```\nclick('1')\n```") == "click('1')"
    assert parse_call("```py\nclick('1')\n```").name == "click"


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_text_never_raises_anything_else(text: str) -> None:
    try:
        parse_call(text, TASK_ORIGIN)
    except ActionError:
        pass


_fragments = st.sampled_from(
    [*ACTIONS, "(", ")", "'1'", "12", ",", "=", "bid", "button", "'left'", "[", "]", "-", "*",
     "__import__", ".", "f'x'", " ", "'Enter'", "'http://miniwob.local/'", "1e400", "lambda"]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(_fragments, max_size=12).map("".join))
def test_fuzz_call_like_text_never_raises_anything_else(text: str) -> None:
    try:
        call = parse_call(text, TASK_ORIGIN)
    except ActionError:
        return
    assert call.name in ACTIONS
