// The volunteerd dashboard: a client of the local control API, like the tray and the CLI.
// It polls /status every two seconds (the live numbers and charts), the experts and peers
// every five, /stats every ten, and follows /events with a long poll. It holds nothing
// the daemon does not say; a reload starts it afresh. No libraries, no build step.

import { ApiError, Unreachable, connect, forgetToken, takeToken } from "./api.js";
import { barChart, lineChart, placeholder, timeTicks } from "./charts.js";
import {
  fmtAgo, fmtBytes, fmtClock, fmtCount, fmtDuration, fmtFull, fmtRate, fmtSpan, sameDay, shortId,
} from "./format.js";

const STATUS_EVERY_MS = 2000;
const DETAILS_EVERY_MS = 5000;
const STATS_EVERY_MS = 10000;
const EVENTS_WAIT_S = 25;
const KEEP_EVENTS = 100;
const LIVE_WINDOW_S = 600;
const LIVE_GAP_S = 7; // points further apart than this are not joined by a line
const SNOOZE_S = 3600;
const LIMIT_FIELDS = ["upload_mbit", "download_mbit", "monthly_quota_gb", "duty_cycle"];
const TOTAL_FIELDS = ["forward", "backward", "samples", "compute_s", "bytes_in", "bytes_out",
  "running_s", "paused_s"];

const $ = (id) => document.getElementById(id);

function setText(id, text, { value, title } = {}) {
  const el = typeof id === "string" ? $(id) : id;
  if (el.textContent !== text) el.textContent = text;
  if (value !== undefined) el.dataset.value = String(value);
  if (title !== undefined) el.title = title;
  return el;
}

// -- the connection ------------------------------------------------------------------------

let api = null; // set by start(): connect(token, connection)
let halted = false; // no token, or the daemon refused it: nothing more to ask

const connection = {
  state: "connecting", // "up", "down"
  answered() {
    const was = this.state;
    this.state = "up";
    if (was === "up") return;
    $("banner").hidden = true;
    $("main").classList.remove("stale");
    $("main").setAttribute("aria-busy", "false");
    if (was === "down") refreshAll();
  },
  lost() {
    if (this.state === "down" || halted) return;
    this.state = "down";
    setText("banner", "Daemon not reachable — volunteerd may have stopped or restarted. "
      + "This page reconnects by itself when it answers again.");
    $("banner").hidden = false;
    $("main").classList.add("stale");
    const pill = $("state");
    pill.dataset.state = "offline";
    setText(pill, "not reachable");
    setText("state-detail", "");
    renderButtons();
    document.title = "volunteerd — not reachable";
  },
  refused() {
    lockOut("The daemon did not accept the key this page was given: it may belong to another "
      + "daemon, or this daemon's data folder has changed.");
  },
};

function lockOut(reason) {
  halted = true;
  forgetToken();
  eventsReset?.abort();
  setText("auth-reason", reason);
  $("auth").hidden = false;
  $("main").hidden = true;
  $("banner").hidden = true;
  $("actions").hidden = true;
  const pill = $("state");
  pill.dataset.state = "offline";
  setText(pill, "no access");
  setText("state-detail", "");
  renderButtons();
  document.title = "volunteerd — no access";
}

/** Calls ``fn`` now and then every ``ms`` after it finishes; returns a "run now" function. */
function every(ms, fn) {
  let timer = null;
  let busy = false;
  let again = false;
  const tick = async () => {
    clearTimeout(timer);
    if (halted) return;
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    try {
      await fn();
    } catch (err) {
      if (!(err instanceof Unreachable || err instanceof ApiError)) console.error(err);
    }
    busy = false;
    if (halted) return;
    if (again) {
      again = false;
      tick();
    } else {
      timer = setTimeout(tick, ms);
    }
  };
  return tick;
}

// -- state and the buttons -----------------------------------------------------------------

const STATE_WORDS = { running: "running", paused: "paused", snoozed: "snoozed", quota: "quota reached" };

let lastStatus = null;
let lastStats = null;
let statsDay = null; // the local date lastStats was fetched on
let startedAt = null;
let acting = false;

function stateDetail(s) {
  const parts = [];
  const snoozed = s.state === "snoozed" && s.snoozed_until != null;
  if (snoozed) {
    const left = s.snoozed_until - Date.now() / 1000;
    parts.push(`until ${fmtClock(s.snoozed_until)}${left > 0 ? ` (in ${fmtSpan(left)})` : ""}`);
  }
  if (s.state === "running" && !s.serving) parts.push("starting…");
  if (s.state !== "running" && s.serving) parts.push("stopping…");
  // A snooze's reason is its end, said above; "paused" next to the word paused says nothing.
  if (s.reason && !snoozed && s.reason !== s.state) parts.push(s.reason);
  if (s.state === "running" && s.serving && !s.reason) {
    parts.push(`serving ${s.experts.length} expert${s.experts.length === 1 ? "" : "s"}`);
  }
  return parts.join(" · ");
}

function renderButtons() {
  const live = !halted && connection.state === "up" && lastStatus != null;
  const state = lastStatus?.state;
  $("pause").disabled = !live || acting || state === "paused";
  $("resume").disabled = !live || acting || state === "running";
  $("snooze").disabled = !live || acting;
}

async function act(path, body) {
  acting = true;
  renderButtons();
  const error = $("action-error");
  error.hidden = true;
  try {
    renderStatus(await api("POST", path, body));
  } catch (err) {
    if (err instanceof ApiError && err.status !== 401) {
      setText(error, err.message);
      error.hidden = false;
    } else if (err instanceof Unreachable) {
      setText(error, "The daemon did not answer; nothing was changed.");
      error.hidden = false;
    }
  } finally {
    acting = false;
    renderButtons();
  }
}

// -- /status: the live part ----------------------------------------------------------------

function renderStatus(s) {
  if (startedAt != null && s.started_at !== startedAt) daemonRestarted();
  startedAt = s.started_at;
  lastStatus = s;

  const pill = $("state");
  pill.dataset.state = s.state;
  setText(pill, STATE_WORDS[s.state] ?? s.state);
  setText("state-detail", stateDetail(s));
  renderButtons();
  document.title = `volunteerd — ${STATE_WORDS[s.state] ?? s.state}`;
  setText("version", `v${s.version}`);

  setText("peer-id", shortId(s.peer_id), { title: s.peer_id, value: s.peer_id });
  setText("experiment", s.experiment ?? "none");
  setText("device", s.device);
  setText("uptime", fmtDuration(s.uptime_s), { title: `since ${fmtFull(s.started_at)}` });
  setText("expert-count", `${s.experts.length}`, { value: s.experts.length, title: s.experts.join(", ") });
  setText("connected-peers", fmtCount(s.connected_peers), { value: s.connected_peers });
  renderReachability(s.reachability);

  const r = s.rates;
  setText("rate-samples", fmtRate(r.samples_per_s), { value: r.samples_per_s });
  setText("rate-requests", fmtRate(r.requests_per_s), { value: r.requests_per_s });
  setBytesRate("rate-upload", r.upload_bytes_per_s);
  setBytesRate("rate-download", r.download_bytes_per_s);
  setText("limit-upload-note", limitNote(s.limits.upload_mbit));
  setText("limit-download-note", limitNote(s.limits.download_mbit));

  renderTotals(s.today);
  renderQuota(s.limits);
  showLimits(s.limits);
  pushLive(r);
  setText("updated", `Updated ${fmtClock(Date.now() / 1000, { seconds: true })}`);
}

function setBytesRate(id, bytesPerS) {
  const [number, unit] = fmtBytes(bytesPerS).split(" ");
  setText(id, number, { value: bytesPerS, title: `${fmtBytes(bytesPerS)}/s` });
  setText(`${id}-unit`, `${unit}/s`);
}

function limitNote(mbit) {
  return mbit > 0 ? `limit ${mbit} Mbit/s (${fmtBytes((mbit * 1e6) / 8)}/s)` : "no limit";
}

function renderReachability(reach) {
  const pill = $("reach-mode");
  pill.dataset.mode = reach.mode;
  setText(pill, reach.mode);
  let detail = "";
  if (reach.mode === "relayed" && reach.relay) detail = `through ${shortId(reach.relay)}`;
  else if (reach.addrs.length) detail = reach.addrs[0] + (reach.addrs.length > 1 ? ` +${reach.addrs.length - 1}` : "");
  // Relayed connections that hole punching (or a dial from this side) made direct.
  if (reach.upgraded) {
    const last = reach.last_upgrade_at ? `, last ${fmtClock(reach.last_upgrade_at)}` : "";
    detail += ` · ${reach.upgraded} upgraded to direct${last}`;
  }
  if (reach.hole_punch_failed) detail += ` · ${reach.hole_punch_failed} hole punch${reach.hole_punch_failed > 1 ? "es" : ""} failed`;
  setText("reach-detail", detail, { title: reach.addrs.join("\n") });
  const advice = $("reach-advice");
  advice.dataset.mode = reach.mode;
  setText(advice, reach.advice);
  advice.hidden = !reach.advice;
}

// -- contribution totals ---------------------------------------------------------------------

const TOTAL_ROWS = [
  ["samples", (t) => t.samples, fmtCount],
  ["requests", (t) => t.forward + t.backward, fmtCount],
  ["compute", (t) => t.compute_s, fmtDuration],
  ["up", (t) => t.bytes_out, fmtBytes],
  ["down", (t) => t.bytes_in, fmtBytes],
  ["running", (t) => t.running_s, fmtDuration],
  ["rejected", (t) => sumValues(t.rejected), fmtCount],
];

function sumValues(obj) {
  return Object.values(obj ?? {}).reduce((a, b) => a + b, 0);
}

function reasonsText(rejected) {
  return Object.entries(rejected ?? {}).sort((a, b) => b[1] - a[1])
    .map(([reason, n]) => `${reason}: ${fmtCount(n)}`).join(", ");
}

/** ``total`` (from /stats) moved to the moment of ``liveToday`` (from /status): plus what
 * today's counts gained since, or minus what they had not yet when /stats answered first.
 * So the columns agree (7 days never below today). Not across midnight: there "today"
 * restarts, and the next /stats (seconds away) brings the new day. */
function freshen(total, statsToday, liveToday) {
  if (statsDay !== new Date().toDateString()) return total;
  const out = { ...total, rejected: { ...total.rejected } };
  for (const key of TOTAL_FIELDS) out[key] += liveToday[key] - statsToday[key];
  const reasons = new Set([...Object.keys(liveToday.rejected), ...Object.keys(statsToday.rejected)]);
  for (const reason of reasons) {
    const gained = (liveToday.rejected[reason] ?? 0) - (statsToday.rejected[reason] ?? 0);
    out.rejected[reason] = (out.rejected[reason] ?? 0) + gained;
  }
  return out;
}

function renderTotals(today) {
  const periods = [["today", today]];
  if (lastStats) {
    periods.push(["week", freshen(lastStats.week, lastStats.today, today)]);
    periods.push(["all", freshen(lastStats.all_time, lastStats.today, today)]);
  }
  for (const [period, totals] of periods) {
    for (const [key, get, format] of TOTAL_ROWS) {
      const value = get(totals);
      setText(`${key}-${period}`, format(value), { value });
    }
    $(`rejected-${period}`).title = reasonsText(totals.rejected) || "nothing refused";
  }
  const reasons = reasonsText(today.rejected);
  setText("rejected-reasons", reasons ? `Refused today — ${reasons}` : "");
}

function renderQuota(limits) {
  const used = fmtBytes(limits.month_bytes);
  const text = limits.monthly_quota_gb > 0
    ? `${used} of ${limits.monthly_quota_gb} GB used this month `
      + `(${Math.min(100, (100 * limits.month_bytes) / (limits.monthly_quota_gb * 1e9)).toFixed(0)} %)`
    : `${used} sent and received this month`;
  setText("quota-use", text);
}

// -- the limits form -------------------------------------------------------------------------

const form = $("limits-form");
let limitsEdited = false; // the person is editing: live updates leave the inputs alone
let limitsShown = null; // the values the inputs were filled with

function input(field) {
  return form.elements.namedItem(field);
}

function showLimits(limits, { force = false } = {}) {
  const typing = document.activeElement?.tagName === "INPUT" && form.contains(document.activeElement);
  if (!force && (limitsEdited || typing)) return;
  for (const field of LIMIT_FIELDS) {
    const el = input(field);
    if (el.value === "" || Number(el.value) !== limits[field]) el.value = String(limits[field]);
  }
  limitsShown = { ...limits };
  limitsEdited = false;
}

function fieldError(field, message) {
  const el = input(field);
  if (!el) return false;
  el.setAttribute("aria-invalid", message ? "true" : "false");
  setText(`${el.id}-error`, message);
  return true;
}

function limitsStatus(text, bad = false) {
  const el = setText("limits-status", text);
  el.classList.toggle("bad", bad);
}

form.addEventListener("input", (e) => {
  limitsEdited = true;
  if (e.target.name) fieldError(e.target.name, "");
  limitsStatus("");
});

form.addEventListener("submit", async (e) => {
  e.preventDefault();
  for (const field of LIMIT_FIELDS) fieldError(field, "");
  limitsStatus("");
  const change = {};
  for (const field of LIMIT_FIELDS) {
    const el = input(field);
    if (el.validity.badInput) {
      fieldError(field, "not a number");
      el.focus();
      return;
    }
    if (el.value.trim() === "") continue;
    const value = Number(el.value);
    if (!Number.isFinite(value)) {
      // JSON.stringify would send 1e999 as null, which the daemon reads as "no change"
      fieldError(field, "must be a finite number");
      el.focus();
      return;
    }
    if (value !== limitsShown?.[field]) change[field] = value;
  }
  if (Object.keys(change).length === 0) {
    limitsStatus("Nothing changed.");
    limitsEdited = false;
    return;
  }
  const save = $("save-limits");
  save.disabled = true;
  try {
    const limits = await api("PATCH", "/limits", change);
    showLimits(limits, { force: true });
    renderQuota(limits);
    limitsStatus("Saved.");
    pollStatus();
  } catch (err) {
    if (err instanceof ApiError && err.status === 422 && err.field && fieldError(err.field, err.message)) {
      input(err.field).focus();
    } else if (err instanceof ApiError && err.status !== 401) {
      limitsStatus(err.message, true);
    } else if (err instanceof Unreachable) {
      limitsStatus("The daemon did not answer; nothing was saved.", true);
    }
  } finally {
    save.disabled = false;
  }
});

// -- experts and peers -----------------------------------------------------------------------

function cell(row, text, { num = false, title } = {}) {
  const td = row.insertCell();
  td.textContent = text;
  if (num) td.className = "num";
  if (title) td.title = title;
  return td;
}

function fillTable(body, rows, columns, emptyText, build) {
  const fresh = document.createDocumentFragment();
  if (rows.length === 0) {
    const tr = document.createElement("tr");
    tr.className = "empty";
    const td = tr.insertCell();
    td.colSpan = columns;
    td.textContent = emptyText;
    fresh.append(tr);
  }
  for (const item of rows) {
    const tr = document.createElement("tr");
    build(tr, item);
    fresh.append(tr);
  }
  body.replaceChildren(fresh);
}

function renderExperts(experts) {
  experts.sort((a, b) => a.uid.localeCompare(b.uid, undefined, { numeric: true }));
  fillTable($("experts-body"), experts, 10, "This machine hosts no experts right now.", (tr, e) => {
    tr.dataset.uid = e.uid;
    cell(tr, e.uid).className = "mono";
    cell(tr, fmtCount(e.forward), { num: true });
    cell(tr, fmtCount(e.backward), { num: true });
    cell(tr, fmtCount(e.samples), { num: true });
    cell(tr, fmtDuration(e.compute_s), { num: true });
    cell(tr, fmtAgo(e.last_used), { title: e.last_used == null ? "" : fmtFull(e.last_used) });
    cell(tr, fmtCount(e.waiting), { num: true });
    cell(tr, fmtCount(e.updates), { num: true });
    cell(tr, e.replicas == null ? "…" : fmtCount(e.replicas), {
      num: true, title: e.replicas == null ? "not looked up yet" : "",
    });
    cell(tr, e.checkpoint_age_s == null ? "never" : `${fmtSpan(e.checkpoint_age_s)} ago`);
  });
}

function renderPeers(peers) {
  // Peers that only keep the DHT company (other daemons, bootstrap nodes) are left out.
  const calling = peers.filter((p) => p.requests + p.refused > 0 || p.banned);
  calling.sort((a, b) => b.requests - a.requests || a.peer_id.localeCompare(b.peer_id));
  const others = calling.length > 50 ? ` and ${calling.length - 50} more` : "";
  setText("peers-more", others ? `Showing the 50 busiest${others}.` : "");
  fillTable($("peers-body"), calling.slice(0, 50), 4, "No trainer has called this machine yet.", (tr, p) => {
    cell(tr, shortId(p.peer_id), { title: p.peer_id }).className = "mono";
    cell(tr, fmtCount(p.requests), { num: true });
    cell(tr, fmtCount(p.refused), { num: true });
    const badge = document.createElement("span");
    badge.className = p.banned ? "badge bad" : "badge ok";
    badge.textContent = p.banned ? "banned" : "ok";
    tr.insertCell().append(badge);
  });
}

// -- events (long poll) ----------------------------------------------------------------------

let eventsSince = 0;
let eventsReset = null; // aborts the poll in flight when the daemon restarted
const seenEvents = new Set();

function renderEvents(events) {
  const list = $("events");
  list.querySelector(".empty")?.remove();
  for (const ev of events) {
    if (seenEvents.has(ev.id)) continue;
    seenEvents.add(ev.id);
    const li = document.createElement("li");
    li.dataset.kind = ev.kind;
    const time = document.createElement("time");
    time.dateTime = new Date(ev.time * 1000).toISOString();
    time.title = fmtFull(ev.time);
    time.textContent = fmtClock(ev.time, { seconds: sameDay(new Date(ev.time * 1000), new Date()) });
    const text = document.createElement("div");
    const kind = document.createElement("span");
    kind.className = "kind";
    kind.dataset.kind = ev.kind;
    kind.textContent = ev.kind;
    const message = document.createElement("span");
    message.className = "message";
    message.textContent = ev.message;
    text.append(kind, message);
    li.append(time, text);
    list.prepend(li);
  }
  while (list.children.length > KEEP_EVENTS) list.lastElementChild.remove();
  if (list.children.length === 0) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = "Nothing has happened yet.";
    list.append(li);
  }
}

async function followEvents() {
  renderEvents([]);
  while (!halted) {
    if (connection.state === "down") {
      await sleep(1000); // the status poll finds out when the daemon is back
      continue;
    }
    eventsReset = new AbortController();
    try {
      const got = await api("GET", `/events?since=${eventsSince}&wait_s=${EVENTS_WAIT_S}`, undefined, {
        timeoutMs: (EVENTS_WAIT_S + 10) * 1000,
        signal: eventsReset.signal,
      });
      renderEvents(got.events);
      eventsSince = got.next;
      const kinds = new Set(got.events.map((ev) => ev.kind));
      if (["state", "limits", "reachability", "started"].some((k) => kinds.has(k))) pollStatus();
      if (kinds.has("experts")) pollDetails();
    } catch (err) {
      if (eventsReset.signal.aborted) continue;
      await sleep(2000);
    }
  }
}

function daemonRestarted() {
  eventsSince = 0;
  seenEvents.clear();
  $("events").replaceChildren();
  renderEvents([]);
  eventsReset?.abort();
  live.push(null); // a gap in the live charts
  pollDetails();
  pollStats();
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// -- charts -----------------------------------------------------------------------------------

const live = []; // {t, samples, up, down} from each /status, or null where the daemon restarted

function pushLive(rates) {
  const now = Date.now() / 1000;
  live.push({ t: now, samples: rates.samples_per_s, up: rates.upload_bytes_per_s, down: rates.download_bytes_per_s });
  while (live.length && (live[0] === null || live[0].t < now - LIVE_WINDOW_S)) live.shift();
  drawLive();
}

function minutesAgoTicks(t1) {
  return (width) => {
    const every = width < 480 ? 300 : 120;
    const ticks = [];
    for (let ago = LIVE_WINDOW_S; ago >= 0; ago -= every) {
      ticks.push({ t: t1 - ago, label: ago === 0 ? "now" : `−${ago / 60} min` });
    }
    return ticks;
  };
}

function drawLiveChart(el, { series, floor, format, label }) {
  if (live.filter(Boolean).length < 2 || el.clientWidth === 0) {
    placeholder(el, "Collecting…");
    return;
  }
  const t1 = Date.now() / 1000;
  lineChart(el, {
    points: live, t0: t1 - LIVE_WINDOW_S, t1, series, floor, yFormat: format, gapS: LIVE_GAP_S,
    xTicks: minutesAgoTicks(t1),
    describe: (p) => [fmtClock(p.t, { seconds: true }), ...series.map((s) => `${s.label}: ${format(p[s.key])}/s`)],
  });
  const last = live.at(-1);
  el.setAttribute("aria-label", `${label} over the last 10 minutes; now ${
    series.map((s) => `${s.label} ${format(last[s.key])}/s`).join(", ")}`);
}

function drawLive() {
  drawLiveChart($("chart-samples"), {
    series: [{ key: "samples", label: "samples" }], floor: 1, format: fmtRate, label: "Samples per second",
  });
  drawLiveChart($("chart-bandwidth"), {
    series: [{ key: "up", label: "upload" }, { key: "down", label: "download" }],
    floor: 1000, format: fmtBytes, label: "Bandwidth",
  });
}

const HISTORY_METRICS = {
  samples: { get: (b) => b.samples, format: fmtCount, label: "samples", floor: 4 },
  requests: { get: (b) => b.forward + b.backward, format: fmtCount, label: "requests", floor: 4 },
  compute_s: { get: (b) => b.compute_s, format: fmtDuration, label: "compute", floor: 4 },
  bytes_out: { get: (b) => b.bytes_out, format: fmtBytes, label: "uploaded", floor: 4000 },
  bytes_in: { get: (b) => b.bytes_in, format: fmtBytes, label: "downloaded", floor: 4000 },
};

function drawHistory() {
  const el = $("chart-history");
  if (!lastStats || el.clientWidth === 0) return;
  const metric = HISTORY_METRICS[$("history-metric").value];
  const now = Date.now() / 1000;
  const t1 = Math.floor(now / 3600) * 3600 + 3600; // the end of this hour
  const t0 = t1 - Number($("history-range").value);
  const bars = lastStats.history
    .filter((b) => b.start + b.size_s > t0)
    .map((b) => ({ start: b.start, end: b.start + b.size_s, value: metric.get(b), current: b.start + b.size_s > now }));
  const total = bars.reduce((sum, b) => sum + b.value, 0);
  el.setAttribute("aria-label", `${metric.label} per hour; ${metric.format(total)} in the period shown`);
  if (total === 0) {
    placeholder(el, `No ${metric.label} in this period yet.`);
    return;
  }
  const hour = { hour: "2-digit", minute: "2-digit" };
  barChart(el, {
    bars, t0, t1, floor: metric.floor, yFormat: metric.format, xTicks: timeTicks(t0, t1),
    describe: (b) => [
      `${fmtClock(b.start)} – ${new Date(b.end * 1000).toLocaleTimeString([], hour)}`,
      `${metric.format(b.value)} ${metric.label}`,
    ],
  });
}

// -- the polls ---------------------------------------------------------------------------------

const pollStatus = every(STATUS_EVERY_MS, async () => {
  renderStatus(await api("GET", "/status"));
});

const pollDetails = every(DETAILS_EVERY_MS, async () => {
  if (connection.state === "down") return; // the status poll finds out when it is back
  const [experts, peers] = await Promise.all([api("GET", "/experts"), api("GET", "/peers")]);
  renderExperts(experts);
  renderPeers(peers);
  const queued = experts.reduce((n, e) => n + e.waiting, 0);
  setText("queued", fmtCount(queued), { value: queued });
});

const pollStats = every(STATS_EVERY_MS, async () => {
  if (connection.state === "down") return;
  const since = Date.now() / 1000 - Number($("history-range").value) - 3600;
  lastStats = await api("GET", `/stats?since=${Math.floor(since)}`);
  statsDay = new Date().toDateString();
  if (lastStatus) renderTotals(lastStatus.today);
  drawHistory();
});

function refreshAll() {
  pollStatus();
  pollDetails();
  pollStats();
}

function start() {
  const token = takeToken();
  if (!token) {
    lockOut("This tab was opened without the daemon's key.");
    return;
  }
  api = connect(token, connection);
  $("pause").addEventListener("click", () => act("/pause", {}));
  $("resume").addEventListener("click", () => act("/resume", {}));
  $("snooze").addEventListener("click", () => act("/snooze", { seconds: SNOOZE_S }));
  $("copy-peer-id").addEventListener("click", async () => {
    const id = $("peer-id").dataset.value;
    if (!id) return;
    try {
      await navigator.clipboard.writeText(id);
      setText("copy-peer-id", "copied");
    } catch {
      setText("copy-peer-id", "copy failed");
    }
    setTimeout(() => setText("copy-peer-id", "copy"), 1500);
  });
  $("history-metric").addEventListener("change", drawHistory);
  $("history-range").addEventListener("change", () => pollStats());
  let frameRequested = false;
  new ResizeObserver(() => {
    if (frameRequested) return;
    frameRequested = true;
    requestAnimationFrame(() => {
      frameRequested = false;
      drawLive();
      drawHistory();
    });
  }).observe($("main"));
  refreshAll();
  followEvents();
}

start();
