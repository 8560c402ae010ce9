// Kaizen dashboard: the few things pages do in the browser. Every write is a same-origin JSON fetch carrying
// the session's CSRF token; there is no inline script (the Content-Security-Policy forbids it).
"use strict";

function csrf() {
  const meta = document.querySelector('meta[name="csrf-token"]');
  return meta ? meta.content : "";
}

function flash(text, isError) {
  const box = document.getElementById("flash");
  if (!box) return;
  box.textContent = text;
  box.className = isError ? "error" : "";
  box.hidden = false;
  clearTimeout(flash.timer);
  flash.timer = setTimeout(() => { box.hidden = true; }, 4000);
}

async function post(url, body) {
  const response = await fetch(url, {
    method: "POST",
    credentials: "same-origin",
    headers: { "content-type": "application/json", "x-kaizen-csrf": csrf() },
    body: JSON.stringify(body || {}),
  });
  let data = null;
  try { data = await response.json(); } catch (e) { data = null; }
  if (!response.ok) {
    const message = data && data.error ? data.error.message : `request failed (${response.status})`;
    flash(message, true);
    throw new Error(message);
  }
  return data;
}

function setUpLogin() {
  const form = document.getElementById("login-form");
  if (!form) return;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = document.getElementById("login-key").value;
    try {
      const answer = await post("/dashboard/session", { key: key, next: form.dataset.next || "/dashboard" });
      window.location.assign(answer.next);
    } catch (e) { /* shown by post() */ }
  });
}

function setUpLogout() {
  const button = document.getElementById("logout");
  if (!button) return;
  button.addEventListener("click", async () => {
    const answer = await post("/dashboard/logout");
    window.location.assign(answer.next);
  });
}

// Labelling: the target is the episode unless a call's "label this call" button chose that call.
const labelTarget = { kind: "episode", id: null };

function chooseTarget(kind, id) {
  labelTarget.kind = kind;
  labelTarget.id = id;
  const name = document.getElementById("label-target-name");
  if (name) name.textContent = kind === "episode" ? "this episode" : `call ${id}`;
  document.querySelectorAll(".call").forEach((c) => c.classList.toggle("targeted", c.id === `call-${id}`));
}

async function label(value) {
  const panel = document.getElementById("label-panel");
  if (!panel) return;
  const body = { value: value };
  const comment = document.getElementById("label-comment").value.trim();
  if (comment) body.comment = comment;
  if (labelTarget.kind === "episode") body.episode_id = panel.dataset.episode;
  else body.request_id = labelTarget.id;
  try {
    const answer = await post("/dashboard/feedback", body);
    const stored = answer.items[0];
    document.body.dataset.lastReward = String(stored.id);
    flash(`Saved: reward ${stored.id} = ${stored.value} (${stored.status})`, false);
    document.getElementById("label-comment").value = "";
  } catch (e) { /* shown by post() */ }
}

function saveScore() {
  const input = document.getElementById("label-score");
  const value = Number.parseFloat(input.value);
  if (!Number.isFinite(value)) { flash("Enter a number first.", true); input.focus(); return; }
  input.blur();  // back to the keyboard shortcuts
  label(value);
}

function setUpLabelling() {
  const panel = document.getElementById("label-panel");
  if (!panel) return;
  chooseTarget("episode", panel.dataset.episode);
  document.querySelectorAll("button.thumb").forEach((b) => b.addEventListener("click", () => label(b.dataset.value === "true")));
  document.getElementById("label-save-score").addEventListener("click", saveScore);
  document.getElementById("label-score").addEventListener("keydown", (event) => {
    if (event.key === "Enter") { event.preventDefault(); saveScore(); }
  });
  document.querySelectorAll("button.label-call").forEach((b) => b.addEventListener("click", () => {
    chooseTarget("call", b.dataset.request);
    panel.scrollIntoView({ block: "nearest" });
  }));
}

function typing(element) {
  return element && (element.tagName === "INPUT" || element.tagName === "TEXTAREA" || element.tagName === "SELECT");
}

function setUpShortcuts() {
  const panel = document.getElementById("label-panel");
  if (!panel) return;
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && typing(document.activeElement)) { document.activeElement.blur(); return; }
    if (typing(event.target) || event.ctrlKey || event.metaKey || event.altKey) return;
    const actions = {
      j: () => { const next = document.getElementById("queue-next"); if (next) window.location.assign(next.href); },
      k: () => window.history.back(),
      u: () => label(true),
      d: () => label(false),
      s: () => document.getElementById("label-score").focus(),
      c: () => document.getElementById("label-comment").focus(),
      e: () => chooseTarget("episode", panel.dataset.episode),
    };
    const action = actions[event.key];
    if (action) { event.preventDefault(); action(); }
  });
}

function setUpPolicyActions() {
  document.querySelectorAll("button.promote").forEach((b) => b.addEventListener("click", async () => {
    if (!window.confirm(`Promote ${b.dataset.policy} to version ${b.dataset.version}? New calls will be served by it.`)) return;
    await post(`/dashboard/policies/${encodeURIComponent(b.dataset.policy)}/promote`, { version: Number(b.dataset.version) });
    window.location.reload();
  }));
  const simple = {
    rollback: (p) => `Roll ${p} back to the version active before the current one?`,
    pause: (p) => `Pause the schedule of ${p}? Scheduled judging, training and retention stop.`,
    resume: (p) => `Resume the schedule of ${p}?`,
  };
  Object.entries(simple).forEach(([action, question]) => {
    const button = document.getElementById(action);
    if (!button) return;
    button.addEventListener("click", async () => {
      if (!window.confirm(question(button.dataset.policy))) return;
      await post(`/dashboard/policies/${encodeURIComponent(button.dataset.policy)}/${action}`);
      window.location.reload();
    });
  });
}

document.addEventListener("DOMContentLoaded", () => {
  setUpLogin();
  setUpLogout();
  setUpLabelling();
  setUpShortcuts();
  setUpPolicyActions();
});
