// Line charts as inline SVG: one point per step, a hover title on each point.
import { fmt } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 520;
const HEIGHT = 210;
const PAD = { left: 56, right: 14, top: 12, bottom: 30 };
const COLOURS = ["#2f6fde", "#d9822b", "#1f9d55", "#b83280"];

function el(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// A tick's label: as many decimals as the axis's spacing needs, no more.
function label(value, digits) {
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && (magnitude >= 1e5 || digits > 6)) return value.toExponential(2);
  return value.toFixed(Math.min(digits, 6));
}

function ticks(low, high, count) {
  if (low === high) return [low];
  const step = (high - low) / (count - 1);
  return Array.from({ length: count }, (_, i) => low + i * step);
}

// `lines`: [{name, points: [[x, y], ...]}]; `marks`: [{x, label}], drawn as dashed
// vertical lines (a run's env mix revisions). Returns a <figure>.
export function lineChart(title, lines, { xLabel = "weight version", name, marks = [] } = {}) {
  const figure = document.createElement("figure");
  figure.className = "chart";
  if (name) figure.dataset.chart = name;
  const caption = document.createElement("figcaption");
  caption.textContent = title;
  figure.append(caption);
  const all = lines.flatMap((line) => line.points);
  const svg = el("svg", {
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    role: "img",
    "aria-label": title,
  });
  figure.append(svg);
  if (all.length === 0) {
    svg.append(el("text", { x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle", class: "none" }, "no points yet"));
    return figure;
  }
  const xsAll = [...all.map((p) => p[0]), ...marks.map((m) => m.x)];
  let [xLow, xHigh] = [Math.min(...xsAll), Math.max(...xsAll)];
  let [yLow, yHigh] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (xLow === xHigh) [xLow, xHigh] = [xLow - 1, xHigh + 1];
  if (yLow === yHigh) [yLow, yHigh] = [yLow - 1, yHigh + 1];
  const margin = (yHigh - yLow) * 0.06;
  // A quantity that is never negative keeps its axis at or above zero.
  [yLow, yHigh] = [yLow >= 0 ? Math.max(0, yLow - margin) : yLow - margin, yHigh + margin];
  const digits = Math.max(0, Math.ceil(-Math.log10((yHigh - yLow) / 4)) + 1);
  const x = (v) => PAD.left + ((v - xLow) / (xHigh - xLow)) * (WIDTH - PAD.left - PAD.right);
  const y = (v) => HEIGHT - PAD.bottom - ((v - yLow) / (yHigh - yLow)) * (HEIGHT - PAD.top - PAD.bottom);

  const axes = el("g", { class: "axes" });
  for (const value of ticks(yLow, yHigh, 5)) {
    axes.append(el("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y(value), y2: y(value), class: "grid" }));
    axes.append(el("text", { x: PAD.left - 6, y: y(value) + 4, "text-anchor": "end" }, label(value, digits)));
  }
  const xs = [...new Set(all.map((p) => p[0]))].sort((a, b) => a - b);
  const every = Math.max(1, Math.ceil(xs.length / 8));
  xs.forEach((value, i) => {
    if (i % every === 0 || i === xs.length - 1) {
      axes.append(el("text", { x: x(value), y: HEIGHT - PAD.bottom + 16, "text-anchor": "middle" }, String(value)));
    }
  });
  axes.append(el("text", { x: WIDTH - PAD.right, y: HEIGHT - 2, "text-anchor": "end", class: "label" }, xLabel));
  svg.append(axes);
  marks.forEach((mark, index) => {
    const at = x(mark.x);
    const line = el("g", { class: "mark", "data-mark": mark.label });
    line.append(el("line", { x1: at, x2: at, y1: PAD.top, y2: HEIGHT - PAD.bottom, class: "mark-line" }));
    // Stacked, so marks at the same version stay readable.
    line.append(el("text", { x: at + 3, y: PAD.top + 10 + 11 * index, class: "mark-label" }, mark.label));
    line.append(el("title", {}, mark.title || mark.label));
    svg.append(line);
  });

  lines.forEach((line, index) => {
    const colour = COLOURS[index % COLOURS.length];
    const group = el("g", { class: "series", "data-series": line.name });
    const path = line.points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    group.append(el("polyline", { points: path, fill: "none", stroke: colour, "stroke-width": 2 }));
    for (const [px, py] of line.points) {
      const dot = el("circle", { cx: x(px), cy: y(py), r: 3, fill: colour, class: "point", "data-x": px, "data-y": py });
      dot.append(el("title", {}, `${line.name} at ${xLabel} ${px}: ${fmt(py, 4)}`));
      group.append(dot);
    }
    svg.append(group);
  });
  if (lines.length > 1) {
    const legend = document.createElement("div");
    legend.className = "legend";
    lines.forEach((line, index) => {
      const key = document.createElement("span");
      key.className = "key";
      const swatch = document.createElement("i");
      swatch.style.background = COLOURS[index % COLOURS.length];
      key.append(swatch, line.name);
      legend.append(key);
    });
    figure.append(legend);
  }
  return figure;
}
