// Spool's console: submit a job, watch its tokens stream in, resume a dropped stream by itself.
//
// Streams are read with fetch(), not EventSource: EventSource cannot send an Authorization
// header, and the alternative (the key in the URL) would put a long-lived key in access logs and
// the browser's history. The key is kept in this tab's sessionStorage and sent as
// "Authorization: Bearer KEY" on every request. fetch() does not resume by itself, so follow()
// does: it reconnects with Last-Event-ID set to the last event it showed and drops any event id
// it has seen, so a token is never shown twice or skipped.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "spool-api-key";
const POLL_MS = 2000;
const RETRY_MAX_MS = 4000;

const view = {
  jobId: null,
  lastId: 0, // id of the last event shown: the cursor a reconnect resumes after
  tokens: 0, // token events shown
  stream: null, // AbortController of the stream being followed
};

class ApiError extends Error {
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.status = status; // 0: the API did not answer at all
    this.code = error.code || null;
  }
}

// ---- requests -------------------------------------------------------------------------------

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function request(path, options = {}) {
  let r;
  try {
    r = await fetch(path, { cache: "no-store", ...options, headers: headers(options.headers) });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, { message: "The API is unreachable", code: "api_unreachable" });
  }
  if (r.ok) return r;
  const body = await r.json().catch(() => ({}));
  throw new ApiError(r.status, body.error || { message: r.statusText });
}

async function getJson(path, options) {
  return (await request(path, options)).json();
}

function explain(err) {
  if (err.status === 0) return "The API is unreachable (is `spool api` running?).";
  if (err.status === 401) return "This API needs a key: enter it at the top (" + err.message + ").";
  if (err.code === "backend_unavailable") return "Redis is unreachable: " + err.message;
  if (err.code === "no_worker") return "No worker is running: start one with `spool worker`.";
  return err.message;
}

function banner(text) {
  const b = $("banner");
  b.textContent = text || "";
  b.hidden = !text;
}

// ---- the stream -----------------------------------------------------------------------------

// Server-sent events of one response body, parsed as the spec says: fields until a blank line.
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { id: null, event: "message", data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let nl;
    while ((nl = buffer.search(/\r\n|\r|\n/)) >= 0) {
      const line = buffer.slice(0, nl);
      buffer = buffer.slice(nl + (buffer.startsWith("\r\n", nl) ? 2 : 1));
      if (line === "") {
        if (event.data.length) yield { ...event, data: event.data.join("\n") };
        event = { id: null, event: "message", data: [] };
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") event.data.push(val);
        else if (field === "event") event.event = val;
        else if (field === "id") event.id = Number(val);
      }
    }
  }
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

// Follow a job's events from the first, reconnecting after the last one shown until the terminal one.
async function follow(jobId) {
  if (view.stream) view.stream.abort();
  const ctrl = new AbortController();
  Object.assign(view, { jobId, lastId: 0, tokens: 0, stream: ctrl });
  $("output").textContent = "";
  showCursor();
  $("job-id").textContent = jobId;
  $("job-meta").textContent = "";
  $("cancel").disabled = false;
  history.replaceState(null, "", `?job=${encodeURIComponent(jobId)}`);
  let delay = 250;
  while (!ctrl.signal.aborted) {
    try {
      const extra = view.lastId ? { "Last-Event-ID": String(view.lastId) } : {};
      const r = await request(`/v1/jobs/${encodeURIComponent(jobId)}/events`, { headers: extra, signal: ctrl.signal });
      setStream(view.lastId ? `resumed after event ${view.lastId}` : "streaming");
      banner("");
      if (!view.lastId) refreshJob(jobId);
      delay = 250;
      for await (const ev of sseEvents(r.body)) {
        if (ev.id === null) continue; // not a job event: a stream ended by an outage says so, then closes
        if (ev.id <= view.lastId) continue; // already shown
        view.lastId = ev.id;
        if (show(ev.event, JSON.parse(ev.data))) {
          finished();
          return;
        }
      }
    } catch (err) {
      if (ctrl.signal.aborted) return;
      if (err instanceof ApiError && err.status >= 400 && err.status < 500) {
        setStatus("error");
        setStream("");
        banner(explain(err));
        $("cancel").disabled = true;
        return;
      }
      if (err instanceof ApiError) banner(explain(err));
    }
    if (ctrl.signal.aborted) return;
    setStream(`connection lost; reconnecting after event ${view.lastId}…`);
    await sleep(delay, ctrl.signal);
    delay = Math.min(delay * 2, RETRY_MAX_MS);
  }
}

// Show one job event; true when it was the last.
function show(type, data) {
  if (type === "token") {
    if (data.index !== view.tokens) {
      // Cannot happen while ids are consecutive; say so rather than show a garbled text.
      banner(`token index ${data.index} arrived after ${view.tokens} tokens`);
    }
    view.tokens += 1;
    $("output").append(data.text);
    showCursor();
    setStatus("running");
    return false;
  }
  if (type === "done") {
    setStatus(data.status);
    const u = data.usage || {};
    $("job-meta").textContent =
      `finish_reason: ${data.finish_reason} · prompt ${u.prompt_tokens} + completion ${u.completion_tokens} tokens`;
    return true;
  }
  if (type === "error") {
    setStatus("failed");
    $("job-meta").textContent = `${data.type}: ${data.message}`;
    return true;
  }
  return false;
}

function showCursor() {
  const out = $("output");
  out.dataset.tokens = String(view.tokens);
  out.dataset.lastEventId = String(view.lastId);
  out.scrollTop = out.scrollHeight;
}

function finished() {
  view.stream = null;
  $("cancel").disabled = true;
  setStream("ended");
  banner("");
  refreshJobs();
}

function setStatus(status) {
  const pill = $("job-status");
  pill.textContent = status;
  pill.dataset.state = status;
}

function setStream(text) {
  $("stream-state").textContent = text;
}

async function refreshJob(jobId) {
  try {
    const job = await getJson(`/v1/jobs/${encodeURIComponent(jobId)}`);
    if (view.jobId === jobId && ["queued", "running"].includes(job.status) && !view.tokens) setStatus(job.status);
  } catch (err) {
    /* the stream reports its own errors */
  }
}

// ---- submit and cancel ----------------------------------------------------------------------

function jobBody() {
  const num = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const body = {
    max_tokens: num("max_tokens"),
    temperature: num("temperature"),
    top_p: num("top_p"),
    top_k: num("top_k"),
    seed: num("seed"),
  };
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if (document.querySelector("input[name=mode]:checked").value === "chat") {
    const system = $("system").value.trim();
    body.messages = [...(system ? [{ role: "system", content: system }] : []), { role: "user", content: $("prompt").value }];
  } else {
    body.prompt = $("prompt").value;
  }
  return JSON.stringify(body);
}

async function submit(e) {
  e.preventDefault();
  $("submit").disabled = true;
  try {
    const r = await request("/v1/jobs", { method: "POST", headers: { "Content-Type": "application/json" }, body: jobBody() });
    const job = await r.json();
    banner("");
    setStatus(job.status);
    follow(job.id);
    refreshJobs();
  } catch (err) {
    banner(explain(err));
  } finally {
    $("submit").disabled = false;
  }
}

async function cancel() {
  if (!view.jobId) return;
  try {
    await request(`/v1/jobs/${encodeURIComponent(view.jobId)}/cancel`, { method: "POST" });
    setStream("cancel requested");
  } catch (err) {
    banner(explain(err));
  }
}

// ---- recent jobs and the cluster ------------------------------------------------------------

async function refreshJobs() {
  const list = $("jobs");
  try {
    const page = await getJson("/v1/jobs?limit=10");
    $("jobs-note").textContent = page.data.length ? "" : "No jobs yet.";
    list.replaceChildren(...page.data.map(jobItem));
  } catch (err) {
    $("jobs-note").textContent = explain(err);
  }
}

function jobItem(job) {
  const li = document.createElement("li");
  const status = document.createElement("span");
  status.className = "pill";
  status.dataset.state = job.status;
  status.textContent = job.status;
  const link = document.createElement("a");
  link.href = `?job=${encodeURIComponent(job.id)}`;
  link.textContent = job.id.slice(0, 12);
  link.title = job.id;
  link.addEventListener("click", (e) => { e.preventDefault(); follow(job.id); });
  const when = document.createElement("span");
  when.className = "when";
  when.textContent = `${job.usage.completion_tokens} tok · ${new Date(job.created_at * 1000).toLocaleTimeString()}`;
  li.append(status, link, when);
  return li;
}

async function refreshCluster() {
  const health = $("health");
  const set = (state, text) => { health.dataset.state = state; health.textContent = text; };
  try {
    const s = await getJson("/console-status");
    const n = s.workers.length;
    set(n ? "ok" : "no-worker", n ? `API ok · ${n} worker${n > 1 ? "s" : ""}` : "API ok · no worker");
    $("workers").tBodies[0].replaceChildren(...s.workers.map(workerRow));
    const queues = Object.entries(s.queues).map(([q, depth]) => `${q} ${depth}`).join(" · ");
    $("queues").textContent = `queued jobs: ${s.queued_jobs} · queue messages: ${queues}`;
  } catch (err) {
    if (err.status === 0) set("api-down", "API unreachable");
    else if (err.code === "backend_unavailable") set("redis-down", "Redis unreachable");
    else set("error", explain(err));
    $("workers").tBodies[0].replaceChildren();
    $("queues").textContent = explain(err);
  }
}

function workerRow(w) {
  const tr = document.createElement("tr");
  const e = w.engine;
  const kv = typeof e.kv_cache_usage === "number" ? `${Math.round(e.kv_cache_usage * 100)}%` : "–";
  for (const v of [`${w.name} (${w.model})`, e.running, e.waiting, e.slots, kv]) {
    const td = document.createElement("td");
    td.textContent = v ?? "–";
    tr.append(td);
  }
  return tr;
}

// ---- start ----------------------------------------------------------------------------------

function start() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    if (key.value) sessionStorage.setItem(KEY_STORE, key.value);
    else sessionStorage.removeItem(KEY_STORE);
    banner("");
    refreshJobs();
  });
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", () => {
      const chat = radio.value === "chat" && radio.checked;
      $("system").hidden = !chat;
      $("prompt").placeholder = chat ? "User message" : "Prompt";
    });
  }
  $("job-form").addEventListener("submit", submit);
  $("cancel").addEventListener("click", cancel);
  $("refresh-jobs").addEventListener("click", refreshJobs);
  const jobId = new URLSearchParams(location.search).get("job");
  if (jobId) follow(jobId); // a reload resumes the job's stream from its first event
  refreshJobs();
  refreshCluster();
  setInterval(refreshCluster, POLL_MS);
}

start();
