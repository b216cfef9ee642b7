// chatgate browser UI: one page, one WebSocket (/v1/ws), sessions over REST (/v1/sessions).
// Protocol: docs/protocol.md. Plain ES module, no build step.
import { renderMarkdown } from "./render.js";

const $ = (id) => document.getElementById(id);
const el = {
  sessions: $("sessions"), sessionsEmpty: $("sessions-empty"), newChat: $("new-chat"),
  scrim: $("scrim"), menu: $("menu"), title: $("title"), conn: $("conn"),
  banner: $("banner"), bannerText: $("banner-text"), bannerClose: $("banner-close"),
  intro: $("intro"), system: $("system"), messages: $("messages"), chat: $("chat"),
  composer: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
  regenerate: $("regenerate"), keyForm: $("key-form"), apiKey: $("api-key"),
  forgetKey: $("forget-key"), showKey: $("show-key"), temperature: $("temperature"),
  maxTokens: $("max-tokens"),
};

const KEY_STORE = "chatgate.apiKey";
const SCOPE_STORE = "chatgate.scope";
const AUTH_CODES = new Set(["unauthorized", "auth_required", "invalid_api_key", "forbidden",
  "authentication_error", "401", "403"]);
const AUTH_CLOSE_CODES = new Set([1008, 4001, 4003, 4401, 4403]);

const state = {
  ws: null,
  open: false,
  retry: 0,            // reconnect attempt, for the backoff
  retryTimer: null,
  authFailed: false,   // stop reconnecting until a new key is saved
  sessionId: null,
  wsSession: null,     // the session named in the open socket's URL
  pending: [],         // frames waiting for a socket bound to the open conversation
  creating: false,     // sent session.create, waiting for its `session` event
  messages: [],        // [{role, content}] of the open conversation, as the server has it
  busy: false,         // an answer is streaming
  turn: null,          // {node, body, text} of the answer being streamed
  lastSent: "",        // the last message typed, given back if the server refuses it
  renderQueued: false,
};

// ---------------------------------------------------------------- small helpers

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

/** This browser's scope: a random id its sessions are created with, and listed by. */
function browserScope() {
  let scope = localStorage.getItem(SCOPE_STORE);
  if (!scope) {
    scope = newSessionId();
    localStorage.setItem(SCOPE_STORE, scope);
  }
  return scope;
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function showBanner(text, kind = "error") {
  el.bannerText.textContent = text;
  el.banner.className = kind;
  el.banner.hidden = false;
}

function hideBanner(kind) {
  if (!kind || el.banner.className === kind) el.banner.hidden = true;
}

function authMessage() {
  return apiKey() ? "The API key was refused." : "This gateway needs an API key.";
}

function showKeyForm(why) {
  el.keyForm.hidden = false;
  el.apiKey.value = apiKey();
  openSidebar(true);
  if (why) showBanner(why);
  el.apiKey.focus();
}

function openSidebar(open) {
  document.body.classList.toggle("sidebar-open", open);
  el.scrim.hidden = !open;
}

function setConn(status) {
  el.conn.dataset.status = status;
  el.conn.title = { open: "Connected", connecting: "Connecting…", closed: "Disconnected" }[status];
}

function timeAgo(t) {
  if (t == null) return "";
  const ms = typeof t === "number" ? (t < 1e12 ? t * 1000 : t) : Date.parse(t);
  if (Number.isNaN(ms)) return "";
  const s = (ms - Date.now()) / 1000;
  const rtf = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });
  for (const [unit, n] of [["day", 86400], ["hour", 3600], ["minute", 60]]) {
    if (Math.abs(s) >= n) return rtf.format(Math.round(s / n), unit);
  }
  return "just now";
}

function samplingParams() {
  const p = {};
  const t = parseFloat(el.temperature.value);
  const m = parseInt(el.maxTokens.value, 10);
  if (!Number.isNaN(t)) p.temperature = t;
  if (!Number.isNaN(m) && m > 0) p.max_tokens = m;
  return p;
}

// ---------------------------------------------------------------- WebSocket

/** A new session id (hex), chosen here so that the socket's URL can name it. */
function newSessionId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function connect() {
  clearTimeout(state.retryTimer);
  const url = new URL("v1/ws", location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  // The URL names the conversation: a load balancer in front of several gateways routes on
  // it, so the socket reaches the replica that holds the session's KV cache.
  if (state.sessionId) url.searchParams.set("session", state.sessionId);
  const ws = new WebSocket(url);
  state.ws = ws;
  state.wsSession = state.sessionId;
  setConn("connecting");

  ws.onopen = () => {
    if (state.ws !== ws) return;
    state.open = true;
    state.retry = 0;
    setConn("open");
    hideBanner("warn");
    const key = apiKey();
    if (key) ws.send(JSON.stringify({ type: "auth", api_key: key }));
    // A new socket has no server-side session binding: resume it first.
    if (state.sessionId && !state.creating) {
      ws.send(JSON.stringify({ type: "session.resume", session_id: state.sessionId }));
    }
    for (const frame of state.pending) ws.send(JSON.stringify(frame));
    state.pending = [];
  };

  ws.onmessage = (ev) => {
    if (state.ws !== ws) return;
    let msg;
    try {
      msg = JSON.parse(ev.data);
    } catch {
      return;
    }
    handlers[msg.type]?.(msg);
  };

  ws.onclose = (ev) => {
    if (state.ws !== ws) return;
    state.open = false;
    state.ws = null;
    setConn("closed");
    if (state.busy) {
      // A message that never left the page (the socket closed before opening) is given back.
      if (state.pending.some((frame) => frame.type === "message")) giveBackUnanswered();
      endTurn({ interrupted: true });
    }
    state.pending = [];
    if (state.creating) { // a create that got no answer is redone by the next message
      state.creating = false;
      state.sessionId = null;
    }
    if (AUTH_CLOSE_CODES.has(ev.code) || state.authFailed) {
      state.authFailed = true;
      showKeyForm(authMessage());
      return;
    }
    const delay = Math.min(8000, 500 * 2 ** state.retry++);
    showBanner(`Connection lost — reconnecting in ${Math.ceil(delay / 1000)} s…`, "warn");
    state.retryTimer = setTimeout(connect, delay);
  };
}

function reconnect() {
  const old = state.ws;
  state.ws = null;
  state.open = false;
  old?.close();
  connect();
}

/** Send a frame on a socket whose URL names the open conversation; otherwise queue it for
 * the socket that does, (re)connecting. */
function send(frame) {
  const bound = state.wsSession === state.sessionId;
  if (isOpen() && bound) {
    state.ws.send(JSON.stringify(frame));
    return true;
  }
  state.pending.push(frame);
  if (!state.authFailed && (!state.ws || !bound)) reconnect();
  return false;
}

function isOpen() {
  return state.open && state.ws?.readyState === WebSocket.OPEN;
}

/** Make sure a socket is open or opening: frames sent before it opens wait in `pending`.
 * False only when the key was refused (no socket opens until a new key is given). */
function requireSocket() {
  if (!state.ws && !state.authFailed) connect();
  return Boolean(state.ws);
}

/** A turn that got no answer gives the typed text back, unless the user typed anew. */
function giveBackUnanswered() {
  if (!state.turn?.text && state.lastSent && !el.input.value) {
    el.input.value = state.lastSent;
    autosize();
  }
}

const handlers = {
  session(msg) {
    const wasCreating = state.creating;
    state.creating = false;
    setSession(msg.id);
    if (wasCreating) return; // our optimistic bubbles already show the turn in flight
    if (state.busy) endTurn({ interrupted: true });
    const messages = msg.messages || [];
    // A resume after a reconnect that changed nothing keeps the page (and its stats lines).
    if (sameMessages(messages, state.messages) && el.messages.children.length) return;
    state.messages = messages;
    renderHistory(msg.system);
  },

  // Without a turn on screen, deltas and done belong to an answer the user walked away from
  // (new chat / another conversation while it was streaming): drop them.
  delta(msg) {
    if (!state.turn) return;
    state.turn.text += msg.text || "";
    queueRender();
  },

  done(msg) {
    const turn = state.turn;
    if (!turn) return refreshSessions();
    // The server keeps an answer only if it has text (a stop before the first token has none).
    if (turn.text) state.messages.push({ role: "assistant", content: turn.text });
    endTurn({ done: msg });
    refreshSessions();
  },

  "session.closed"(msg) {
    if (msg.id === state.sessionId) newChat();
    refreshSessions();
  },

  error(msg) {
    const code = String(msg.code ?? "");
    if (AUTH_CODES.has(code)) {
      state.authFailed = true;
      showKeyForm(authMessage());
    } else {
      showBanner(msg.message ? `${msg.message}${code ? ` (${code})` : ""}` : `Error: ${code}`);
    }
    if (code === "session_not_found" && !state.busy) newChat();
    if (state.creating) state.creating = false;
    if (state.busy) {
      // A refused turn (rate limit, bad params, …): give the text back and resync the
      // conversation with what the server kept.
      giveBackUnanswered();
      endTurn({ error: true });
      if (state.sessionId) send({ type: "session.resume", session_id: state.sessionId });
    }
  },
};

// ---------------------------------------------------------------- conversation view

function sameMessages(a, b) {
  return a.length === b.length &&
    a.every((m, i) => m.role === b[i].role && m.content === b[i].content);
}

function setSession(id) {
  state.sessionId = id;
  if (location.hash.slice(1) !== id) history.replaceState(null, "", `#${id}`);
  el.intro.hidden = true;
  for (const li of el.sessions.children) li.classList.toggle("active", li.dataset.id === id);
}

function messageNode(role) {
  const node = document.createElement("article");
  node.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  node.append(body);
  el.messages.append(node);
  return { node, body };
}

function addUser(text) {
  const { body } = messageNode("user");
  body.textContent = text;
}

function addAssistant(text) {
  const { node, body } = messageNode("assistant");
  body.innerHTML = renderMarkdown(text);
  addCopyButtons(body);
  return node;
}

/** A stored answer, with the stats line its turn was stored with. */
function addStoredAnswer(m) {
  const node = addAssistant(m.content);
  if (m.usage) {
    const finish = m.cut ? "cancelled" : m.finish_reason;
    node.append(statsNode({ usage: m.usage, timings: m.timings, finish_reason: finish }));
  }
}

function addCopyButtons(body) {
  for (const pre of body.querySelectorAll("pre")) {
    const btn = document.createElement("button");
    btn.type = "button";
    btn.className = "copy";
    btn.textContent = "Copy";
    btn.onclick = async () => {
      try {
        await navigator.clipboard.writeText(pre.querySelector("code")?.textContent ?? "");
        btn.textContent = "Copied";
      } catch {
        btn.textContent = "Copy failed";
      }
      setTimeout(() => (btn.textContent = "Copy"), 1500);
    };
    pre.prepend(btn);
  }
}

function renderHistory(system) {
  el.messages.replaceChildren();
  if (system) {
    const d = document.createElement("details");
    d.className = "system-note";
    const s = document.createElement("summary");
    s.textContent = "System prompt";
    const p = document.createElement("p");
    p.textContent = system;
    d.append(s, p);
    el.messages.append(d);
  }
  for (const m of state.messages) {
    if (m.role === "user") addUser(m.content);
    else if (m.role === "assistant") addStoredAnswer(m);
  }
  const first = state.messages.find((m) => m.role === "user");
  el.title.textContent = first ? first.content.slice(0, 80) : "New chat";
  updateControls();
  scrollToBottom(true);
}

function startTurn() {
  const { node, body } = messageNode("assistant");
  node.classList.add("streaming");
  state.turn = { node, body, text: "" };
  state.busy = true;
  updateControls();
  scrollToBottom(true);
}

function queueRender() {
  if (state.renderQueued) return;
  state.renderQueued = true;
  requestAnimationFrame(() => {
    state.renderQueued = false;
    if (!state.turn) return;
    const stick = nearBottom();
    state.turn.body.innerHTML = renderMarkdown(state.turn.text, { streaming: true });
    if (stick) scrollToBottom();
  });
}

function endTurn({ done, error, interrupted } = {}) {
  const turn = state.turn;
  state.turn = null;
  state.busy = false;
  if (turn && !turn.text && !done) turn.node.remove();
  else if (turn) {
    turn.node.classList.remove("streaming");
    turn.body.innerHTML = renderMarkdown(turn.text);
    addCopyButtons(turn.body);
    if (done) turn.node.append(statsNode(done));
    if (error || interrupted) turn.node.classList.add("failed");
  }
  updateControls();
}

function statsNode(done) {
  const usage = done.usage || {};
  const timings = done.timings || {};
  const tps = Number(timings.tokens_per_s ?? 0);
  const cached = Number(usage.cached_tokens ?? 0);
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.dataset.tokensPerS = tps;
  stats.dataset.cachedTokens = cached;
  stats.dataset.finishReason = done.finish_reason || "";
  const parts = [
    `${tps.toFixed(1)} tok/s`,
    `${cached} cached`,
    `${usage.completion_tokens ?? 0} tokens`,
  ];
  if (timings.ttft_ms != null) parts.push(`TTFT ${Math.round(timings.ttft_ms)} ms`);
  if (done.finish_reason === "cancelled") parts.push("stopped");
  else if (done.finish_reason === "length") parts.push("max tokens reached");
  stats.textContent = parts.join(" · ");
  stats.title = `prompt ${usage.prompt_tokens ?? "?"} tokens, of which ${cached} came from the KV cache`;
  return stats;
}

function updateControls() {
  el.send.hidden = state.busy;
  el.stop.hidden = !state.busy;
  const last = state.messages[state.messages.length - 1];
  // Regenerate the last answer, or answer a trailing user message (e.g. after a drop).
  el.regenerate.hidden = state.busy || !state.sessionId || !last;
}

function nearBottom() {
  const c = el.chat;
  return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
}

function scrollToBottom(force = false) {
  if (force || nearBottom()) el.chat.scrollTop = el.chat.scrollHeight;
}

// ---------------------------------------------------------------- actions

function sendMessage() {
  const text = el.input.value;
  if (!text.trim() || state.busy || !requireSocket()) return;
  if (!state.sessionId && !state.creating) {
    state.creating = true;
    state.sessionId = newSessionId();
    const system = el.system.value.trim();
    send({ type: "session.create", session_id: state.sessionId, scope: browserScope(),
      ...(system ? { system } : {}) });
    if (system) renderHistory(system);
  }
  el.intro.hidden = true;
  hideBanner("error");
  addUser(text);
  state.messages.push({ role: "user", content: text });
  if (el.title.textContent === "New chat") el.title.textContent = text.slice(0, 80);
  state.lastSent = text;
  el.input.value = "";
  autosize();
  startTurn();
  send({ type: "message", content: text, params: samplingParams() });
}

function regenerate() {
  if (state.busy || !requireSocket()) return;
  const last = state.messages[state.messages.length - 1];
  if (!last) return;
  if (last.role === "assistant") {
    state.messages.pop();
    const answers = el.messages.querySelectorAll(".msg.assistant");
    answers[answers.length - 1]?.remove();
  }
  hideBanner("error");
  startTurn();
  send({ type: "regenerate", params: samplingParams() });
}

function stop() {
  if (state.busy) send({ type: "cancel" });
}

function newChat() {
  if (state.busy) stop();
  state.sessionId = null;
  state.creating = false;
  state.messages = [];
  state.turn = null;
  state.busy = false;
  el.messages.replaceChildren();
  el.intro.hidden = false;
  el.system.value = "";
  el.title.textContent = "New chat";
  history.replaceState(null, "", location.pathname + location.search);
  for (const li of el.sessions.children) li.classList.remove("active");
  updateControls();
  openSidebar(false);
  el.input.focus();
}

function openSession(id) {
  if (state.busy) stop();
  state.turn = null;
  state.busy = false;
  state.creating = false;
  state.sessionId = id;
  state.messages = [];
  el.messages.replaceChildren();
  el.intro.hidden = true;
  if (state.wsSession === id && isOpen()) send({ type: "session.resume", session_id: id });
  else reconnect(); // the new socket's URL names the session; it resumes it on open
  openSidebar(false);
}

async function deleteSession(id) {
  if (!confirm("Delete this conversation?")) return;
  const r = await fetch(`v1/sessions/${encodeURIComponent(id)}`, {
    method: "DELETE", headers: { ...authHeaders(), "Content-Type": "application/json" },
  });
  if (!r.ok) showBanner(`Could not delete the conversation (HTTP ${r.status})`);
  if (id === state.sessionId) newChat();
  refreshSessions();
}

async function refreshSessions() {
  let r;
  try {
    const query = new URLSearchParams({ scope: browserScope() });
    r = await fetch(`v1/sessions?${query}`, { headers: authHeaders() });
  } catch {
    return; // the socket's reconnect banner tells the story
  }
  if (r.status === 401 || r.status === 403) {
    showKeyForm(authMessage());
    return;
  }
  if (!r.ok) {
    showBanner(`Could not load conversations (HTTP ${r.status})`);
    return;
  }
  const { data = [] } = await r.json();
  // This browser's conversations that have a turn (a chat refused at its first message has none).
  const items = data.filter((s) => s.num_messages > 0).map((s) => {
    const li = document.createElement("li");
    li.dataset.id = s.id;
    li.classList.toggle("active", s.id === state.sessionId);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    const title = document.createElement("span");
    title.className = "t";
    title.textContent = s.title || "Untitled";
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = [timeAgo(s.updated ?? s.created),
      s.num_messages != null ? `${s.num_messages} msgs` : ""].filter(Boolean).join(" · ");
    open.append(title, meta);
    open.onclick = () => openSession(s.id);
    const del = document.createElement("button");
    del.type = "button";
    del.className = "del";
    del.title = "Delete conversation";
    del.setAttribute("aria-label", "Delete conversation");
    del.textContent = "×";
    del.onclick = () => deleteSession(s.id);
    li.append(open, del);
    return li;
  });
  el.sessions.replaceChildren(...items);
  el.sessionsEmpty.hidden = items.length > 0;
}

/** The model's answer-length default (`default_max_tokens` of /v1/models) as the Max tokens
 * placeholder, and its context length as the input's maximum; "server default" if absent. */
async function showTokenLimits() {
  let model;
  try {
    const r = await fetch("v1/models", { headers: authHeaders() });
    if (!r.ok) return;
    model = (await r.json()).data?.[0];
  } catch {
    return;
  }
  if (Number.isInteger(model?.default_max_tokens)) {
    el.maxTokens.placeholder = `default: ${model.default_max_tokens}`;
  }
  if (Number.isInteger(model?.max_model_len)) el.maxTokens.max = model.max_model_len;
}

function autosize() {
  el.input.style.height = "auto";
  el.input.style.height = `${Math.min(el.input.scrollHeight, 200)}px`;
}

// ---------------------------------------------------------------- wiring

el.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  sendMessage();
});
el.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    sendMessage();
  }
});
el.input.addEventListener("input", autosize);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.busy) stop();
});
el.stop.onclick = stop;
el.regenerate.onclick = regenerate;
el.newChat.onclick = newChat;
el.menu.onclick = () => openSidebar(!document.body.classList.contains("sidebar-open"));
el.scrim.onclick = () => openSidebar(false);
el.bannerClose.onclick = () => hideBanner();
el.showKey.onclick = () => showKeyForm();
el.keyForm.addEventListener("submit", (e) => {
  e.preventDefault();
  const key = el.apiKey.value.trim();
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
  state.authFailed = false;
  el.keyForm.hidden = true;
  openSidebar(false);
  hideBanner();
  reconnect();
  refreshSessions();
  showTokenLimits();
});
el.forgetKey.onclick = () => {
  localStorage.removeItem(KEY_STORE);
  el.apiKey.value = "";
};
for (const [input, store] of [[el.temperature, "chatgate.temperature"],
  [el.maxTokens, "chatgate.maxTokens"]]) {
  input.value = localStorage.getItem(store) ?? "";
  input.addEventListener("change", () => localStorage.setItem(store, input.value));
}

const initial = location.hash.slice(1);
if (initial) {
  state.sessionId = initial; // resumed as soon as the socket opens
  el.intro.hidden = true;
}
updateControls();
connect();
refreshSessions();
showTokenLimits();

// For tests and debugging in the console.
window.chatgate = { renderMarkdown, state, reconnect };
