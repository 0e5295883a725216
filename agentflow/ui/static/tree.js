// An episode's turn tree: each turn a card, its tokens spans that show their id, text,
// log-prob and weight version on hover; a turn with several children (an agent that
// edited its history, an RTPO re-roll) lays its branches side by side.
import { fmt, h } from "./dom.js";

// How a token's text is shown in its span: control characters as escapes and a line
// break as a visible mark before it, so no token is an invisible span.
function shown(text) {
  if (text === "") return "∅";
  return text
    .replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g, (c) => `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`)
    .replace(/\n/g, "↵\n");
}

function tokenSpans(turn) {
  const ids = turn.token_ids;
  const texts = turn.token_texts;
  if (!texts) {
    // No tokenizer for this run: the turn's text, and its ids as spans.
    return ids.map((id, i) => tokenSpan(turn, i, `${id} `, null));
  }
  return ids.map((_, i) => tokenSpan(turn, i, shown(texts[i]), texts[i]));
}

function tokenSpan(turn, i, text, raw) {
  const logprob = turn.logprobs ? turn.logprobs[i] : null;
  const version = turn.weight_versions ? turn.weight_versions[i] : null;
  const trained = turn.loss_mask[i] === 1;
  let cls = "tok";
  if (trained) cls += " trained";
  if (logprob !== null && logprob < -2.3) cls += " unlikely"; // under 10%
  const data = {
    index: i,
    id: turn.token_ids[i],
    logprob: logprob === null ? "" : String(logprob),
    version: version === null ? "" : String(version),
  };
  if (raw !== null) data.text = raw;
  return h("span", { class: cls, dataset: data }, text);
}

export function describeToken(span) {
  const parts = [`token ${span.dataset.id}`];
  if (span.dataset.text !== undefined) parts.push(JSON.stringify(span.dataset.text));
  if (span.dataset.logprob !== "") {
    const logprob = Number(span.dataset.logprob);
    parts.push(`log-prob ${logprob.toFixed(4)} (p ${Math.exp(logprob).toFixed(3)})`);
  }
  if (span.dataset.version !== "") parts.push(`weight version ${span.dataset.version}`);
  parts.push(span.classList.contains("trained") ? "trained" : "not trained");
  return parts.join(" · ");
}

function turnCard(turn) {
  const meta = [
    h("span", { class: `kind kind-${turn.kind}` }, turn.kind),
    h("span", {}, `depth ${turn.depth}`),
    h("span", {}, `${turn.token_ids.length} tokens`),
  ];
  if (turn.weight_versions && turn.weight_versions.length) {
    const low = Math.min(...turn.weight_versions);
    const high = Math.max(...turn.weight_versions);
    meta.push(h("span", {}, low === high ? `version ${low}` : `versions ${low}–${high}`));
  }
  if (turn.reward !== null) meta.push(h("span", { class: "reward" }, `reward ${fmt(turn.reward)}`));
  if (turn.finish_reason) meta.push(h("span", {}, turn.finish_reason));
  if (turn.is_trajectory) {
    meta.push(h("span", { class: "badge trajectory" }, `trajectory, return ${fmt(turn.trajectory_reward)}`));
  }
  const card = h(
    "article",
    { class: `turn kind-${turn.kind}`, dataset: { turnId: turn.id, depth: turn.depth } },
    h("header", {}, meta),
  );
  if (turn.images.length) {
    card.append(
      h(
        "div",
        { class: "shots" },
        turn.images.map((url) =>
          h("a", { href: url, target: "_blank", rel: "noopener" }, h("img", { class: "shot", src: url, alt: "observation" })),
        ),
      ),
    );
  }
  const body = h("div", { class: "tokens" }, tokenSpans(turn));
  if (!turn.token_texts && turn.text) card.append(h("pre", { class: "text" }, turn.text));
  card.append(body);
  return card;
}

function subtree(turn) {
  const column = h("div", { class: "chain" });
  let node = turn;
  // A chain of single children stays one column; a fork becomes side-by-side branches.
  for (;;) {
    column.append(turnCard(node));
    if (node.children.length === 1) {
      node = node.children[0];
      continue;
    }
    if (node.children.length > 1) {
      column.append(
        h(
          "div",
          { class: "branches", dataset: { parent: node.id, count: node.children.length } },
          node.children.map((child) => h("div", { class: "branch" }, subtree(child))),
        ),
      );
    }
    return column;
  }
}

export function turnTree(roots) {
  return h("div", { class: "tree" }, roots.map((root) => subtree(root)));
}

// One tooltip for the page, placed by the hovered token.
export function installTokenTips(container) {
  const tip = document.getElementById("tip");
  container.addEventListener("mouseover", (event) => {
    const span = event.target.closest(".tok");
    if (!span) return;
    tip.textContent = describeToken(span);
    tip.hidden = false;
    const box = span.getBoundingClientRect();
    tip.style.left = `${Math.max(4, box.left + window.scrollX)}px`;
    tip.style.top = `${box.bottom + window.scrollY + 6}px`;
  });
  container.addEventListener("mouseout", (event) => {
    if (event.target.closest(".tok")) tip.hidden = true;
  });
}
