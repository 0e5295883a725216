// Small helpers shared by the pages: building elements, reading the gateway's JSON,
// formatting numbers and times. Text always goes in as text (never as HTML): episodes
// hold whatever agents and environments wrote.

export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// `node`'s children replaced by `children` (left out: null, undefined, false).
export function fill(node, ...children) {
  node.replaceChildren();
  return append(node, children);
}

export class SignedOut extends Error {}

// The dashboard's own JSON; a 401 means the session ended: the page asks for the key.
export async function api(path) {
  const answer = await fetch(`/ui/api${path}`, { credentials: "same-origin" });
  if (answer.status === 401) {
    window.location.reload();
    throw new SignedOut();
  }
  const body = await answer.json();
  if (!answer.ok) {
    const detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    throw new Error(`${answer.status}: ${detail}`);
  }
  return body;
}

// A dashboard action (pause, resume, stop, a mix change): sent with the page's token,
// which the gateway checks beside the browser's own Origin header.
let csrfToken = null;
export async function session() {
  const answer = await api("/session");
  csrfToken = answer.csrf_token;
  return answer;
}

export async function act(path, method = "POST", body = undefined) {
  if (csrfToken === null) await session();
  const answer = await fetch(`/ui/api${path}`, {
    method,
    credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrfToken },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (answer.status === 401) {
    window.location.reload();
    throw new SignedOut();
  }
  const reply = await answer.json();
  if (!answer.ok) {
    const detail = Array.isArray(reply.detail)
      ? reply.detail.map((d) => `${d.loc.slice(1).join(".")}: ${d.msg}`).join("; ")
      : String(reply.detail);
    throw new Error(`${answer.status}: ${detail}`);
  }
  return reply;
}

export function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e5)) return value.toExponential(2);
  return value.toFixed(digits);
}

export function when(iso) {
  if (!iso) return "–";
  const date = new Date(iso);
  return date.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}

export function statusBadge(status) {
  return h("span", { class: `badge status-${status}` }, status);
}

export function table(headers, rows, attrs = {}) {
  return h(
    "table",
    attrs,
    h("thead", {}, h("tr", {}, headers.map((text) => h("th", {}, text)))),
    h("tbody", {}, rows),
  );
}

export function empty(text) {
  return h("p", { class: "empty" }, text);
}
