// The volunteerd dashboard: a client of the local control API, like the tray and the CLI.
// It polls /status every two seconds (the live numbers and charts), the experts and peers
// every five, /stats every ten, and follows /events with a long poll. The live charts
// start from /history, the daemon's last ten minutes. It holds nothing the daemon does
// not say; a reload starts it afresh. No libraries, no build step.

import { ApiError, Unreachable, connect, forgetToken, takeToken } from "./api.js";
import { barChart, lineChart, placeholder, timeTicks } from "./charts.js";
import {
  fmtAgo, fmtBytes, fmtClock, fmtCount, fmtDuration, fmtFull, fmtInput, fmtNumber, fmtRate,
  fmtSpan, parseDecimal, sameDay, shortId,
} from "./format.js";
import { focusJoin, renderProjects, setupProjects } from "./projects.js";
import { quotaWarnings, upkeepGbADay } from "./quota.js";

const STATUS_EVERY_MS = 2000;
const DETAILS_EVERY_MS = 5000;
const STATS_EVERY_MS = 10000;
const EVENTS_WAIT_S = 25;
const KEEP_EVENTS = 100;
const LIVE_WINDOW_S = 600;
const LIVE_GAP_S = 7; // points further apart than this are not joined by a line
const SNOOZE_S = 3600;
const RESTART_SLOW_S = 30; // a restart taking longer than this gets a word of advice
// The limits the form edits; a daemon that has no such limit hides its field.
const LIMIT_FIELDS = ["upload_mbit", "download_mbit", "monthly_quota_gb", "daily_quota_gb",
  "duty_cycle", "cpu_threads", "disk_budget_gb"];
const SCHEDULE_FIELDS = ["run", "idle_minutes", "on_battery", "compute_hours", "network_hours", "gpu"];
const TOTAL_FIELDS = ["forward", "backward", "samples", "compute_s", "bytes_in", "bytes_out",
  "bytes_sent", "bytes_received", "running_s", "paused_s"];

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
    $("main").classList.add("stale");
    renderButtons();
    if (restarting) {
      showRestarting();
      return;
    }
    setText("banner", "Daemon not reachable — volunteerd may have stopped or restarted. "
      + "This page reconnects by itself when it answers again.");
    $("banner").dataset.kind = "down";
    $("banner").hidden = false;
    const pill = $("state");
    pill.dataset.state = "offline";
    delete pill.dataset.activity;
    setText(pill, "not reachable");
    setText("state-detail", "");
    $("activity").hidden = true;
    document.title = "volunteerd — not reachable";
  },
  refused() {
    lockOut("The daemon did not accept the key this page was given: it may belong to another "
      + "daemon, or this daemon's data folder has changed.");
  },
};

// -- restarts the page asked for (joining or leaving a project) ----------------------------

let restarting = null; // {why, done, before: the old started_at, since: ms}

/** The daemon is about to restart (``why``: "to join x"); ``done`` is said once the new
 * one answers. Until then the page says it is restarting rather than gone. */
function expectRestart(why, done) {
  restarting = { why, done, before: startedAt, since: Date.now() };
  showRestarting();
  pollStatus();
}

function showRestarting() {
  const waited = (Date.now() - restarting.since) / 1000;
  const slow = waited > RESTART_SLOW_S
    ? " It is taking a while: if this page does not come back, open it again with "
      + "`volunteerd dashboard` (the daemon may listen on another port now)."
    : "";
  setText("banner", `volunteerd is restarting ${restarting.why}…${slow}`);
  $("banner").dataset.kind = "restarting";
  $("banner").hidden = false;
  const pill = $("state");
  pill.dataset.state = "restarting";
  delete pill.dataset.activity;
  setText(pill, `restarting ${restarting.why}…`);
  setText("state-detail", "");
  document.title = "volunteerd — restarting";
}

function restartDone() {
  setText("join-status", restarting.done);
  restarting = null;
  $("banner").hidden = true;
  $("main").classList.remove("stale");
}

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

const STATE_WORDS = {
  running: "running", paused: "paused", snoozed: "snoozed", quota: "quota reached",
  scheduled: "paused by the schedule",
};
// What the daemon does (``Status.activity``), in a word for the pill; "paused" says the
// state's own word (snoozed, quota reached, ...).
const ACTIVITY_WORDS = {
  not_in_project: "not in a project", joining: "joining", contributing: "contributing",
  waiting: "waiting for work", no_peers: "no peers", unreachable: "unreachable",
};

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
  // A snooze's reason is its end, said above; "paused" next to the word paused says
  // nothing; the activity's message says the reason already.
  if (s.reason && !snoozed && s.reason !== s.state && !s.activity) parts.push(s.reason);
  const idle = s.activity && s.activity.state !== "contributing"; // its message says why
  if (s.state === "running" && s.serving && !s.reason && !idle) {
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

  if (restarting && s.started_at !== restarting.before) restartDone();
  if (restarting) {
    showRestarting(); // the old daemon, still answering before it restarts
  } else {
    const pill = $("state");
    pill.dataset.state = s.state;
    const word = ACTIVITY_WORDS[s.activity?.state] ?? STATE_WORDS[s.state] ?? s.state;
    if (s.activity) pill.dataset.activity = s.activity.state;
    else delete pill.dataset.activity;
    setText(pill, word);
    setText("state-detail", stateDetail(s));
    document.title = `volunteerd — ${word}`;
  }
  renderButtons();
  renderActivity(s.activity);
  renderProjects(s.projects);
  renderScheduleNow(s.schedule);
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

/** The honest line: what the daemon does for whom, and what to do about it. */
function renderActivity(activity) {
  const box = $("activity");
  box.hidden = !activity || restarting != null;
  if (!activity) return;
  box.dataset.state = activity.state;
  // the pill says it already when the message is one word ("no peers")
  const said = activity.message.toLowerCase() === $("state").textContent.toLowerCase();
  setText("activity-message", said ? "" : activity.message);
  setText("activity-hint", activity.hint);
}

function setBytesRate(id, bytesPerS) {
  const [number, unit] = fmtBytes(bytesPerS).split(" ");
  setText(id, number, { value: bytesPerS, title: `${fmtBytes(bytesPerS)}/s` });
  setText(`${id}-unit`, `${unit}/s`);
}

function limitNote(mbit) {
  return mbit > 0 ? `limit ${fmtNumber(mbit)} Mbit/s (${fmtBytes((mbit * 1e6) / 8)}/s)` : "no limit";
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
  // all traffic (what the quotas count), and the expert calls' tensors in it
  ["sent", (t) => t.bytes_sent, fmtBytes],
  ["up", (t) => t.bytes_out, fmtBytes],
  ["received", (t) => t.bytes_received, fmtBytes],
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
    ? `${used} of ${fmtNumber(limits.monthly_quota_gb)} GB used this month `
      + `(${Math.min(100, (100 * limits.month_bytes) / (limits.monthly_quota_gb * 1e9)).toFixed(0)} %)`
    : `${used} sent and received this month`;
  const today = limits.daily_quota_gb > 0 && limits.day_bytes != null
    ? `; ${fmtBytes(limits.day_bytes)} of ${fmtNumber(limits.daily_quota_gb)} GB today` : "";
  setText("quota-use", text + today);
  const warnings = quotaWarnings(limits, upkeepGbADay(lastStats, Date.now() / 1000), fmtNumber);
  const note = setText("quota-warning", warnings.join(" "));
  note.hidden = warnings.length === 0;
}

// -- the limits and schedule form --------------------------------------------------------------
//
// One form, one Save: the limits go to PATCH /limits, the schedule to PATCH /schedule,
// each with only what changed. Fields the daemon does not have (an older one) are hidden.

const form = $("limits-form");
let limitsEdited = false; // the person is editing: live updates leave the inputs alone
let limitsShown = null; // the values the inputs were filled with
let scheduleShown = null; // the schedule the inputs were filled with (null: none known)

function input(field) {
  return form.elements.namedItem(field);
}

function editing(force) {
  const el = document.activeElement;
  const typing = ["INPUT", "SELECT"].includes(el?.tagName) && form.contains(el);
  return !force && (limitsEdited || typing);
}

function showLimits(limits, { force = false } = {}) {
  if (editing(force)) return;
  for (const field of LIMIT_FIELDS) {
    const el = input(field);
    el.closest(".field").hidden = limits[field] === undefined;
    if (limits[field] === undefined) continue;
    if (parseDecimal(el.value).value !== limits[field]) el.value = fmtInput(limits[field]);
  }
  limitsShown = { ...limits };
  limitsEdited = false;
}

/** "22:00-07:00, 12:00-13:30" and back; empty means any time. */
function hoursText(windows) {
  return windows.join(", ");
}

function hoursList(text) {
  return text.split(/[,;\s]+/).filter(Boolean);
}

function scheduleValue(field) {
  const el = input(field);
  if (el.type === "checkbox") return el.checked;
  if (field.endsWith("_hours")) return hoursList(el.value);
  return el.value;
}

function showSchedule(schedule, { force = false } = {}) {
  $("schedule").hidden = schedule == null;
  if (schedule == null || editing(force)) return;
  for (const field of SCHEDULE_FIELDS) {
    const el = input(field);
    const value = schedule[field];
    if (el.type === "checkbox") el.checked = Boolean(value);
    else if (field.endsWith("_hours")) el.value = hoursText(value ?? []);
    else if (field === "idle_minutes") el.value = fmtInput(value);
    else el.value = String(value);
  }
  input("idle_minutes").disabled = schedule.run !== "when_idle" && schedule.gpu !== "when_idle";
  scheduleShown = { ...schedule };
  limitsEdited = false;
}

/** Where the schedule stands now (``Status.schedule``). */
function renderScheduleNow(now) {
  if (!now) {
    setText("schedule-now", "");
    return;
  }
  const parts = [now.computing ? "Computing now" : "Not computing now"];
  if (!now.network) parts.push("no network now");
  if (now.reason) parts.push(now.reason);
  if (now.idle_s != null) parts.push(`idle for ${fmtDuration(now.idle_s)}`);
  if (now.on_battery) parts.push("on battery");
  if (now.zone) parts.push(`hours in ${now.zone}${fmtUtcOffset(now.utc_offset_s)}`);
  setText("schedule-now", parts.join(" · "));
}

/** " (UTC+05:45)" for an offset in seconds; "" for none (an older daemon). */
function fmtUtcOffset(seconds) {
  if (typeof seconds !== "number") return "";
  const minutes = Math.round(Math.abs(seconds) / 60);
  const hh = String(Math.floor(minutes / 60)).padStart(2, "0");
  const mm = String(minutes % 60).padStart(2, "0");
  return ` (UTC${seconds < 0 ? "-" : "+"}${hh}:${mm})`;
}

function fieldError(field, message) {
  const el = input(field.split(".")[0]); // "compute_hours.1": the list's field
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

// The idle time matters only while something waits for idleness.
form.addEventListener("change", () => {
  input("idle_minutes").disabled = input("run").value !== "when_idle"
    && input("gpu").value !== "when_idle";
});

/** The limits that differ from those shown, or null after marking a bad field. */
function limitsChange() {
  const change = {};
  for (const field of LIMIT_FIELDS) {
    const el = input(field);
    if (el.closest(".field").hidden) continue;
    // a text field: "2,5" is 2.5 (a number field read it as 25 in an English browser)
    const { value, error } = parseDecimal(el.value);
    if (error) {
      fieldError(field, error);
      el.focus();
      return null;
    }
    if (value === null) continue;
    if (value !== limitsShown?.[field]) change[field] = value;
  }
  return change;
}

function scheduleChange() {
  const change = {};
  if (scheduleShown == null) return change;
  for (const field of SCHEDULE_FIELDS) {
    let value = scheduleValue(field);
    if (field === "idle_minutes") {
      const parsed = parseDecimal(value);
      if (parsed.value == null) {
        fieldError(field, parsed.error ?? "not a number");
        input(field).focus();
        return null;
      }
      value = parsed.value;
    }
    if (JSON.stringify(value) !== JSON.stringify(scheduleShown[field])) change[field] = value;
  }
  return change;
}

async function patch(path, change) {
  try {
    return await api("PATCH", path, change);
  } catch (err) {
    if (err instanceof ApiError && err.status === 422 && err.field && fieldError(err.field, err.message)) {
      input(err.field.split(".")[0]).focus();
    } else if (err instanceof ApiError && err.status !== 401) {
      limitsStatus(err.message, true);
    } else if (err instanceof Unreachable) {
      limitsStatus("The daemon did not answer; nothing was saved.", true);
    }
    return null;
  }
}

form.addEventListener("submit", async (e) => {
  e.preventDefault();
  for (const field of [...LIMIT_FIELDS, ...SCHEDULE_FIELDS]) fieldError(field, "");
  limitsStatus("");
  const limits = limitsChange();
  const schedule = limits && scheduleChange();
  if (limits == null || schedule == null) return;
  if (Object.keys(limits).length + Object.keys(schedule).length === 0) {
    limitsStatus("Nothing changed.");
    limitsEdited = false;
    return;
  }
  const save = $("save-limits");
  save.disabled = true;
  try {
    if (Object.keys(limits).length) {
      const saved = await patch("/limits", limits);
      if (!saved) return;
      limitsShown = { ...saved };
      renderQuota(saved);
    }
    if (Object.keys(schedule).length) {
      const saved = await patch("/schedule", schedule);
      if (!saved) {
        if (Object.keys(limits).length) {
          limitsStatus(`The limits were saved, the schedule was not: ${$("limits-status").textContent
            || "see the field marked"}`, true);
        }
        return;
      }
      scheduleShown = { ...saved };
      showSchedule(saved, { force: true });
    }
    showLimits(limitsShown, { force: true });
    limitsStatus("Saved.");
    pollStatus();
  } finally {
    save.disabled = false;
  }
});

const pollSchedule = every(60000, async () => {
  if (connection.state === "down") return;
  try {
    showSchedule(await api("GET", "/schedule"));
  } catch (err) {
    // an older daemon (404), or one that runs no schedule (409)
    if (err instanceof ApiError && [404, 405, 409].includes(err.status)) showSchedule(null);
    else throw err;
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
      if (["state", "limits", "schedule", "reachability", "started"].some((k) => kinds.has(k))) pollStatus();
      if (["limits", "schedule", "started"].some((k) => kinds.has(k))) pollSchedule();
      if (["experts", "projects"].some((k) => kinds.has(k))) pollDetails();
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
  pollSchedule();
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// -- charts -----------------------------------------------------------------------------------

// {t, samples, up, down} from /history and then each /status; null where the daemon restarted
const live = [];

function livePoint(t, rates) {
  return { t, samples: rates.samples_per_s, up: rates.upload_bytes_per_s, down: rates.download_bytes_per_s };
}

function pushLive(rates) {
  const now = Date.now() / 1000;
  live.push(livePoint(now, rates));
  while (live.length && (live[0] === null || live[0].t < now - LIVE_WINDOW_S)) live.shift();
  drawLive();
}

/** The daemon's own samples of the last minutes in place of what this page has of that
 * time (nothing, on a fresh load; a gap, after the daemon was out of reach). */
const loadHistory = async () => {
  if (connection.state === "down") return;
  let got;
  try {
    got = await api("GET", "/history");
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) return; // an older daemon
    throw err;
  }
  const samples = got.samples.map((s) => livePoint(s.t, s));
  if (samples.length === 0) return;
  const first = samples[0].t;
  const last = samples.at(-1).t;
  const before = live.filter((p) => p === null || p.t < first);
  const after = live.filter((p) => p !== null && p.t > last);
  live.splice(0, live.length, ...before, ...samples, ...after);
  drawLive();
};

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
  const points = live.filter(Boolean);
  el.dataset.points = String(points.length);
  el.dataset.firstT = String(points[0]?.t ?? "");
  if (points.length < 2 || el.clientWidth === 0) {
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
  bytes_sent: { get: (b) => b.bytes_sent, format: fmtBytes, label: "sent", floor: 4000 },
  bytes_received: { get: (b) => b.bytes_received, format: fmtBytes, label: "received", floor: 4000 },
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
  pollSchedule();
  loadHistory().catch(() => {}); // the status poll says when the daemon is away
}

function start() {
  const token = takeToken();
  if (!token) {
    lockOut("This tab was opened without the daemon's key.");
    return;
  }
  api = connect(token, connection);
  setupProjects(api, expectRestart);
  // "#join" (the tray's "Join a project…"), or "#join=<invitation>": the join field
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (fragment.has("join")) {
    focusJoin(fragment.get("join"));
    history.replaceState(null, "", location.pathname + location.search);
  }
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
