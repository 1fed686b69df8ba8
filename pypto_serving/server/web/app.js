// The page pypto serve answers at /: chat over /v1/chat/completions (streamed), and a
// dashboard polling /stats (the numbers of /metrics, as JSON). Plain script, no build step,
// nothing fetched from outside the server. The conversations, the settings and the API key
// are kept in the browser's localStorage.
"use strict";

const STORE = {
  chats: "pypto.chats", current: "pypto.current", chat: "pypto.chat",
  settings: "pypto.settings", key: "pypto.key",
};
const DEFAULTS = { system: "", temperature: 0.7, max_tokens: 512 };
const POLL_MS = 1000;
const CHART_POINTS = 120;
const TIERS = ["device", "cpu", "ssd", "remote"];

const $ = (id) => document.getElementById(id);
const load = (k, fallback) => {
  try { return JSON.parse(localStorage.getItem(k)) ?? fallback; } catch { return fallback; }
};
const save = (k, v) => localStorage.setItem(k, JSON.stringify(v));

// the conversations, newest first: [{id, messages: [{role, content, stats?}]}]; a
// page from before the list had one conversation, under STORE.chat: it becomes the first
let chats = load(STORE.chats, null) ?? [{ id: Date.now(), messages: load(STORE.chat, []) }];
let current = chats.find((c) => c.id === load(STORE.current, null)) ?? chats[0];
let messages = current.messages;
let settings = { ...DEFAULTS, ...load(STORE.settings, {}) };
let apiKey = load(STORE.key, "");
let model = null;
let controller = null;                  // the reply being streamed (AbortController)

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function api(path, init = {}) {
  const r = await fetch(path, { ...init, headers: headers() });
  if (r.status === 401) { askForKey("the API key was refused"); throw new Error("unauthorized"); }
  return r;
}

// --- the API key --------------------------------------------------------------------------

function askForKey(why) {
  $("key-panel").hidden = false;
  $("key-error").textContent = apiKey ? why : "";
  $("api-key").focus();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("api-key").value.trim();
  save(STORE.key, apiKey);
  $("key-panel").hidden = true;
  start();
});

// --- Markdown (escaped first: the model's text never becomes markup) ---------------------

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(s) {
  return s
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
}

function markdown(text) {
  const out = [];
  const parts = escapeHtml(text).split(/^```/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {  // a code block: its first line names the language
      const nl = part.indexOf("\n");
      const code = nl < 0 ? "" : part.slice(nl + 1);
      out.push(`<pre><code>${code.replace(/\n$/, "")}</code></pre>`);
      return;
    }
    let list = null;
    for (const line of part.split("\n")) {
      const item = line.match(/^\s*(?:[-*]|(\d+)\.)\s+(.*)$/);
      if (item) {
        const kind = item[1] === undefined ? "ul" : "ol";
        if (list !== kind) {
          if (list) out.push(`</${list}>`);
          // a list opens at its first item's number: "3." then "4." is 3, 4, not 1, 2
          out.push(kind === "ol" && item[1] !== "1" ? `<ol start="${Number(item[1])}">` : `<${kind}>`);
          list = kind;
        }
        out.push(`<li>${inline(item[2])}</li>`);
        continue;
      }
      if (list && !line.trim()) continue;  // a blank line between items keeps the list open
      if (list) { out.push(`</${list}>`); list = null; }
      const heading = line.match(/^(#{1,4})\s+(.*)$/);
      if (heading) out.push(`<h${heading[1].length + 2}>${inline(heading[2])}</h${heading[1].length + 2}>`);
      else if (line.trim()) out.push(`<p>${inline(line)}</p>`);
    }
    if (list) out.push(`</${list}>`);
  });
  return out.join("");
}

// --- chat ---------------------------------------------------------------------------------

function statsText(s) {
  if (!s) return "";
  const tiers = TIERS.filter((t) => s.tiers && s.tiers[t] !== undefined)
    .map((t) => `${t} ${s.tiers[t]}`).join(", ");
  const parts = [`prompt ${s.prompt} tok`, `cached ${s.cached}${tiers ? ` (${tiers})` : ""}`];
  if (s.ttft !== undefined) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
  if (s.tps !== undefined) parts.push(`${s.tps.toFixed(1)} tok/s`);
  if (s.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageItem(m, i) {
  const li = document.createElement("li");
  li.className = m.role;
  if (m.role === "user") li.textContent = m.content;
  else {
    li.innerHTML = markdown(m.content);
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = statsText(m.stats);
    li.appendChild(stats);
    const actions = document.createElement("span");
    actions.className = "actions";
    actions.appendChild(action("Copy", "copy", () => copy(m.content)));
    if (i === messages.length - 1) actions.appendChild(action("Regenerate", "regenerate", regenerate));
    li.appendChild(actions);
  }
  return li;
}

function action(label, name, run) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.dataset.action = name;
  b.addEventListener("click", run);
  return b;
}

async function copy(text) {
  try { await navigator.clipboard.writeText(text); $("chat-error").textContent = ""; }
  catch { $("chat-error").textContent = "the browser did not allow copying"; }
}

function regenerate() {
  // the last reply again: it goes, and its question is asked once more
  if (controller || messages.length < 2 || messages.at(-1).role !== "assistant") return;
  messages.pop();
  const question = messages.pop();
  send(question.content);
}

function titleOf(chat) {
  const first = chat.messages.find((m) => m.role === "user");
  return first ? first.content.slice(0, 40) : "New chat";
}

function renderChats() {
  const list = $("conversations");
  list.replaceChildren(...chats.map((chat) => {
    const li = document.createElement("li");
    if (chat === current) li.setAttribute("aria-current", "true");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = titleOf(chat);
    open.addEventListener("click", () => switchTo(chat));
    const remove = action("×", "delete", () => removeChat(chat));
    remove.setAttribute("aria-label", `delete ${titleOf(chat)}`);
    li.append(open, remove);
    return li;
  }));
}

function saveChats() {
  save(STORE.chats, chats);
  save(STORE.current, current.id);
}

function switchTo(chat) {
  controller?.abort();
  current = chat;
  messages = chat.messages;
  saveChats();
  render();
}

function newChat() {
  const chat = { id: Date.now(), messages: [] };
  chats.unshift(chat);
  switchTo(chat);
}

function removeChat(chat) {
  chats = chats.filter((c) => c !== chat);
  if (!chats.length) { newChat(); return; }
  switchTo(chat === current ? chats[0] : current);
}

function render() {
  const list = $("messages");
  list.replaceChildren(...messages.map(messageItem));
  list.scrollTop = list.scrollHeight;
  renderChats();
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  $("chat-error").textContent = "";
  messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", stats: null };
  messages.push(reply);
  saveChats();
  render();
  const item = $("messages").lastElementChild;
  const history = messages.slice(0, -1).map(({ role, content }) => ({ role, content }));
  if (settings.system) history.unshift({ role: "system", content: settings.system });
  controller = new AbortController();
  busy(true);
  const sent = performance.now();
  let first = null, usage = null, stopped = false;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        model, messages: history, stream: true, stream_options: { include_usage: true },
        temperature: Number(settings.temperature), max_tokens: Number(settings.max_tokens),
      }),
    });
    if (r.status === 401) { askForKey("the API key was refused"); throw new Error("the server needs an API key"); }
    if (!r.ok) throw new Error((await r.json()).error?.message ?? `HTTP ${r.status}`);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const piece = chunk.choices?.[0]?.delta?.content;
        if (piece) {
          if (first === null) first = performance.now();
          reply.content += piece;
          item.innerHTML = markdown(reply.content);
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else $("chat-error").textContent = e.message;
  } finally {
    controller = null;
    busy(false);
  }
  const seconds = first === null ? 0 : (performance.now() - first) / 1000;
  reply.stats = {
    prompt: usage?.prompt_tokens ?? "?",
    cached: usage?.prompt_tokens_details?.cached_tokens ?? "?",
    tiers: usage?.prompt_tokens_details?.cached_tokens_per_tier,
    ttft: first === null ? undefined : first - sent,
    tps: usage && seconds > 0 ? usage.completion_tokens / seconds : undefined,
    stopped,
  };
  saveChats();
  render();
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && controller) controller.abort(); });
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => {
  if (messages.length) newChat();
  $("prompt").focus();
});

// --- settings -----------------------------------------------------------------------------

function showSettings() {
  $("system-prompt").value = settings.system;
  $("temperature").value = settings.temperature;
  $("max-tokens").value = settings.max_tokens;
}
$("open-settings").addEventListener("click", () => {
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  $("open-settings").setAttribute("aria-expanded", String(!panel.hidden));
  if (!panel.hidden) { showSettings(); $("system-prompt").focus(); }
});
$("settings-form").addEventListener("submit", (e) => {
  e.preventDefault();
  settings = {
    system: $("system-prompt").value,
    temperature: Number($("temperature").value),
    max_tokens: Math.max(1, Math.round(Number($("max-tokens").value))),
  };
  save(STORE.settings, settings);
  $("settings").hidden = true;
  $("open-settings").setAttribute("aria-expanded", "false");
});

// --- dashboard ----------------------------------------------------------------------------

let previous = null;
const points = [];   // [{tps, ttft}], the chart's

function niceTop(v) {
  // the axis' top: 1, 2 or 5 times a power of ten, at least v
  const p = 10 ** Math.floor(Math.log10(Math.max(v, 1)));
  return [1, 2, 5, 10].map((m) => m * p).find((t) => t >= v);
}

function drawChart() {
  // two y axes (output tok/s on the left, TTFT ms on the right, each from 0 to a round top,
  // with a gridline at each quarter) over the last CHART_POINTS polls (x: seconds ago)
  const canvas = $("dash-chart");
  const ctx = canvas.getContext("2d");
  const style = getComputedStyle(document.documentElement);
  const line = style.getPropertyValue("--line").trim();
  const muted = style.getPropertyValue("--muted").trim();
  const left = 40, right = 48, top = 10, bottom = 22;
  const w = canvas.width - left - right, h = canvas.height - top - bottom;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "14px system-ui, sans-serif";
  ctx.strokeStyle = line;
  ctx.lineWidth = 1;
  for (let q = 0; q <= 4; q++) {
    const y = top + h - (q / 4) * h;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + w, y); ctx.stroke();
  }
  const axes = {};
  for (const [key, color, side] of [["tps", "--tps", "left"], ["ttft", "--ttft", "right"]]) {
    const values = points.map((p) => p[key]);
    const peak = niceTop(Math.max(0, ...values.filter((v) => v !== null)));
    axes[key] = peak;
    ctx.fillStyle = style.getPropertyValue(color).trim();
    ctx.textAlign = side === "left" ? "right" : "left";
    for (let q = 0; q <= 4; q += 2) {
      const y = top + h - (q / 4) * h;
      const label = String(+((peak * q) / 4).toFixed(1));  // 0, half, top: 0.5 stays 0.5
      ctx.fillText(label, side === "left" ? left - 4 : left + w + 4, y + 3);
    }
    ctx.strokeStyle = ctx.fillStyle;
    ctx.lineWidth = 2;
    ctx.beginPath();
    values.forEach((v, i) => {
      if (v === null) return;
      const x = left + (i / (CHART_POINTS - 1)) * w;
      ctx.lineTo(x, top + h - (v / peak) * h);
    });
    ctx.stroke();
  }
  ctx.fillStyle = muted;
  ctx.textAlign = "left";
  const span = Math.round((CHART_POINTS * POLL_MS) / 1000);
  ctx.fillText(`${span} s ago`, left, canvas.height - 5);
  ctx.textAlign = "right";
  ctx.fillText("now", left + w, canvas.height - 5);
  // the same scale in words, for screen readers and tests
  $("dash-chart").setAttribute("aria-label",
    `output tokens per second (axis 0 to ${axes.tps}) and time to first token in ms (axis 0 to ${axes.ttft}) over the last ${span} s`);
  $("chart-axes").textContent = `tok/s 0–${axes.tps} · TTFT 0–${axes.ttft} ms · last ${span} s`;
}

function showStats(s) {
  const m = s.metrics;
  $("dash-running").textContent = m.num_requests_running;
  $("dash-waiting").textContent = m.num_requests_waiting;
  $("dash-preemptions").textContent = m.num_preemptions_total ?? m.num_preemptions;
  $("dash-generated").textContent = m.generation_tokens_total ?? m.generation_tokens;
  const queries = m.prefix_cache_queries_total ?? m.prefix_cache_queries;
  const hits = m.prefix_cache_hits_total ?? m.prefix_cache_hits;
  $("dash-hit-rate").textContent = queries ? `${((100 * hits) / queries).toFixed(1)} %` : "–";
  const now = { time: s.time, tokens: $("dash-generated").textContent * 1,
    ttftSum: m.time_to_first_token_seconds_sum, ttftCount: m.time_to_first_token_seconds_count };
  let point = { tps: null, ttft: null };
  if (previous) {
    const dt = now.time - previous.time;
    point.tps = dt > 0 ? (now.tokens - previous.tokens) / dt : 0;
    const n = now.ttftCount - previous.ttftCount;
    point.ttft = n > 0 ? (1000 * (now.ttftSum - previous.ttftSum)) / n : null;
    $("dash-tps").textContent = point.tps.toFixed(1);
    if (point.ttft !== null) $("dash-ttft").textContent = Math.round(point.ttft);
  }
  previous = now;
  points.push(point);
  if (points.length > CHART_POINTS) points.shift();
  const rows = Object.entries(s.tiers).map(([name, t]) => {
    const lookups = t.hits_total + t.misses_total;
    const rate = lookups ? `${((100 * t.hits_total) / lookups).toFixed(1)} %` : "–";
    const used = Math.min(100, (100 * t.used_pages) / Math.max(1, t.capacity_pages));
    return `<tr data-tier="${escapeHtml(name)}"><th scope="row">${escapeHtml(name)}</th>` +
      `<td><span class="used">${t.used_pages}</span> / ${t.capacity_pages}` +
      `<span class="meter"><span style="width:${used}%"></span></span></td><td>${rate}</td></tr>`;
  });
  $("dash-tiers").innerHTML = rows.join("");
  drawChart();
}

async function poll() {
  try {
    const r = await api("/stats");
    if (r.ok) { showStats(await r.json()); $("dash-error").textContent = ""; }
  } catch (e) {
    if (e.message !== "unauthorized") $("dash-error").textContent = "the server does not answer";
  }
}

$("toggle-dashboard").addEventListener("click", () => {
  const panel = $("dashboard");
  panel.hidden = !panel.hidden;
  $("toggle-dashboard").setAttribute("aria-expanded", String(!panel.hidden));
});

// --- start --------------------------------------------------------------------------------

let polling = null;

async function start() {
  try {
    const r = await api("/v1/models");
    model = (await r.json()).data[0].id;
    $("model-name").textContent = model;
  } catch (e) {
    if (e.message !== "unauthorized") $("chat-error").textContent = "the server does not answer";
    return;
  }
  render();
  if (polling === null) { poll(); polling = setInterval(poll, POLL_MS); }
}

start();
