// The projects this machine helps, and joining one from an invitation.
//
// Joining takes two steps, as on the command line: the invitation is first sent with
// dry_run (the daemon parses it and records nothing), so the page can show whose project
// it is — its name, its owner's key and the peers it joins through — and only the
// confirm button posts it for real. A project of the same name of another owner is
// replaced only when the preview said so (the dry run's ``replaces_owner``) and the
// confirm button posts ``replace``; without it the daemon refuses with 409. Joining and
// leaving restart the daemon: the page is told through ``expectRestart`` and rides
// through the few seconds without an API.

import { ApiError, Unreachable } from "./api.js";
import { fmtNumber, parseDecimal, shortId } from "./format.js";

const $ = (id) => document.getElementById(id);

let api = null;
let expectRestart = null;
let previewed = null; // {invitation, project, replaces}: what the confirm button would join
let wantsFocus = false; // the join field was asked for before the card could show

/** "Helping: <description> by <owner name>", with the name and the owner's short key
 * standing in for what a manifest left empty. */
function helpingLine(project) {
  const what = project.description || project.name;
  // no owner: a project of the config's experiments.join, trusted by its settings
  const who = project.owner_name || (project.owner ? shortId(project.owner) : "");
  return `Helping: ${what}${who ? ` by ${who}` : ""}`;
}

/** Only web addresses become links (a manifest is signed, but by anyone). */
function webLink(url) {
  try {
    const parsed = new URL(url);
    return parsed.protocol === "https:" || parsed.protocol === "http:" ? parsed : null;
  } catch {
    return null;
  }
}

function say(text, bad = false) {
  const el = $("join-status");
  el.textContent = text;
  el.classList.toggle("bad", bad);
}

function fieldError(id, message) {
  const input = $(id);
  input.setAttribute("aria-invalid", message ? "true" : "false");
  $(`${id}-error`).textContent = message;
}

function clearPreview() {
  previewed = null;
  $("join-preview").hidden = true;
}

/** The peers an invitation joins through (``peer=`` of volunteerd://join/<name>?owner=…),
 * once the daemon has said it is a good one. */
function invitationPeers(invitation) {
  try {
    return new URL(invitation).searchParams.getAll("peer");
  } catch {
    return [];
  }
}

function showPreview(invitation, project, replaces) {
  previewed = { invitation, project, replaces };
  $("preview-name").textContent = project.name;
  const owner = $("preview-owner");
  owner.textContent = shortId(project.owner);
  owner.title = project.owner;
  $("preview-owner-name").textContent = project.owner_name ? `(${project.owner_name})` : "";
  const peers = $("preview-peers");
  peers.replaceChildren();
  for (const peer of project.peers ?? invitationPeers(invitation)) {
    const code = document.createElement("code");
    code.textContent = peer;
    const line = document.createElement("div");
    line.className = "peer-addr";
    line.append(code);
    peers.append(line);
  }
  if (!peers.childElementCount) peers.textContent = "—";
  const replacing = $("preview-replaces");
  replacing.hidden = !replaces;
  replacing.textContent = replaces
    ? `This replaces the project ${project.name} of owner ${shortId(replaces)}: this machine `
      + "stops helping it, and the new project's experts do not start from its weights."
    : "";
  replacing.title = replaces ? `owner ${replaces}` : "";
  $("confirm-join").textContent = replaces ? `Replace with ${project.name}` : `Join ${project.name}`;
  fieldError("join-share", "");
  $("join-preview").hidden = false;
  $("confirm-join").focus();
}

/** The daemon's refusal, next to the field it names (or below the form). */
function refused(err, action) {
  if (err instanceof ApiError && err.status === 401) return;
  if (err instanceof ApiError) {
    if (err.field === "share") fieldError("join-share", err.message);
    else if (err.field === "invitation" || err.status === 400) fieldError("invitation", err.message);
    else say(err.message, true);
  } else if (err instanceof Unreachable) {
    say(`The daemon did not answer; nothing was ${action}.`, true);
  } else {
    throw err;
  }
}

async function check(event) {
  event.preventDefault();
  clearPreview();
  say("");
  fieldError("invitation", "");
  const invitation = $("invitation").value.trim();
  if (!invitation) {
    fieldError("invitation", "paste the invitation first (it starts with volunteerd://join/)");
    $("invitation").focus();
    return;
  }
  const button = $("check-invitation");
  button.disabled = true;
  try {
    const reply = await api("POST", "/projects", { invitation, dry_run: true });
    showPreview(invitation, reply.project, reply.replaces_owner ?? null);
  } catch (err) {
    refused(err, "changed");
  } finally {
    button.disabled = false;
  }
}

async function confirmJoin() {
  if (!previewed) return;
  const shareField = $("join-share");
  const parsed = parseDecimal(shareField.value);
  const share = parsed.error ? NaN : (parsed.value ?? 1);
  if (!Number.isFinite(share)) {
    fieldError("join-share", `${parsed.error} (1: as much as each other project)`);
    shareField.focus();
    return;
  }
  const { invitation, project, replaces } = previewed;
  const button = $("confirm-join");
  button.disabled = true;
  try {
    const body = replaces ? { invitation, share, replace: true } : { invitation, share };
    const reply = await api("POST", "/projects", body);
    clearPreview();
    $("invitation").value = "";
    if (reply.restarting) {
      say(`Joined ${project.name}; volunteerd is restarting to join…`);
      expectRestart(`to join ${project.name}`, `Now helping ${project.name}.`);
    } else {
      say(`Joined ${project.name}.`);
    }
  } catch (err) {
    refused(err, "joined");
  } finally {
    button.disabled = false;
  }
}

async function leave(name, button) {
  button.disabled = true;
  try {
    const reply = await api("DELETE", `/projects/${encodeURIComponent(name)}`);
    if (reply.restarting) {
      say(`Left ${name}; volunteerd is restarting…`);
      expectRestart(`to leave ${name}`, `Left ${name}.`);
    } else {
      say(`Left ${name}.`);
    }
  } catch (err) {
    button.disabled = false;
    refused(err, "changed");
  }
}

function projectItem(project) {
  const li = document.createElement("li");
  li.dataset.name = project.name;
  li.dataset.state = project.state;

  const main = document.createElement("div");
  main.className = "project-main";
  const title = document.createElement("span");
  title.className = "project-title";
  const notHosted = project.state === "not_hosted";
  title.textContent = notHosted ? `Not hosted: ${project.name}` : helpingLine(project);
  title.title = `owner ${project.owner}`;
  main.append(title);
  const link = webLink(project.homepage ?? "");
  if (link) {
    const a = document.createElement("a");
    a.href = link.href;
    a.textContent = link.host;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    a.className = "project-home";
    main.append(" ", a);
  }
  const facts = document.createElement("div");
  facts.className = "muted project-facts";
  const badge = document.createElement("span");
  const bad = project.state === "failed" || notHosted;
  badge.className = `badge ${project.state === "joined" ? "ok" : bad ? "bad" : "info"}`;
  // joining, joined, failed, or "not hosted": an entry of projects.toml this release refuses
  badge.textContent = notHosted ? "not hosted" : project.state;
  facts.append(badge, notHosted ? ` ${project.name}` : ` ${project.name} · share ${fmtNumber(project.share)}`
    + ` · ${project.experts} expert${project.experts === 1 ? "" : "s"} here`);
  main.append(facts);
  if (project.error) {
    const error = document.createElement("div");
    error.className = "project-error";
    error.textContent = project.error;
    main.append(error);
  }
  if (project.waiting) {
    // "waiting for a busy replica of ffn.3.1, retrying in 40 s": downloaded in turn
    const waiting = document.createElement("div");
    waiting.className = "muted project-waiting";
    waiting.textContent = project.waiting;
    main.append(waiting);
  }
  if (project.advice) {
    const advice = document.createElement("div");
    advice.className = "muted project-advice";
    advice.textContent = project.advice;
    main.append(advice);
  }

  const actions = document.createElement("div");
  actions.className = "project-actions";
  const leaveButton = document.createElement("button");
  leaveButton.type = "button";
  leaveButton.className = "leave";
  leaveButton.textContent = "Leave";
  leaveButton.setAttribute("aria-label", `Leave ${project.name}`);
  leaveButton.addEventListener("click", () => {
    // A second click confirms: leaving restarts the daemon and drops its experts.
    const ask = document.createElement("span");
    ask.className = "confirm-leave";
    ask.textContent = "Stop helping it? ";
    const yes = document.createElement("button");
    yes.type = "button";
    yes.className = "danger";
    yes.textContent = "Leave";
    yes.dataset.testid = "confirm-leave";
    yes.addEventListener("click", () => leave(project.name, yes));
    const no = document.createElement("button");
    no.type = "button";
    no.textContent = "Keep helping";
    no.addEventListener("click", () => actions.replaceChildren(leaveButton));
    ask.append(yes, " ", no);
    actions.replaceChildren(ask);
    yes.focus();
  });
  actions.append(leaveButton);
  li.append(main, actions);
  return li;
}

let shown = ""; // the list last drawn, so a poll that changes nothing redraws nothing

/** Draw the joined projects (``Status.projects``; undefined from a daemon without them). */
export function renderProjects(projects) {
  const card = $("projects-card");
  if (projects === undefined) {
    card.hidden = true;
    return;
  }
  card.hidden = false;
  if (wantsFocus) {
    wantsFocus = false;
    focusJoin();
  }
  const key = JSON.stringify(projects);
  if (key === shown) return;
  shown = key;
  const list = $("projects");
  const open = list.querySelector(".confirm-leave")?.closest("li")?.dataset.name;
  list.replaceChildren(...projects.map(projectItem));
  if (open) list.querySelector(`li[data-name="${CSS.escape(open)}"] .leave`)?.click();
  if (projects.length === 0) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = "This machine helps no project yet: join one with an invitation below.";
    list.append(li);
  }
}

/** Wire up the join form. ``expect(why, done)``: the daemon is about to restart. */
export function setupProjects(call, expect) {
  api = call;
  expectRestart = expect;
  $("join-form").addEventListener("submit", check);
  $("confirm-join").addEventListener("click", confirmJoin);
  $("cancel-join").addEventListener("click", () => {
    clearPreview();
    say("");
    $("invitation").focus();
  });
  $("invitation").addEventListener("input", () => {
    fieldError("invitation", "");
    clearPreview();
  });
}

/** Bring the join field into view (the tray's "Join a project…"), with an invitation
 * already in it if one came along. */
export function focusJoin(invitation) {
  if (invitation) $("invitation").value = invitation;
  if ($("projects-card").hidden) {
    wantsFocus = true; // until the first status says this daemon can join projects
    return;
  }
  $("projects-card").scrollIntoView({ block: "start" });
  $("invitation").focus();
}
