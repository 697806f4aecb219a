// Spool's console: submit a job, watch its tokens stream in, resume a dropped stream by itself.
//
// Streams are read with fetch(), not EventSource: EventSource cannot send an Authorization
// header, and the alternative (the key in the URL) would put a long-lived key in access logs and
// the browser's history. The key is kept in this tab's sessionStorage and sent as
// "Authorization: Bearer KEY" on every request. fetch() does not resume by itself, so follow()
// does: it reconnects with Last-Event-ID set to the last event it showed and drops any event id
// it has seen, so a token is never shown twice or skipped.
//
// A job with parts (text and image) shows each part with its own status; an image part's
// denoising progress comes in its progress events, and its PNG is fetched (with the key) once
// the part succeeded. Batches are listed with their live request counts, can be cancelled, and
// their output and error files are shown in the page (fetched with the key, so no key in a URL).
// A job with a webhook shows its deliveries (each attempt's time and answer, the next retry),
// polled while one is pending.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "spool-api-key";
const HIDE_LINES_STORE = "spool-hide-batch-lines"; // the recent jobs' toggle, kept across reloads
const POLL_MS = 2000;
const RETRY_MAX_MS = 4000;

const view = {
  jobId: null,
  lastId: 0, // id of the last event shown: the cursor a reconnect resumes after
  tokens: 0, // token events shown
  stream: null, // AbortController of the stream being followed
  partTokens: new Map(), // part index -> its token events shown (a token's index counts its part's)
  images: [], // object URLs of the images shown, revoked when another job is shown
  hooksTimer: null, // the next poll of the job's webhook deliveries
  queueTimer: null, // the next poll of a queued job's place and start estimate
};
const CANCELLABLE_BATCH = ["validating", "in_progress"];
const ENDED_EARLY = ["cancelled", "failed", "expired"]; // a batch whose lines did not all run

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

// NOTE: a JSON number past 2^53 (an image's seed) loses digits as a JS number; such an integer
// is kept as its text, so a seed copied from the page makes the same image.
function parseJson(text) {
  return JSON.parse(text, (key, value, context) =>
    typeof value === "number" && !Number.isSafeInteger(value) && context && /^-?\d+$/.test(context.source)
      ? context.source : value);
}

async function getJson(path, options) {
  return parseJson(await (await request(path, options)).text());
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
// submittedAt: performance.now() of its submit from this page (its time to first token is shown).
async function follow(jobId, submittedAt = null) {
  if (view.stream) view.stream.abort();
  const ctrl = new AbortController();
  Object.assign(view, { jobId, lastId: 0, tokens: 0, stream: ctrl, submittedAt, firstTokenAt: null });
  view.partTokens.clear();
  for (const u of view.images.splice(0)) URL.revokeObjectURL(u);
  $("parts").replaceChildren();
  $("parts").hidden = true;
  $("output").textContent = "";
  $("choices").replaceChildren();
  $("choices").hidden = true;
  $("tool-calls").replaceChildren();
  $("tool-calls").hidden = true;
  showCursor();
  $("job-id").textContent = jobId;
  $("job-meta").textContent = "";
  clearTimeout(view.hooksTimer);
  clearTimeout(view.queueTimer);
  $("queue-info").hidden = true;
  $("webhooks").replaceChildren();
  $("webhooks-view").hidden = true;
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
        if (show(ev.event, parseJson(ev.data))) {
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
    const k = data.part ?? 0;
    const before = view.partTokens.get(k) || 0;
    if (data.index !== before) {
      // Cannot happen while ids are consecutive; say so rather than show a garbled text.
      banner(`token index ${data.index} arrived after ${before} tokens`);
    }
    view.partTokens.set(k, before + 1);
    view.tokens += 1;
    if (view.firstTokenAt === null) view.firstTokenAt = performance.now();
    choiceOutput(data.choice ?? 0).append(data.text);
    showCursor();
    setStatus("running");
    if (data.part !== undefined) updatePart(k, { type: "text", status: "running" }, true);
    return false;
  }
  if (type === "part") {
    updatePart(data.part, data, true);
    if (data.status === "running") setStatus("running");
    return false;
  }
  if (type === "progress") {
    updatePart(data.part, { type: "image", status: "running", step: data.step, steps: data.steps }, true);
    setStatus("running");
    return false;
  }
  if (type === "done") {
    setStatus(data.status);
    if (data.parts) {
      data.parts.forEach((summary, k) => updatePart(k, summary, true));
      const counts = {};
      for (const p of data.parts) counts[p.status] = (counts[p.status] || 0) + 1;
      $("job-meta").textContent = "parts: " + Object.entries(counts).map(([st, n]) => `${n} ${st}`).join(", ");
    } else {
      const u = data.usage || {};
      $("job-meta").textContent =
        `finish_reason: ${data.finish_reason} · prompt ${u.prompt_tokens} + completion ${u.completion_tokens} tokens`;
      showSpeed(view.jobId, u.completion_tokens);
      if (data.status === "succeeded") chatReplied(view.jobId);
    }
    return true;
  }
  if (type === "error") {
    setStatus("failed");
    $("job-meta").textContent = `${data.type}: ${data.message}`;
    return true;
  }
  return false;
}

// ---- chat: the conversation so far goes with each next message ---------------------------------

const chat = { turns: [], pending: null }; // pending: the user message whose reply is awaited

// The reply joins the conversation: its text, or, when the request had tools, the text and the
// calls the server parsed from it (the job's OpenAI-shaped stream: delta.tool_calls), shown apart.
async function chatReplied(jobId) {
  if (!chat.pending || chat.pending.jobId !== jobId) return;
  const pending = chat.pending;
  chat.pending = null;
  let reply = { role: "assistant", content: $("output").textContent };
  if (pending.tools) {
    try {
      reply = await parsedReply(jobId);
    } catch (err) {
      banner(explain(err));
    }
    showToolCalls(reply.tool_calls || []);
  }
  chat.turns.push(pending.user, reply);
  $("prompt").value = "";
  showConversation();
}

async function parsedReply(jobId) {
  const r = await request(`/v1/jobs/${encodeURIComponent(jobId)}/events?format=openai`);
  let content = "";
  const calls = [];
  for await (const ev of sseEvents(r.body)) {
    if (ev.data === "[DONE]") break;
    const delta = parseJson(ev.data).choices?.[0]?.delta || {};
    content += delta.content || "";
    for (const c of delta.tool_calls || []) {
      const call = (calls[c.index] ||= { id: c.id, type: "function", function: { name: "", arguments: "" } });
      call.function.name += c.function?.name || "";
      call.function.arguments += c.function?.arguments || "";
    }
  }
  return calls.length ? { role: "assistant", content: content || null, tool_calls: calls } : { role: "assistant", content };
}

function showToolCalls(calls) {
  $("tool-calls").replaceChildren(...calls.map((c) => {
    const li = document.createElement("li");
    li.dataset.name = c.function.name;
    li.dataset.arguments = c.function.arguments;
    li.textContent = `${c.function.name}(${c.function.arguments})`;
    return li;
  }));
  $("tool-calls").hidden = !calls.length;
}

function newChat() {
  chat.turns = [];
  chat.pending = null;
  showConversation();
}

function showConversation() {
  $("conversation").replaceChildren(...chat.turns.map((m) => {
    const li = document.createElement("li");
    li.dataset.role = m.role;
    const calls = (m.tool_calls || []).map((c) => `${c.function.name}(${c.function.arguments})`);
    li.textContent = [m.content, ...calls].filter(Boolean).join("\n");
    return li;
  }));
  $("conversation").hidden = !chat.turns.length;
}

// A finished text job's rate over its generation (a worker took it until it ended, from the
// job's timestamps) and, for a job submitted from this page, its time to first token.
async function showSpeed(jobId, tokens) {
  const ttft = view.submittedAt !== null && view.firstTokenAt !== null
    ? ` · TTFT ${((view.firstTokenAt - view.submittedAt) / 1000).toFixed(2)} s` : "";
  try {
    const job = await getJson(`/v1/jobs/${encodeURIComponent(jobId)}`);
    if (jobId !== view.jobId || !job.started_at || !job.finished_at) return;
    const seconds = Math.max(job.finished_at - job.started_at, 1e-3);
    $("job-meta").dataset.tokPerS = (tokens / seconds).toFixed(1);
    $("job-meta").textContent += ` · ${(tokens / seconds).toFixed(1)} tok/s${ttft}`;
  } catch (err) {
    // the figures are extras: the job's own line stays as it is
  }
}

// ---- parts ----------------------------------------------------------------------------------

// The part's row in #parts, made on first sight: a part event or the job's parts may come first.
function partRow(k) {
  let li = $("parts").querySelector(`li[data-part="${k}"]`);
  if (li) return li;
  li = document.createElement("li");
  li.className = "part";
  li.dataset.part = String(k);
  li.dataset.type = "";
  li.dataset.tokens = "0";
  const head = document.createElement("div");
  head.className = "part-head";
  const pill = document.createElement("span");
  pill.className = "pill";
  const name = document.createElement("b");
  name.textContent = `part ${k}`;
  const kind = document.createElement("span");
  kind.className = "kind";
  const detail = document.createElement("span");
  detail.className = "detail";
  head.append(pill, name, kind, detail);
  const bar = document.createElement("progress");
  bar.hidden = true;
  const img = document.createElement("img");
  img.hidden = true;
  img.alt = `image of part ${k}`;
  const error = document.createElement("p");
  error.className = "part-error";
  li.append(head, bar, img, error);
  // Rows in part order, whichever came first.
  const after = [...$("parts").children].find((el) => Number(el.dataset.part) > k);
  $("parts").insertBefore(li, after || null);
  $("parts").hidden = false;
  return li;
}

// Show what is known of part k; from the job's GET (fromEvent false), a status only until its
// events say more (a GET may answer after a later event was shown).
function updatePart(k, info, fromEvent) {
  if (k === undefined || k === null) return;
  const li = partRow(k);
  const type = info.type || (info.url || info.step ? "image" : li.dataset.type);
  if (type) {
    li.dataset.type = type;
    li.querySelector(".kind").textContent = type;
  }
  if (info.status && (fromEvent || !li.dataset.fromEvents)) {
    li.dataset.status = info.status;
    const pill = li.querySelector(".pill");
    pill.textContent = info.status;
    pill.dataset.state = info.status;
  }
  if (fromEvent) li.dataset.fromEvents = "1";
  if (type === "text") {
    li.dataset.tokens = String(view.partTokens.get(k) || 0);
    li.querySelector(".detail").textContent = `${li.dataset.tokens} tokens`;
  }
  if (info.steps) {
    const bar = li.querySelector("progress");
    bar.hidden = false;
    bar.max = info.steps;
    bar.value = info.step || 0;
    li.querySelector(".detail").textContent = `step ${info.step || 0}/${info.steps}`;
  }
  if (info.error) li.querySelector(".part-error").textContent = `${info.error.type}: ${info.error.message}`;
  if (info.url && info.status === "succeeded") showImage(li, info);
}

async function showImage(li, info) {
  const img = li.querySelector("img");
  if (img.dataset.url === info.url) return;
  img.dataset.url = info.url;
  const jobId = view.jobId;
  try {
    const blob = await (await request(info.url)).blob(); // with the key: an <img src> could not send it
    if (view.jobId !== jobId) return;
    const src = URL.createObjectURL(blob);
    view.images.push(src);
    img.onload = () => { img.dataset.loaded = "1"; };
    img.src = src;
    img.width = info.width || img.width;
    img.height = info.height || img.height;
    img.hidden = false;
    const seed = info.seed !== undefined ? ` · seed ${info.seed}` : "";
    li.querySelector(".detail").textContent = `${info.width}x${info.height}${seed}`;
  } catch (err) {
    delete img.dataset.url; // the next event or reload tries again
    li.querySelector(".part-error").textContent = `the image could not be read: ${explain(err)}`;
  }
}

// Where a choice's text goes: choice 0 (and a job of one choice) in #output, each other
// choice of a job with n > 1 in a block of its own below it, so their texts do not interleave.
function choiceOutput(choice) {
  if (choice === 0) return $("output");
  const blocks = $("choices");
  let pre = blocks.querySelector(`pre[data-choice="${choice}"]`);
  if (!pre) {
    const head = document.createElement("h3");
    head.textContent = `choice ${choice}`;
    pre = document.createElement("pre");
    pre.className = "choice";
    pre.dataset.choice = String(choice);
    blocks.append(head, pre);
    blocks.hidden = false;
  }
  return pre;
}

function showCursor() {
  const out = $("output");
  out.dataset.tokens = String(view.tokens);
  out.dataset.lastEventId = String(view.lastId);
  out.scrollTop = out.scrollHeight;
}

function finished() {
  view.stream = null;
  refreshWebhooks(view.jobId);
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
    if (view.jobId !== jobId) return;
    if (["queued", "running"].includes(job.status) && !view.tokens) setStatus(job.status);
    for (const part of job.parts || []) updatePart(part.index, part, false);
    showQueue(jobId, job);
  } catch (err) {
    /* the stream reports its own errors */
  }
  refreshWebhooks(jobId);
}

// A queued job's place (queue_position) and start estimate (estimated_start_s), read again every
// POLL_MS until it leaves the queue.
function showQueue(jobId, job) {
  clearTimeout(view.queueTimer);
  const info = $("queue-info");
  info.hidden = job.status !== "queued" || view.tokens > 0;
  if (info.hidden || job.queue_position === null || job.queue_position === undefined) return;
  const n = job.queue_position;
  const estimate = job.estimated_start_s ?? null;
  info.dataset.position = String(n);
  info.dataset.estimate = estimate === null ? "" : String(estimate);
  const start = estimate === null
    ? "no start estimate (no live worker of its model, or none of its jobs ended yet)"
    : `starts in about ${estimate < 90 ? `${Math.round(estimate)} s` : `${Math.round(estimate / 60)} min`}`;
  info.textContent = `queued · ${n} job${n === 1 ? "" : "s"} ahead · ${start}`;
  view.queueTimer = setTimeout(async () => {
    try {
      const again = await getJson(`/v1/jobs/${encodeURIComponent(jobId)}`);
      if (view.jobId === jobId) showQueue(jobId, again);
    } catch (err) {
      if (view.jobId === jobId) showQueue(jobId, job); // try again at the next poll
    }
  }, POLL_MS);
}

// ---- the job's webhook deliveries -----------------------------------------------------------

const clock = (t) => new Date(t * 1000).toLocaleTimeString();

async function refreshWebhooks(jobId) {
  clearTimeout(view.hooksTimer);
  let page;
  try {
    page = await getJson(`/v1/jobs/${encodeURIComponent(jobId)}/webhooks`);
  } catch (err) {
    return; // the job's own view says what is wrong
  }
  if (view.jobId !== jobId) return;
  $("webhooks").replaceChildren(...page.data.map(deliveryItem));
  $("webhooks-view").hidden = !page.data.length;
  if (page.data.some((d) => d.status === "pending")) {
    view.hooksTimer = setTimeout(() => refreshWebhooks(jobId), POLL_MS);
  }
}

// A delivery: its status, event type and URL, then a line per attempt.
function deliveryItem(d) {
  const li = document.createElement("li");
  li.className = "delivery";
  li.dataset.id = d.id;
  const status = document.createElement("span");
  status.className = "pill";
  status.dataset.state = d.status;
  status.textContent = d.status;
  const type = document.createElement("code");
  type.className = "type";
  type.textContent = d.type;
  const url = document.createElement("span");
  url.className = "url";
  url.textContent = d.url;
  const attempts = document.createElement("ol");
  attempts.className = "attempts";
  for (const a of d.attempts) {
    const row = document.createElement("li");
    const answer = a.status_code != null ? `HTTP ${a.status_code}` : a.error;
    const retry = a.next_attempt_at ? ` · retry at ${clock(a.next_attempt_at)}` : "";
    row.textContent = `${clock(a.at)} · ${answer}${retry}`;
    attempts.append(row);
  }
  const next = document.createElement("span");
  next.className = "next";
  if (d.status === "pending") {
    next.textContent = d.next_attempt_at ? `next retry at ${clock(d.next_attempt_at)}` : "due";
  }
  li.append(status, type, url, next, attempts);
  return li;
}

// ---- submit and cancel ----------------------------------------------------------------------

const num = (id) => ($(id).value === "" ? undefined : Number($(id).value));

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function imagePart(prompt) {
  const part = { type: "image", size: $("image-size").value.trim() || undefined, steps: num("image-steps"), seed: num("image-seed") };
  // No image prompt with a text part: the image takes the text part's final text.
  return prompt ? { ...part, prompt } : { ...part, prompt_from: 0 };
}

function toolsJson(text) {
  try {
    return parseJson(text);
  } catch (err) {
    throw new Error(`Tools are not JSON: ${err.message}`);
  }
}

function jobBody() {
  if (mode() === "image") return JSON.stringify({ parts: [imagePart($("prompt").value)] });
  const body = {
    max_tokens: num("max_tokens"),
    temperature: num("temperature"),
    top_p: num("top_p"),
    top_k: num("top_k"),
    seed: num("seed"),
  };
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  const model = $("model").value; // the job's, its text part's with an image part
  if (model) body.model = model;
  if (mode() === "chat") {
    const system = $("system").value.trim();
    const user = { role: "user", content: $("prompt").value };
    const tools = $("tools").value.trim() ? toolsJson($("tools").value) : null;
    chat.pending = { jobId: null, user, tools };
    body.messages = [...(system ? [{ role: "system", content: system }] : []), ...chat.turns, user];
    if (tools) Object.assign(body, { tools, tool_choice: $("tool-choice").value });
  } else {
    body.prompt = $("prompt").value;
  }
  if (!$("with-image").checked) return JSON.stringify(body);
  const { model: named, ...text } = body;
  const parts = [{ type: "text", ...text }, imagePart($("image-prompt").value.trim())];
  return JSON.stringify({ ...(named ? { model: named } : {}), parts });
}

// The job's text (every choice's, one after another) to the clipboard; the button says it did.
async function copyText() {
  const choices = [...document.querySelectorAll("#choices .choice")].map((el) => el.textContent);
  const text = $("choices").hidden ? $("output").textContent : choices.join("\n\n");
  try {
    await navigator.clipboard.writeText(text);
    $("copy").textContent = "Copied";
  } catch (err) {
    banner(`Copy failed: ${err.message}`);
  }
  setTimeout(() => { $("copy").textContent = "Copy"; }, 1500);
}

async function submit(e) {
  e.preventDefault();
  $("submit").disabled = true;
  try {
    const submittedAt = performance.now();
    const r = await request("/v1/jobs", { method: "POST", headers: { "Content-Type": "application/json" }, body: jobBody() });
    const job = parseJson(await r.text());
    banner("");
    setStatus(job.status);
    if (mode() === "chat" && chat.pending) chat.pending.jobId = job.id;
    follow(job.id, submittedAt);
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
    const hide = $("hide-batch-lines").checked;
    const page = await getJson(`/v1/jobs?limit=10${hide ? "&batch_lines=false" : ""}`);
    if (hide !== $("hide-batch-lines").checked) return; // toggled meanwhile: its own refresh shows
    $("jobs-note").textContent = page.data.length ? "" : hide ? "No jobs but batch lines." : "No jobs yet.";
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
  const n = job.parts ? job.parts.length : 0;
  const parts = n ? `${n} ${n === 1 ? "part" : "parts"} · ` : "";
  if (job.batch_id) {
    li.dataset.batchId = job.batch_id;
    li.title = `a line of ${job.batch_id}`;
  }
  const line = job.batch_id ? "batch line · " : "";
  when.textContent = `${line}${parts}${job.usage.completion_tokens} tok · ${new Date(job.created_at * 1000).toLocaleTimeString()}`;
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
    await refreshModels();
  } catch (err) {
    if (err.status === 0) set("api-down", "API unreachable");
    else if (err.code === "backend_unavailable") set("redis-down", "Redis unreachable");
    else set("error", explain(err));
    $("workers").tBodies[0].replaceChildren();
    $("queues").textContent = explain(err);
  }
}

// The model picker: shown while more than one model is served (GET /v1/models), its choice kept
// while that model is served. A job that names none runs on the first served, in name order.
async function refreshModels() {
  let ids;
  try {
    ids = (await getJson("/v1/models")).data.map((m) => m.id).sort();
  } catch {
    return; // (without the API key, say): the picker stays as it was
  }
  const select = $("model");
  const chosen = ids.includes(select.value) ? select.value : "";
  const shown = [...select.options].slice(1).map((o) => o.value);
  if (shown.join("\n") !== ids.join("\n")) {
    select.replaceChildren(select.options[0], ...ids.map((id) => new Option(id.split("/").pop(), id)));
  }
  select.value = chosen;
  $("model-label").hidden = ids.length < 2;
}

// A text worker: its engine's requests, slots and KV usage. A media worker runs one image part
// at a time and has neither: its part's denoising step instead (or idle, with the images made).
function workerRow(w) {
  const tr = document.createElement("tr");
  const e = w.engine;
  const kind = w.kind || "text";
  tr.dataset.kind = kind;
  const cell = (v, span = 1) => {
    const td = document.createElement("td");
    td.textContent = v ?? "–";
    td.colSpan = span;
    tr.append(td);
    return td;
  };
  cell(`${w.name} (${w.model})`);
  cell(kind);
  cell(e.running);
  if (kind === "media") {
    cell(null);
    const made = e.images ?? 0;
    const image = e.part ? `image step ${e.step}/${e.steps}` : `idle · ${made} image${made === 1 ? "" : "s"} made`;
    cell(image, 2).className = "media";
    if (e.part) tr.title = e.part;
    return tr;
  }
  const kv = typeof e.kv_cache_usage === "number" ? `${Math.round(e.kv_cache_usage * 100)}%` : "–";
  for (const v of [e.waiting, e.slots, kv]) cell(v);
  return tr;
}

// ---- batches --------------------------------------------------------------------------------

async function refreshBatches() {
  const list = $("batches");
  try {
    const page = await getJson("/v1/batches?limit=10");
    $("batches-note").textContent = page.data.length ? "" : "No batches yet.";
    // Rows are kept and updated in place, so a button is not replaced under the pointer.
    const rows = new Map([...list.children].map((li) => [li.dataset.batchId, li]));
    list.replaceChildren(...page.data.map((b) => batchRow(rows.get(b.id), b)));
  } catch (err) {
    $("batches-note").textContent = explain(err);
  }
}

function batchRow(li, b) {
  if (!li) {
    li = document.createElement("li");
    li.dataset.batchId = b.id;
    li.innerHTML =
      '<div class="batch-head"><span class="pill"></span><code></code><span class="counts"></span></div>' +
      '<progress></progress><div class="batch-actions"></div>';
    li.querySelector("code").textContent = b.id.slice(0, 18);
    li.querySelector("code").title = b.id;
  }
  const c = b.request_counts;
  const done = c.completed + c.failed;
  li.dataset.status = b.status;
  li.dataset.total = String(c.total);
  li.dataset.completed = String(c.completed);
  li.dataset.failed = String(c.failed);
  const pill = li.querySelector(".pill");
  pill.textContent = b.status;
  pill.dataset.state = b.status;
  const bar = li.querySelector("progress");
  bar.max = Math.max(c.total, 1);
  // A batch that ended early fills its bar with the lines that succeeded only: its cancelled
  // lines count as failed, and a full bar would read as a completed batch.
  bar.value = ENDED_EARLY.includes(b.status) ? c.completed : done;
  bar.dataset.state = b.status;
  li.querySelector(".counts").textContent =
    `${done}/${c.total} · ${c.completed} completed · ${c.failed} failed · ${b.endpoint}`;
  const actions = li.querySelector(".batch-actions");
  const want = [
    ...(CANCELLABLE_BATCH.includes(b.status) ? [["cancel", "Cancel"]] : []),
    ...(b.output_file_id ? [["output", "output lines"]] : []),
    ...(b.error_file_id ? [["errors", "error lines"]] : []),
    ["input", "input lines"],
  ];
  if (actions.dataset.want !== JSON.stringify(want)) {
    actions.dataset.want = JSON.stringify(want);
    actions.replaceChildren(...want.map(([what, label]) => batchAction(b, what, label)));
  }
  return li;
}

function batchAction(b, what, label) {
  if (what === "cancel") {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "small cancel-batch";
    button.textContent = label;
    button.addEventListener("click", () => cancelBatch(b.id, button));
    return button;
  }
  const fileId = { output: b.output_file_id, errors: b.error_file_id, input: b.input_file_id }[what];
  const a = document.createElement("a");
  a.href = `/v1/files/${encodeURIComponent(fileId)}/content`; // read with fetch(), with the key
  a.className = `file-${what}`;
  a.textContent = label;
  a.addEventListener("click", (e) => { e.preventDefault(); showFile(fileId, `${label} of ${b.id}`, what !== "input"); });
  return a;
}

async function cancelBatch(batchId, button) {
  button.disabled = true;
  try {
    await request(`/v1/batches/${encodeURIComponent(batchId)}/cancel`, { method: "POST" });
  } catch (err) {
    banner(explain(err));
    button.disabled = false;
  }
  refreshBatches();
}

// One output or error line as a person reads it: its custom_id and the response's text (a
// chat message's, a completion's or a job's), or the error's message.
function readableLine(line) {
  let row;
  try {
    row = parseJson(line);
  } catch {
    return line;
  }
  const body = (row.response && row.response.body) || {};
  const choice = (body.choices || [])[0];
  const error = row.error || body.error;
  const text = choice ? (choice.message ? choice.message.content : choice.text)
    : body.text !== undefined ? body.text : error ? `error: ${error.message}` : null;
  return text === null || text === undefined ? line : `${row.custom_id}: ${text}`;
}

async function showFile(fileId, title, readable) {
  try {
    const text = await (await request(`/v1/files/${encodeURIComponent(fileId)}/content`)).text();
    const rows = text.split("\n").filter((l) => l.trim());
    $("batch-file-title").textContent = `${title} (${rows.length} lines)`;
    $("batch-lines").textContent = readable ? rows.map(readableLine).join("\n") : text;
    $("batch-lines").dataset.fileId = fileId;
    const download = $("batch-file-download");
    if (download.href.startsWith("blob:")) URL.revokeObjectURL(download.href);
    download.href = URL.createObjectURL(new Blob([text], { type: "application/jsonl" }));
    download.download = `${fileId}.jsonl`;
    $("batch-file-view").hidden = false;
  } catch (err) {
    banner(explain(err));
  }
}

async function startBatch(e) {
  e.preventDefault();
  const file = $("batch-file").files[0];
  if (!file) return;
  $("batch-submit").disabled = true;
  try {
    const form = new FormData();
    form.append("purpose", "batch");
    form.append("file", file, file.name);
    const uploaded = await (await request("/v1/files", { method: "POST", body: form })).json();
    const body = { input_file_id: uploaded.id, endpoint: $("batch-endpoint").value, completion_window: "24h" };
    await request("/v1/batches", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    banner("");
    $("batch-form").reset();
  } catch (err) {
    banner(explain(err));
  } finally {
    $("batch-submit").disabled = false;
  }
  refreshBatches();
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
    refreshBatches();
  });
  const showForm = () => {
    const m = mode();
    $("system").hidden = m !== "chat";
    $("chat").hidden = m !== "chat";
    $("prompt").placeholder = { chat: "User message", image: "Image prompt" }[m] || "Prompt";
    $("text-params").hidden = m === "image";
    $("with-image-label").hidden = m === "image";
    $("image-prompt-label").hidden = m === "image"; // the prompt above is the image's
    $("image-params").hidden = m !== "image" && !$("with-image").checked;
  };
  for (const radio of document.querySelectorAll("input[name=mode]")) radio.addEventListener("change", showForm);
  $("with-image").addEventListener("change", showForm);
  showForm();
  $("job-form").addEventListener("submit", submit);
  $("cancel").addEventListener("click", cancel);
  $("copy").addEventListener("click", copyText);
  $("new-chat").addEventListener("click", newChat);
  $("refresh-jobs").addEventListener("click", refreshJobs);
  const hideLines = $("hide-batch-lines");
  hideLines.checked = localStorage.getItem(HIDE_LINES_STORE) === "1";
  hideLines.addEventListener("change", () => {
    if (hideLines.checked) localStorage.setItem(HIDE_LINES_STORE, "1");
    else localStorage.removeItem(HIDE_LINES_STORE);
    refreshJobs();
  });
  $("refresh-batches").addEventListener("click", refreshBatches);
  $("batch-form").addEventListener("submit", startBatch);
  const jobId = new URLSearchParams(location.search).get("job");
  if (jobId) follow(jobId); // a reload resumes the job's stream from its first event
  refreshJobs();
  refreshCluster();
  refreshBatches();
  setInterval(() => {
    refreshCluster();
    refreshBatches(); // their live request counts and status
  }, POLL_MS);
}

start();
