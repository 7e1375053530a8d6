// Small SVG charts for the dashboard, drawn from scratch on every update (they hold a few
// hundred points at most): a line chart over time and a bar chart over time. Colours come
// from CSS classes in style.css, so the dark scheme needs nothing here.

const SVG_NS = "http://www.w3.org/2000/svg";
const PAD = { left: 58, right: 10, top: 8, bottom: 22 };

function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  parent?.append(el);
  return el;
}

/** 1, 2 or 5 times a power of ten, at least ``raw``. */
function niceStep(raw) {
  const power = 10 ** Math.floor(Math.log10(raw));
  const f = raw / power;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * power;
}

/** Scales, horizontal grid lines with their labels, and the x labels. The y axis runs
 * from 0 to a round number at least ``max`` (and at least ``floor``, so that a quiet
 * chart does not magnify noise). */
function frame(el, { t0, t1, max, floor, yFormat, xTicks }) {
  const width = el.clientWidth;
  const height = el.clientHeight;
  const step = niceStep(Math.max(max, floor) / 4);
  const top = step * Math.max(1, Math.ceil(Math.max(max, floor) / step));
  const x = (t) => PAD.left + ((t - t0) / (t1 - t0)) * (width - PAD.left - PAD.right);
  const y = (v) => PAD.top + (1 - v / top) * (height - PAD.top - PAD.bottom);
  const svg = svgEl("svg", { width, height, "aria-hidden": "true" });
  for (let i = 0; i * step <= top; i += 1) {
    const v = i * step;
    svgEl("line", { x1: PAD.left, x2: width - PAD.right, y1: y(v), y2: y(v), class: i ? "gridline" : "axis" }, svg);
    const label = yFormat(v).replace(/\.0+(?=\D|$)/, ""); // "50 kB", not "50.0 kB"
    svgEl("text", { x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end" }, svg).textContent = label;
  }
  for (const { t, label } of xTicks(width)) {
    const anchor = x(t) > width - 40 ? "end" : x(t) < PAD.left + 20 ? "start" : "middle";
    svgEl("text", { x: x(t), y: height - 5, "text-anchor": anchor }, svg).textContent = label;
  }
  return { svg, x, y, width, height };
}

/** Puts the chart in ``el`` with a tooltip that follows the pointer: ``nearest(px)``
 * gives [x, lines] for the point nearest to the pointer, or null. The pointer's place is
 * kept on the element, so the tooltip stays put while the chart is redrawn. */
function mount(el, chart, nearest) {
  const cursor = svgEl("line", {
    class: "cursor", y1: PAD.top, y2: chart.height - PAD.bottom, visibility: "hidden",
  }, chart.svg);
  let tip = el.querySelector(".chart-tip");
  if (!tip) {
    tip = document.createElement("div");
    tip.className = "chart-tip";
    tip.hidden = true;
  }
  const show = (px) => {
    const found = nearest(px);
    if (!found) return;
    const [x, lines] = found;
    cursor.setAttribute("x1", x);
    cursor.setAttribute("x2", x);
    cursor.setAttribute("visibility", "visible");
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    const left = x + 12 + tip.offsetWidth > chart.width ? x - 12 - tip.offsetWidth : x + 12;
    tip.style.left = `${Math.max(0, left)}px`;
  };
  chart.svg.addEventListener("pointermove", (e) => {
    el.dataset.pointer = String(e.clientX - chart.svg.getBoundingClientRect().left);
    show(Number(el.dataset.pointer));
  });
  chart.svg.addEventListener("pointerleave", () => {
    delete el.dataset.pointer;
    cursor.setAttribute("visibility", "hidden");
    tip.hidden = true;
  });
  el.replaceChildren(chart.svg, tip);
  if (el.dataset.pointer !== undefined) show(Number(el.dataset.pointer));
}

/** A message where the chart would be ("Collecting…", "Nothing yet"). */
export function placeholder(el, text) {
  const p = document.createElement("div");
  p.className = "placeholder";
  p.textContent = text;
  el.replaceChildren(p);
}

/** Lines over time. ``points``: [{t, <key>: value, …}] in time order, ``null`` for a
 * break; points more than ``gapS`` apart are not joined either. ``series``: [{key}], drawn
 * with the classes ``stroke-<key>`` and ``fill-<key>``. ``describe(point)``: the
 * tooltip's lines. */
export function lineChart(el, { points, t0, t1, series, floor, yFormat, xTicks, gapS, describe }) {
  const shown = points.filter((p) => p !== null && p.t >= t0);
  const max = Math.max(0, ...series.flatMap((s) => shown.map((p) => p[s.key])));
  const chart = frame(el, { t0, t1, max, floor, yFormat, xTicks });
  const base = chart.y(0).toFixed(1);
  for (const { key } of series) {
    let line = "";
    let area = "";
    let run = []; // x positions of the current unbroken stretch
    const close = () => {
      if (run.length) area += `L${run.at(-1)},${base}L${run[0]},${base}Z`;
      run = [];
    };
    let prev = null;
    for (const p of points) {
      if (p === null || p.t < t0 || (prev && p.t - prev.t > gapS)) close();
      if (p === null || p.t < t0) {
        prev = null;
        continue;
      }
      const x = chart.x(p.t).toFixed(1);
      const xy = `${x},${chart.y(p[key]).toFixed(1)}`;
      line += `${run.length ? "L" : "M"}${xy}`;
      area += `${run.length ? "L" : "M"}${xy}`;
      run.push(x);
      prev = p;
    }
    close();
    svgEl("path", { d: area, class: `area fill-${key}` }, chart.svg);
    svgEl("path", { d: line, class: `series stroke-${key}` }, chart.svg);
  }
  mount(el, chart, (px) => {
    let best = null;
    for (const p of shown) {
      if (!best || Math.abs(chart.x(p.t) - px) < Math.abs(chart.x(best.t) - px)) best = p;
    }
    return best && [chart.x(best.t), describe(best)];
  });
}

/** Bars over time. ``bars``: [{start, end, value, current}] (``current``: still filling,
 * drawn lighter). ``describe(bar)``: the tooltip's lines. */
export function barChart(el, { bars, t0, t1, floor, yFormat, xTicks, describe }) {
  const max = Math.max(0, ...bars.map((b) => b.value));
  const chart = frame(el, { t0, t1, max, floor, yFormat, xTicks });
  for (const b of bars) {
    const left = chart.x(Math.max(b.start, t0));
    const right = chart.x(Math.min(b.end, t1));
    svgEl("rect", {
      x: left + 0.5,
      width: Math.max(1, right - left - 1),
      y: chart.y(b.value),
      height: Math.max(0, chart.y(0) - chart.y(b.value)),
      class: b.current ? "bar current" : "bar",
    }, chart.svg);
  }
  mount(el, chart, (px) => {
    const bar = bars.find((b) => px >= chart.x(b.start) - 1 && px <= chart.x(b.end) + 1);
    return bar && [chart.x((bar.start + bar.end) / 2), describe(bar)];
  });
}

/** Labels for a time axis from ``t0`` to ``t1``: hours for a day or two, else days. */
export function timeTicks(t0, t1) {
  return (width) => {
    const ticks = [];
    const d = new Date(t0 * 1000);
    if (t1 - t0 <= 2 * 86400) {
      const everyH = width < 480 ? 6 : 3;
      d.setMinutes(0, 0, 0);
      for (; d.getTime() / 1000 <= t1; d.setHours(d.getHours() + 1)) {
        if (d.getTime() / 1000 >= t0 && d.getHours() % everyH === 0) {
          ticks.push({ t: d.getTime() / 1000, label: d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) });
        }
      }
    } else {
      const everyD = width < 480 ? 2 : 1;
      d.setHours(0, 0, 0, 0);
      for (let i = 0; d.getTime() / 1000 <= t1; d.setDate(d.getDate() + 1)) {
        if (d.getTime() / 1000 >= t0 && i++ % everyD === 0) {
          ticks.push({ t: d.getTime() / 1000, label: d.toLocaleDateString([], { weekday: "short", day: "numeric" }) });
        }
      }
    }
    return ticks;
  };
}
