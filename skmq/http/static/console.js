"use strict";
// The SKMQ web console (docs/OPERATIONS.md, "Web console"): polls the gateway's JSON
// routes every POLL_MS and shows what they answer. Whatever comes from the broker is
// shown as text (textContent, text nodes), never parsed as HTML: a message preview is
// whatever a producer sent. The page's Content-Security-Policy runs no other script.

const POLL_MS = 2000;
const SAMPLES = 60; // points of each app's rate chart: the last two minutes
const API = new URL("../v1/", location.href); // relative: the page may sit under a prefix
const TOKEN_KEY = "skmq-token";
const CHART_W = 120;
const CHART_H = 32;
const SVG = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);
const appRows = new Map(); // app -> its row of the apps table, kept from poll to poll
const shown = new Map(); // part id -> JSON of the rows it shows (redrawn only on change)
const peeked = new Set(); // msgids of the dead letters whose content is open
let timer = null;
let polling = false;
let pollAgain = false;

// -- the gateway --------------------------------------------------------------------

class Refused extends Error {} // 401 or 403: no token, a wrong one, or one that may not

async function call(path, body) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { headers, cache: "no-store" };
  if (body !== undefined) {
    init.method = "POST";
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const res = await fetch(new URL(path, API), init);
  const data = await res.json().catch(() => ({}));
  if (res.ok) return data;
  const err = new (res.status === 401 || res.status === 403 ? Refused : Error)(
    `${res.status}: ${data.error ?? res.statusText}`,
  );
  err.status = res.status;
  throw err;
}

const appPath = (app, rest) => `apps/${encodeURIComponent(app)}/${rest}`;
const selectedApp = () => decodeURIComponent(location.hash.slice(1)) || null;

// -- polling ------------------------------------------------------------------------

async function pollNow() {
  clearTimeout(timer);
  if (polling) {
    pollAgain = true; // the poll under way may have read before what just changed
    return;
  }
  polling = true;
  try {
    const app = selectedApp();
    await Promise.all([part("apps", call("apps"), (d) => d.apps, drawApps), app && showApp(app)]);
    say("status", `Updated ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    if (err instanceof Refused) return askToken(err); // polls again once a token is given
    say("status", `Gateway unreachable: ${err.message}`, true);
  } finally {
    polling = false;
  }
  timer = setTimeout(pollNow, pollAgain ? 0 : POLL_MS);
  pollAgain = false;
}

// One table's rows from one request: redrawn only when they changed, and an error of
// its own shown in place (a 403 here is a role the token lacks for this part alone).
async function part(id, request, rowsOf, draw) {
  const box = $(id);
  let rows;
  try {
    rows = rowsOf(await request);
  } catch (err) {
    const refused = err.status === 401 || (id === "apps" && err instanceof Refused);
    if (refused || err.status === undefined) throw err; // the token, or the network
    box.querySelector(".error").textContent = err.message;
    return;
  }
  box.querySelector(".error").textContent = "";
  box.querySelector(".empty").hidden = rows.length > 0;
  const json = JSON.stringify(rows);
  if (shown.get(id) === json && id !== "apps") return;
  shown.set(id, json);
  draw(box.querySelector("tbody"), rows);
}

function showApp(app) {
  $("detail").hidden = false;
  $("detail-app").textContent = app;
  const fill = (draw) => (body, rows) => {
    if (selectedApp() === app) body.replaceChildren(...rows.flatMap(draw)); // not a click ago
  };
  const query = `recipients?app=${encodeURIComponent(app)}`;
  return Promise.all([
    part("recipients", call(query), (d) => d.recipients, fill(recipientRow)),
    part("groups", call(appPath(app, "groups")), (d) => d.groups, fill(groupRow)),
    part("pending", call(appPath(app, "messages?max=50&dead=0")), (d) => d.messages,
      fill(pendingRow)),
    part("dead", call(appPath(app, "dlq?limit=100")), (d) => d.dead_letters,
      fill((d) => deadRows(app, d))),
  ]);
}

// -- the apps table -----------------------------------------------------------------

function drawApps(body, apps) {
  const seen = new Set();
  for (const a of apps) {
    seen.add(a.app);
    if (!appRows.has(a.app)) appRows.set(a.app, newAppRow(a.app));
    const r = appRows.get(a.app);
    sample(r.in, a.rate_in);
    sample(r.out, a.rate_out);
    drawChart(r.chart, r.in, r.out);
    r.rate.textContent = `${rate(a.rate_in)} / ${rate(a.rate_out)}`;
    const recipients = `${a.recipients.alive} alive` +
      (a.recipients.lost ? `, ${a.recipients.lost} lost` : "");
    const values = [a.pending, a.delayed, a.in_flight, a.dead,
      age(a.oldest_pending_age_s), recipients, a.groups];
    values.forEach((v, i) => (r.cells[i].textContent = v ?? "–"));
    r.tr.classList.toggle("selected", a.app === selectedApp());
    r.cells[3].classList.toggle("bad", a.dead > 0);
    body.append(r.tr); // moved, not made again: in the gateway's order
  }
  for (const [app, r] of appRows) {
    if (!seen.has(app)) {
      r.tr.remove();
      appRows.delete(app);
    }
  }
}

function newAppRow(app) {
  const tr = document.createElement("tr");
  tr.dataset.app = app;
  const link = Object.assign(document.createElement("a"), {
    href: `#${encodeURIComponent(app)}`,
    textContent: app,
  });
  const chart = newChart();
  const rate = Object.assign(document.createElement("span"), { className: "rate" });
  const cells = Array.from({ length: 7 }, () => document.createElement("td"));
  const rateCell = document.createElement("td");
  rateCell.append(chart.svg, rate);
  tr.append(cell(link), rateCell, ...cells);
  return { tr, chart, rate, cells, in: [], out: [] };
}

function sample(history, value) {
  history.push(Number(value) || 0);
  if (history.length > SAMPLES) history.shift();
}

function newChart() {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${CHART_W} ${CHART_H}`);
  svg.setAttribute("class", "chart");
  svg.setAttribute("role", "img");
  const line = (name) => {
    const l = document.createElementNS(SVG, name === "area" ? "polygon" : "polyline");
    l.setAttribute("class", name);
    svg.append(l);
    return l;
  };
  return { svg, area: line("area"), in: line("in"), out: line("out") };
}

// The newest sample at the right edge; both lines on one scale, the larger peak on top;
// the area under the rate in shaded.
function drawChart(chart, ins, outs) {
  const top = Math.max(1, ...ins, ...outs);
  const step = CHART_W / (SAMPLES - 1);
  const points = (values) => values.map((v, i) => {
    const x = CHART_W - (values.length - 1 - i) * step;
    const y = CHART_H - 1 - (v / top) * (CHART_H - 2);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  }).join(" ");
  const first = CHART_W - (ins.length - 1) * step;
  chart.area.setAttribute("points", `${first},${CHART_H} ${points(ins)} ${CHART_W},${CHART_H}`);
  chart.in.setAttribute("points", points(ins));
  chart.out.setAttribute("points", points(outs));
  const last = (values) => rate(values[values.length - 1]);
  chart.svg.setAttribute("aria-label", `in ${last(ins)}, out ${last(outs)}; peak ${rate(top)}`);
}

// -- the app's tables ---------------------------------------------------------------

function recipientRow(r) {
  const state = Object.assign(document.createElement("span"), {
    className: "state",
    textContent: r.state,
  });
  state.dataset.state = r.state;
  return [row(r.id, r.address, r.weight, state, age(r.last_seen_age_s))];
}

const groupRow = (g) => [row(g.group, g.backlog, g.in_flight, g.delayed, g.dead,
  g.oldest_age_s === null ? "–" : `${g.oldest_age_s.toFixed(1)} s`)];

const pendingRow = (m) => [
  row(m.msgid, age(m.age_s), m.attempts, m.key, bytes(m.size), preview(m.preview)),
];

function deadRows(app, d) {
  const full = document.createElement("tr");
  full.className = "peek";
  full.hidden = !peeked.has(d.msgid);
  const td = Object.assign(document.createElement("td"), { colSpan: 7 });
  const content = Object.assign(document.createElement("pre"), { textContent: d.content });
  const history = Object.assign(document.createElement("pre"), {
    className: "history",
    textContent: d.history.join("\n"),
  });
  td.append(content, history);
  full.append(td);
  const peek = button(full.hidden ? "Peek" : "Hide", () => {
    full.hidden = !full.hidden;
    peek.textContent = full.hidden ? "Peek" : "Hide";
    if (full.hidden) peeked.delete(d.msgid);
    else peeked.add(d.msgid);
  });
  const one = { msgids: [d.msgid] };
  const replay = button("Replay", () => redrive(app, "replay", one));
  const purge = button("Purge", () => confirm(`Purge dead letter ${d.msgid} of ${app}?`) &&
    redrive(app, "purge", one));
  purge.className = "danger";
  const actions = Object.assign(document.createElement("span"), { className: "actions" });
  actions.append(peek, replay, purge);
  const when = new Date(d.died_at).toLocaleString();
  const tr = row(d.msgid, d.recipient, d.attempts, preview(d.last_error), when, preview(d.content),
    actions);
  tr.dataset.msgid = d.msgid;
  return [tr, full];
}

// -- actions ------------------------------------------------------------------------

function redrive(app, verb, body) {
  act(call(appPath(app, `dlq/${verb}`), body),
    (r) => `${verb === "replay" ? "Replayed" : "Purged"} ${r.done} of ${r.selected.length}`);
}

async function act(request, describe) {
  say("notice", "Working…");
  try {
    say("notice", describe(await request));
  } catch (err) {
    say("notice", err.message, true);
    if (err instanceof Refused) return askToken(err);
  }
  pollNow();
}

function purgePending(event) {
  event.preventDefault();
  const app = selectedApp();
  const form = event.target;
  const body = { dry_run: form.dry_run.checked };
  if (Number(form.older_than_s.value) > 0) body.older_than_s = Number(form.older_than_s.value);
  if (form.max.value) body.max = Number(form.max.value);
  if (!body.dry_run && !confirm(`Purge pending messages of ${app}? This cannot be undone.`)) {
    return;
  }
  act(call(appPath(app, "purge"), body), (r) =>
    `${r.dry_run ? "Would purge" : "Purged"} ${r.purged}` +
    (r.msgids.length ? `: ${r.msgids.slice(0, 20).join(", ")}` : ""));
}

// -- the token ----------------------------------------------------------------------

// The token form, saying why: `err` a refusal (polling stops until a token is given),
// or none (the operator asked for the form).
function askToken(err) {
  const had = sessionStorage.getItem(TOKEN_KEY) !== null;
  let why = "Enter an admin token.";
  if (err?.status === 403) {
    why = `This token may not do that (${err.message}). Enter a token with the admin role.`;
  } else if (err) {
    why = had ? `The broker refused this token (${err.message}). Enter it again.`
      : "Authentication is on: enter an admin token.";
  }
  if (err) {
    clearTimeout(timer);
    say("status", "Waiting for a token", true);
  }
  $("token-why").textContent = why;
  $("token-form").hidden = false;
  $("token").focus();
}

function useToken(event) {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  $("token-form").hidden = true;
  pollNow();
}

// -- small helpers ------------------------------------------------------------------

function cell(content) {
  const td = document.createElement("td");
  td.append(content ?? "–"); // a string becomes a text node: never markup
  return td;
}

function row(...contents) {
  const tr = document.createElement("tr");
  tr.append(...contents.map(cell));
  return tr;
}

function button(text, onClick) {
  const b = Object.assign(document.createElement("button"), { type: "button", textContent: text });
  b.addEventListener("click", onClick);
  return b;
}

function preview(text) {
  const flat = String(text ?? "");
  return Object.assign(document.createElement("span"), {
    className: "preview",
    textContent: flat.length > 120 ? `${flat.slice(0, 120)}…` : flat,
    title: flat.slice(0, 1000),
  });
}

function say(id, text, bad = false) {
  $(id).textContent = text;
  $(id).classList.toggle("bad", bad);
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h`;
  return `${(seconds / 86400).toFixed(1)} d`;
}

const rate = (perSecond) => `${(Number(perSecond) || 0).toFixed(1)}/s`;

function bytes(n) {
  if (n < 1024) return `${n} B`;
  return n < 1048576 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(1)} MiB`;
}

// -- start --------------------------------------------------------------------------

$("token-form").addEventListener("submit", useToken);
$("token-open").addEventListener("click", () => askToken());
$("token-forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  $("token-form").hidden = true;
  pollNow();
});
$("purge-form").addEventListener("submit", purgePending);
$("replay-all").addEventListener("click", () => {
  const app = selectedApp();
  if (confirm(`Replay every dead letter of ${app}?`)) redrive(app, "replay", {});
});
$("purge-all").addEventListener("click", () => {
  const app = selectedApp();
  if (confirm(`Purge every dead letter of ${app}? This cannot be undone.`)) {
    redrive(app, "purge", {});
  }
});
window.addEventListener("hashchange", () => {
  $("detail").hidden = !selectedApp();
  shown.clear();
  peeked.clear();
  for (const body of $("detail").querySelectorAll("tbody")) body.replaceChildren();
  say("notice", "");
  pollNow();
});
pollNow();
