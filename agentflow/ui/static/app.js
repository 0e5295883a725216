// The dashboard: a hash router over five pages, each re-read every few seconds while
// shown, so a run's curves and a live episode grow as training goes.
import { lineChart } from "./chart.js";
import { SignedOut, act, api, empty, fill as put, fmt, h, session, statusBadge, table, when } from "./dom.js";
import { installTokenTips, turnTree } from "./tree.js";

const POLL_MS = 3000;
const PAGE_SIZE = 50;
const EPISODE_STATUSES = ["pending", "running", "completed", "truncated", "failed", "aborted"];
const view = document.getElementById("view");
let timer = null;
let shown = 0; // bumped on every navigation: a late answer for an old page is dropped

function route() {
  const [path, query = ""] = (window.location.hash.slice(1) || "/runs").split("?");
  const parts = path.split("/").filter(Boolean);
  const params = new URLSearchParams(query);
  if (parts[0] === "runs" && parts.length === 1) return { name: "runs", page: () => runsPage(params) };
  if (parts[0] === "runs" && parts[2] === "episodes") return { name: "runs", page: () => episodesPage(parts[1], params) };
  if (parts[0] === "runs") return { name: "runs", page: () => runPage(parts[1]) };
  if (parts[0] === "episodes") return { name: "runs", page: () => episodePage(parts[1]) };
  if (parts[0] === "envs") return { name: "envs", page: envsPage };
  if (parts[0] === "engines") return { name: "engines", page: enginesPage };
  return { name: "", page: async () => ({ node: empty(`no page ${path}`) }) };
}

// A page is `async () => ({node, refresh?})`: `refresh` re-reads its data in place.
async function navigate() {
  clearInterval(timer);
  const mine = ++shown;
  const { name, page } = route();
  for (const link of document.querySelectorAll("[data-nav]")) {
    link.classList.toggle("active", link.dataset.nav === name);
  }
  document.getElementById("tip").hidden = true;
  try {
    const { node, refresh } = await page();
    if (mine !== shown) return;
    view.replaceChildren(node);
    view.dataset.page = name;
    if (refresh) {
      timer = setInterval(async () => {
        try {
          if (mine === shown) await refresh();
        } catch (error) {
          if (!(error instanceof SignedOut)) console.warn(error);
        }
      }, POLL_MS);
    }
  } catch (error) {
    if (error instanceof SignedOut || mine !== shown) return;
    put(view, h("p", { class: "error", role: "alert" }, String(error.message || error)));
  }
}

function counts(episodes) {
  const entries = Object.entries(episodes || {});
  if (!entries.length) return "none";
  return entries.map(([status, count]) => `${count} ${status}`).join(", ");
}

// ---- runs -------------------------------------------------------------------------

async function runsPage(params) {
  const offset = Number(params.get("offset") || 0);
  const holder = h("div");
  const fill = async () => {
    const runs = await api(`/runs?limit=${PAGE_SIZE}&offset=${offset}`);
    const rows = runs.items.map((run) =>
      h(
        "tr",
        { dataset: { runId: run.id } },
        h("td", {}, h("a", { href: `#/runs/${run.id}` }, run.name)),
        h("td", {}, statusBadge(run.status)),
        h("td", { class: "num" }, run.weight_version),
        h("td", {}, run.algorithm),
        h("td", {}, counts(run.episodes)),
        h("td", {}, when(run.created_at)),
      ),
    );
    const pager = h("nav", { class: "pager" });
    if (offset > 0) pager.append(h("a", { href: `#/runs?offset=${Math.max(0, offset - PAGE_SIZE)}`, rel: "prev" }, "← newer"));
    if (runs.total > PAGE_SIZE) pager.append(h("span", { class: "range" }, `${offset + 1}–${offset + runs.items.length} of ${runs.total}`));
    if (offset + runs.items.length < runs.total) pager.append(h("a", { href: `#/runs?offset=${offset + PAGE_SIZE}`, rel: "next" }, "older →"));
    put(
      holder,
      runs.items.length
        ? table(["Run", "Status", "Weight version", "Algorithm", "Episodes", "Created"], rows, { class: "runs" })
        : empty("No runs yet: start one with `agentflow runs create` or `POST /v1/runs`."),
      pager,
    );
  };
  await fill();
  return { node: h("section", {}, h("h1", {}, "Runs"), holder), refresh: fill };
}

const CURVES = [
  { name: "reward", title: "Reward (mean over fresh trajectories)", series: ["reward"] },
  { name: "staleness", title: "Staleness (weight versions behind)", series: ["staleness_mean", "staleness_max"] },
  { name: "throughput", title: "Throughput (trajectories trained per second)", series: ["throughput"] },
];

const ENV_FIGURES = [
  { figure: "reward", title: "Reward by env" },
  { figure: "episodes", title: "Episodes by env (per step)" },
  { figure: "staleness", title: "Staleness by env" },
];

// The run's controls: pause or resume, stop (asked twice), and the env mix editor.
function runControls(run, { onDone, onError }) {
  const live = run.status === "running" || run.status === "paused";
  if (!live) return [];
  const send = async (action) => {
    try {
      onDone(await act(`/runs/${run.id}/${action}`));
    } catch (error) {
      onError(error);
    }
  };
  const buttons = [];
  if (run.status === "running") buttons.push(h("button", { type: "button", dataset: { action: "pause" }, onclick: () => send("pause") }, "Pause"));
  if (run.status === "paused") buttons.push(h("button", { type: "button", dataset: { action: "resume" }, onclick: () => send("resume") }, "Resume"));
  const sure = h("button", { type: "button", class: "danger", hidden: true, dataset: { action: "stop" }, onclick: () => send("stop") }, "Stop the run: its live episodes are aborted");
  const stop = h("button", { type: "button", class: "danger", dataset: { action: "ask-stop" }, onclick: () => { sure.hidden = false; stop.hidden = true; } }, "Stop…");
  return [...buttons, stop, sure];
}

function mixEditor(run, { onDone, onError, onEdit }) {
  const rows = run.mix.envs.map((entry) => {
    const weight = h("input", { type: "number", step: "any", min: "0", value: entry.weight, "aria-label": `weight of ${entry.id}`, oninput: onEdit });
    const cap = h("input", { type: "number", step: "1", min: "1", value: entry.max_concurrency, "aria-label": `cap of ${entry.id}`, oninput: onEdit });
    const remove = h("input", { type: "checkbox", "aria-label": `remove ${entry.id}`, onchange: onEdit });
    return { entry, weight, cap, remove, row: h("tr", { dataset: { env: entry.id } }, h("td", {}, h("code", {}, entry.id)), h("td", {}, weight), h("td", {}, cap), h("td", {}, remove)) };
  });
  const addId = h("input", { class: "env-id", type: "text", placeholder: "env id to add", "aria-label": "env id to add", oninput: onEdit });
  const addWeight = h("input", { type: "number", step: "any", min: "0", value: "1", "aria-label": "weight of the added env", oninput: onEdit });
  const apply = async () => {
    const envs = rows
      .filter((r) => !r.remove.checked)
      .map((r) => ({ ...r.entry, weight: Number(r.weight.value), max_concurrency: Number(r.cap.value) }));
    if (addId.value.trim()) envs.push({ id: addId.value.trim(), weight: Number(addWeight.value) });
    try {
      onDone(await act(`/runs/${run.id}/envs`, "PATCH", { revision: run.mix.revision, envs }));
    } catch (error) {
      onError(error);
    }
  };
  const history = h(
    "ol",
    { start: "0", class: "revisions" },
    run.env_revisions.map((r) =>
      h("li", { dataset: { revision: r.revision } }, `at version ${r.weight_version}, ${when(r.created_at)}, by ${r.changed_by}: `, r.envs.map((e) => `${e.id}=${fmt(e.weight)}`).join(", ")),
    ),
  );
  return [
    h("h2", {}, `Env mix (revision ${run.mix.revision})`),
    table(["Env", "Weight", "Live cap", "Remove"], [...rows.map((r) => r.row), h("tr", {}, h("td", {}, addId), h("td", {}, addWeight), h("td"), h("td"))], { class: "mix-table" }),
    h("p", {}, h("button", { type: "button", dataset: { action: "apply-mix" }, onclick: apply }, "Apply to the next groups")),
    h("details", {}, h("summary", {}, "Revisions"), history),
  ];
}

async function runPage(runId) {
  const head = h("div");
  const controls = h("div", { class: "controls" });
  const notice = h("p", { class: "error", role: "alert", hidden: true });
  const mix = h("section", { class: "mix", hidden: true, "aria-label": "env mix" });
  const charts = h("div", { class: "charts" });
  const envCharts = h("div", { class: "charts", dataset: { charts: "envs" } });
  const extra = h("div", { class: "charts" });
  const picker = h("select", { "aria-label": "another metric" });
  const { controls: canControl } = await session();
  let chosen = "";
  let shownRevision = null; // the mix the editor shows; redrawn only when it changes
  let editing = false; // the user has typed into the editor: the poll leaves it alone
  picker.addEventListener("change", () => {
    chosen = picker.value;
    drawExtra(last);
  });
  let last = null;
  const drawExtra = (run) => {
    put(extra);
    if (run && chosen && run.curves.series[chosen]) {
      extra.append(lineChart(chosen, [{ name: chosen, points: run.curves.series[chosen] }], { name: `metric:${chosen}` }));
    }
  };
  const handlers = {
    onDone: (run) => {
      notice.hidden = true;
      editing = false;
      shownRevision = null;
      draw(run);
    },
    onError: (error) => {
      if (error instanceof SignedOut) return;
      put(notice, String(error.message || error));
      notice.hidden = false;
    },
    onEdit: () => {
      editing = true;
    },
  };
  const draw = (run) => {
    last = run;
    const series = run.curves.series;
    put(head,
      h("h1", {}, run.name, " ", statusBadge(run.status)),
      h(
        "dl",
        { class: "facts" },
        h("dt", {}, "Weight version"), h("dd", { dataset: { fact: "weight-version" } }, run.weight_version),
        h("dt", {}, "Trainer steps"), h("dd", { dataset: { fact: "steps" } }, run.curves.steps),
        h("dt", {}, "Episodes"), h("dd", {}, counts(run.episodes)),
        h("dt", {}, "Environments"), h("dd", {}, Object.entries(run.envs).map(([env, n]) => `${env} (${n})`).join(", ") || "–"),
        h("dt", {}, "Created"), h("dd", {}, when(run.created_at)),
      ),
      run.error ? h("p", { class: "error" }, run.error) : null,
      h("p", {}, h("a", { class: "button", href: `#/runs/${run.id}/episodes` }, "Episodes →")),
    );
    if (canControl) {
      put(controls, ...runControls(run, handlers));
      const live = run.status === "running" || run.status === "paused";
      mix.hidden = !live;
      if (live && run.mix.revision !== shownRevision && !editing) {
        shownRevision = run.mix.revision;
        put(mix, ...mixEditor(run, handlers));
      }
    }
    put(charts,
      ...CURVES.map((curve) =>
        lineChart(
          curve.title,
          curve.series.filter((key) => series[key]).map((key) => ({ name: key, points: series[key] })),
          { name: curve.name },
        ),
      ),
    );
    const marks = run.env_revisions
      .filter((r) => r.revision > 0)
      .map((r) => ({ x: r.weight_version, label: `mix r${r.revision}`, title: `env mix revision ${r.revision} by ${r.changed_by}` }));
    const envs = Object.keys(run.env_curves).sort();
    put(envCharts,
      ...(envs.length
        ? ENV_FIGURES.map(({ figure, title }) =>
            lineChart(
              title,
              envs.filter((env) => run.env_curves[env][figure]).map((env) => ({ name: env, points: run.env_curves[env][figure] })),
              { name: `env-${figure}`, marks },
            ),
          )
        : []),
    );
    const keys = Object.keys(series).sort();
    if (picker.options.length !== keys.length + 1) {
      put(picker, h("option", { value: "" }, "another metric…"), ...keys.map((key) => h("option", { value: key }, key)));
      picker.value = chosen;
    }
    drawExtra(run);
  };
  const fill = async () => draw(await api(`/runs/${runId}`));
  await fill();
  const node = h("section", {}, head, controls, notice, mix, charts, envCharts, h("p", {}, picker), extra);
  return { node, refresh: fill };
}

// ---- episodes ---------------------------------------------------------------------

function episodesHash(runId, params) {
  const query = params.toString();
  return `#/runs/${runId}/episodes${query ? `?${query}` : ""}`;
}

async function episodesPage(runId, params) {
  const offset = Number(params.get("offset") || 0);
  const holder = h("div");
  const query = new URLSearchParams(params);
  query.set("limit", PAGE_SIZE);
  query.set("offset", offset);
  const fill = async () => {
    const page = await api(`/runs/${runId}/episodes?${query}`);
    const rows = page.items.map((e) =>
      h(
        "tr",
        { dataset: { episodeId: e.id } },
        h("td", {}, h("a", { href: `#/episodes/${e.id}` }, e.id.slice(0, 8))),
        h("td", {}, statusBadge(e.status)),
        h("td", {}, e.env_ref),
        h("td", { class: "num" }, fmt(e.reward)),
        h("td", { class: "num" }, e.min_weight_version === null ? "–" : e.min_weight_version === e.max_weight_version ? e.min_weight_version : `${e.min_weight_version}–${e.max_weight_version}`),
        h("td", { class: "num" }, e.turns),
        h("td", {}, when(e.created_at)),
        h("td", { class: "error-cell" }, e.error || ""),
      ),
    );
    const pager = h("nav", { class: "pager" });
    const at = (to) => {
      const next = new URLSearchParams(params);
      next.set("offset", to);
      return episodesHash(runId, next);
    };
    if (offset > 0) pager.append(h("a", { href: at(Math.max(0, offset - PAGE_SIZE)), rel: "prev" }, "← newer"));
    pager.append(h("span", { class: "range" }, page.total ? `${offset + 1}–${offset + page.items.length} of ${page.total}` : "0 of 0"));
    if (offset + page.items.length < page.total) pager.append(h("a", { href: at(offset + PAGE_SIZE), rel: "next" }, "older →"));
    put(holder,
      page.items.length
        ? table(["Episode", "Status", "Env", "Reward", "Weight version", "Turns", "Created", "Error"], rows, { class: "episodes" })
        : empty("No episode matches."),
      pager,
    );
    holder.dataset.total = page.total;
  };
  // The run (for its envs) and the first page at once: one round trip, not two.
  const [run] = await Promise.all([api(`/runs/${runId}`), fill()]);
  const filters = h(
    "form",
    { class: "filters" },
    h("label", {}, "Status ", h("select", { name: "status" }, h("option", { value: "" }, "any"), EPISODE_STATUSES.map((s) => h("option", { value: s }, s)))),
    h("label", {}, "Env ", h("select", { name: "env" }, h("option", { value: "" }, "any"), Object.keys(run.envs).map((e) => h("option", { value: e }, e)))),
    h("label", {}, "Reward ≥ ", h("input", { name: "reward_min", type: "number", step: "any", size: 6 })),
    h("label", {}, "Reward ≤ ", h("input", { name: "reward_max", type: "number", step: "any", size: 6 })),
    h("label", {}, "Weight version ", h("input", { name: "weight_version", type: "number", min: 0, step: 1, size: 5 })),
    h("button", { type: "submit" }, "Filter"),
  );
  for (const field of filters.elements) {
    if (field.name && params.get(field.name) !== null) field.value = params.get(field.name);
  }
  filters.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const field of filters.elements) {
      if (field.name && field.value !== "") next.set(field.name, field.value);
    }
    window.location.hash = episodesHash(runId, next);
  });
  const node = h(
    "section",
    {},
    h("h1", {}, h("a", { href: `#/runs/${runId}` }, run.name), " · episodes"),
    filters,
    holder,
  );
  // Only the newest page moves while a run plays; older pages stay put.
  return { node, refresh: offset === 0 ? fill : undefined };
}

function countTurns(nodes) {
  return nodes.reduce((sum, node) => sum + 1 + countTurns(node.children), 0);
}

async function episodePage(episodeId) {
  const head = h("div");
  const body = h("div");
  installTokenTips(body);
  let live = true;
  const fill = async () => {
    if (!live) return;
    const episode = await api(`/episodes/${episodeId}`);
    live = episode.live;
    const versions =
      episode.min_weight_version === null
        ? "–"
        : episode.min_weight_version === episode.max_weight_version
          ? String(episode.min_weight_version)
          : `${episode.min_weight_version}–${episode.max_weight_version}`;
    put(head,
      h("h1", {}, "Episode ", h("code", {}, episode.id.slice(0, 8)), " ", statusBadge(episode.status)),
      h(
        "dl",
        { class: "facts" },
        h("dt", {}, "Run"), h("dd", {}, episode.run_id ? h("a", { href: `#/runs/${episode.run_id}/episodes` }, episode.run_name || episode.run_id) : "–"),
        h("dt", {}, "Env"), h("dd", {}, episode.env_ref || "–"),
        h("dt", {}, "Reward"), h("dd", {}, fmt(episode.reward)),
        h("dt", {}, "Weight versions"), h("dd", {}, versions),
        h("dt", {}, "Turns"), h("dd", { dataset: { fact: "turns" } }, countTurns(episode.roots)),
        h("dt", {}, "Task"), h("dd", {}, h("code", {}, JSON.stringify(episode.task))),
        h("dt", {}, "Created"), h("dd", {}, when(episode.created_at)),
      ),
      episode.error ? h("p", { class: "error" }, episode.error) : null,
      h("p", { class: "hint" }, "Hover a token for its id, log-prob and weight version. Highlighted tokens are trained; red ones had under 10% probability."),
    );
    put(body, episode.roots.length ? turnTree(episode.roots) : empty("No turns yet."));
  };
  await fill();
  return { node: h("section", {}, head, body), refresh: fill };
}

// ---- envs and engines -------------------------------------------------------------

async function envsPage() {
  const holder = h("div");
  const fill = async () => {
    const envs = await api("/envs");
    const rows = envs.items.map((env) =>
      h(
        "tr",
        { dataset: { envId: env.id } },
        h("td", {}, env.name),
        h("td", {}, env.version),
        h("td", {}, env.kind),
        h("td", {}, h("code", { class: "spec" }, JSON.stringify(env.spec))),
        h("td", { class: "num" }, env.max_concurrency),
        h("td", { class: "num live" }, env.live_sessions),
        h("td", {}, env.description || ""),
      ),
    );
    const others = envs.unregistered.map((env) =>
      h("tr", {}, h("td", {}, env.env_ref), h("td", { class: "num live" }, env.live_sessions)),
    );
    put(holder,
      envs.items.length
        ? table(["Name", "Version", "Kind", "Spec", "Concurrency", "Live sessions", "Description"], rows, { class: "envs" })
        : empty("No environment registered: `agentflow envs register` or `POST /v1/envs`."),
      others.length ? h("h2", {}, "Built-in environments in use") : null,
      others.length ? table(["Environment", "Live sessions"], others, { class: "builtin-envs" }) : null,
    );
  };
  await fill();
  return { node: h("section", {}, h("h1", {}, "Environments"), holder), refresh: fill };
}

function kvUse(engine) {
  if (!engine.kv_budget_tokens) return `${engine.kv_tokens} tokens`;
  const share = (100 * engine.kv_tokens) / engine.kv_budget_tokens;
  return `${engine.kv_tokens} / ${engine.kv_budget_tokens} tokens (${share.toFixed(1)}%)`;
}

async function enginesPage() {
  const holder = h("div");
  const fill = async () => {
    const engines = await api("/engines");
    const rows = engines.items.map((e) =>
      e.up
        ? h(
            "tr",
            { dataset: { runId: e.run_id } },
            h("td", {}, h("a", { href: `#/runs/${e.run_id}` }, e.run_name || e.run_id)),
            h("td", {}, e.engine),
            h("td", {}, e.model),
            h("td", { class: "num" }, e.weight_version),
            h("td", { class: "num queue" }, e.waiting),
            h("td", { class: "num batch" }, e.max_batch_size ? `${e.running} / ${e.max_batch_size}` : e.running),
            h("td", { class: "num" }, e.sessions),
            h("td", { class: "kv" }, kvUse(e)),
            h("td", {}, e.paused ? "paused" : "serving"),
          )
        : h("tr", { dataset: { runId: e.run_id } }, h("td", {}, e.run_name || e.run_id), h("td", { colspan: 8, class: "error" }, `down: ${e.error}`)),
    );
    put(holder,
      engines.items.length
        ? table(["Run", "Engine", "Model", "Weights", "Queue", "Batch", "Sessions", "KV cache", "State"], rows, { class: "engines" })
        : empty("No live run: engines appear here while their run plays."),
    );
  };
  await fill();
  return { node: h("section", {}, h("h1", {}, "Engines"), holder), refresh: fill };
}

window.addEventListener("hashchange", navigate);
navigate();
