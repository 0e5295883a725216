"""What an agent reads of a page: element ids (`bid`) and the accessibility tree as text.

Every element gets a ``data-bid`` attribute (a short number, stable for the element's
life in the episode; new elements get new numbers), so an action can name it:
``click('12')``. The accessibility tree comes from Chromium itself (CDP
``Accessibility.getFullAXTree``), mapped to bids through the DOM's backend node ids
(``DOM.getDocument``). An observation costs one ``evaluate`` (marking new elements,
reading the focus and the task's chrome) and then the two CDP reads, which the env sends
together with its screenshot and the task's score (:func:`build_tree` takes their
answers), so a step pays about two round trips, not six.

Two renderings:

- :func:`flatten` — the whole tree, one node per line, indented by depth
  (``[12] button 'Yes'``), BrowserGym's ``axtree_txt``;
- :func:`compact` — only what a small model needs to act: interactive elements and
  visible text under the task's root element, one short line each, no indentation,
  bounded in length; the white-box agent reads this one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envs.browser.cdp import Cdp

BID_ATTR = "data-bid"

MARK_BIDS_JS = """(chromeSelectors) => {
  let next = window.__afNextBid || 1;
  for (const el of document.querySelectorAll('body, body *')) {
    if (!el.hasAttribute('data-bid')) el.setAttribute('data-bid', String(next++));
  }
  window.__afNextBid = next;
  const chrome = [];
  for (const sel of chromeSelectors) {
    for (const root of document.querySelectorAll(sel)) {
      for (const el of [root, ...root.querySelectorAll('[data-bid]')]) {
        chrome.push(el.getAttribute('data-bid'));
      }
    }
  }
  const focused = document.activeElement;
  const focusedBid = focused && focused !== document.body ? focused.getAttribute('data-bid') : null;
  return [focusedBid, chrome, document.title];
}"""

# Bids are numbered in document order from 1 on a fresh page; a recycled page is
# numbered afresh, so the same task state reads the same either way.
UNMARK_BIDS_JS = """() => {
  for (const el of document.querySelectorAll('[data-bid]')) el.removeAttribute('data-bid');
  window.__afNextBid = 1;
}"""

INTERACTIVE = frozenset(
    {
        "button", "link", "textbox", "searchbox", "checkbox", "radio", "combobox",
        "listbox", "option", "menuitem", "menuitemcheckbox", "menuitemradio", "tab",
        "spinbutton", "slider", "switch", "treeitem", "ListBoxOption", "MenuListOption",
        "PopUpButton",
    }
)  # fmt: skip
_SKIP_ROLES = frozenset({"none", "generic", "InlineTextBox", "LineBreak", "presentation"})
_STATES = ("focused", "checked", "selected", "expanded", "disabled", "required")


@dataclass
class AXNode:
    role: str
    name: str
    bid: str | None
    depth: int
    states: list[str] = field(default_factory=list)
    value: str | None = None
    owner: str | None = None  # the bid of the nearest element at or above it

    @property
    def target(self) -> str | None:
        """The bid an action on this node names (text takes its element's)."""
        return self.bid or self.owner


@dataclass
class PageTree:
    """The flattened accessibility tree of a page, in document order."""

    nodes: list[AXNode]
    focused_bid: str | None = None

    def bids(self) -> set[str]:
        return {n.bid for n in self.nodes if n.bid}


def _value(prop: dict[str, Any] | None) -> Any:
    return None if prop is None else prop.get("value")


def _bid_by_backend_id(document: dict[str, Any]) -> dict[int, str]:
    found: dict[int, str] = {}
    stack = [document["root"]]
    while stack:
        node = stack.pop()
        attrs = node.get("attributes") or []
        for i in range(0, len(attrs) - 1, 2):
            if attrs[i] == BID_ATTR:
                found[node["backendNodeId"]] = attrs[i + 1]
                break
        stack.extend(node.get("children") or [])
        if "contentDocument" in node:
            stack.append(node["contentDocument"])
    return found


@dataclass(frozen=True)
class Marks:
    """What the marking pass saw: the focused element and the task's chrome."""

    focused_bid: str | None
    chrome: frozenset[str]
    title: str = ""


async def mark_bids(cdp: Cdp, chrome_selectors: tuple[str, ...] = ()) -> Marks:
    """Give new elements bids; read the focused bid, the page title and the bids under
    `chrome_selectors` (the task's own chrome, left out of the compact view). One round
    trip."""
    focused, chrome, title = await cdp.evaluate(MARK_BIDS_JS, list(chrome_selectors))
    return Marks(focused, frozenset(b for b in chrome if b), str(title))


async def unmark_bids(cdp: Cdp) -> None:
    """Forget every bid (a page recycled for another episode starts from 1 again)."""
    await cdp.evaluate(UNMARK_BIDS_JS)


async def read_trees(cdp: Cdp) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DOM and the accessibility tree, :func:`build_tree`'s inputs, asked for together.

    ``DOM.getDocument`` also subscribes the session to every later change of the nodes it
    returned, which the driver then forwards one by one (measured: about 80 events per
    MiniWoB++ episode, more messages than every request the env makes); ``DOM.disable``,
    sent right behind it, ends that, and the next read subscribes afresh."""
    answers = await asyncio.gather(
        cdp.send("DOM.getDocument", {"depth": -1, "pierce": True}),
        cdp.send("Accessibility.getFullAXTree"),
        cdp.send("DOM.disable"),
    )
    return answers[0], answers[1]


def build_tree(
    document: dict[str, Any], ax: dict[str, Any], focused_bid: str | None = None
) -> PageTree:
    """The flattened accessibility tree from the answers of :func:`read_trees`."""
    bids = _bid_by_backend_id(document)
    by_id = {n["nodeId"]: n for n in ax["nodes"]}
    roots = [n for n in ax["nodes"] if not n.get("parentId")]
    nodes: list[AXNode] = []

    def visit(raw: dict[str, Any], depth: int, owner: str | None) -> None:
        bid = bids.get(raw.get("backendDOMNodeId", -1))
        role = str(_value(raw.get("role")) or "")
        name = str(_value(raw.get("name")) or "").strip()
        shown = not raw.get("ignored") and role not in _SKIP_ROLES and role != "RootWebArea"
        if role == "StaticText" and not name:
            shown = False
        if shown:
            props = {p["name"]: _value(p.get("value")) for p in raw.get("properties", [])}
            states = [s for s in _STATES if props.get(s) not in (None, False, "false")]
            value = _value(raw.get("value"))
            nodes.append(
                AXNode(
                    role=role,
                    name=name,
                    bid=None if role == "StaticText" else bid,
                    depth=depth,
                    states=states,
                    value=None if value in (None, "") else str(value),
                    owner=bid or owner,
                )
            )
        for child in raw.get("childIds", []):
            if child in by_id:
                visit(by_id[child], depth + 1 if shown else depth, bid or owner)

    for root in roots:
        visit(root, 0, None)
    return PageTree(nodes, focused_bid)


def _line(node: AXNode) -> str:
    head = f"[{node.bid}] " if node.bid and node.role != "StaticText" else ""
    text = f"{head}{node.role} {node.name!r}" if node.role != "StaticText" else repr(node.name)
    if node.value is not None and node.value != node.name:
        text += f" value={node.value!r}"
    if node.states:
        text += " " + " ".join(node.states)
    return text


def flatten(tree: PageTree) -> str:
    """Every node, indented by depth (BrowserGym's ``axtree_txt``)."""
    return "\n".join("  " * n.depth + _line(n) for n in tree.nodes)


def compact(tree: PageTree, *, exclude: frozenset[str] = frozenset(), max_chars: int = 600) -> str:
    """Interactive elements and text, one short line each (``[12] button Yes``,
    ``[7] textbox ={value}``, ``[15] some text``: text carries its element's bid, since
    pages make clickable spans), leaving out nodes whose element is in `exclude` (a task's
    own chrome: its goal banner, its score display). Cut at `max_chars` with a final
    ``...``: a small model's context is short."""
    lines: list[str] = []
    last_name = last_bid = None
    for node in tree.nodes:
        if node.target in exclude:
            continue
        if node.role == "StaticText" and node.owner is not None and node.owner == last_bid:
            continue  # the text inside a control: its name or value says it already
        if node.role in INTERACTIVE and node.bid:
            last_bid = node.bid
            line = f"[{node.bid}] {node.role}"
            if node.name:
                line += f" {node.name}"
            if node.value is not None and node.value != node.name:
                line += f" ={node.value}"
            for state in ("checked", "focused", "selected"):
                if state in node.states:
                    line += f" ({state})"
            lines.append(line)
            last_name = node.name
        elif node.role == "StaticText" and node.name and node.name != last_name:
            head = f"[{node.owner}] " if node.owner else ""
            lines.append(head + node.name[:80])
    out = ""
    for line in lines:
        if len(out) + len(line) + 1 > max_chars:
            return out + "..."
        out += line + "\n"
    return out.rstrip("\n")
