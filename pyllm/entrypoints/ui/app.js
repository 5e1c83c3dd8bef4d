// The chat page: streams replies from this server's /v1/chat/completions.
// Model text is only ever put into the page with textContent, never parsed as HTML.
"use strict";

const KEY_STORAGE = "pyllm.apiKey";
const $ = (id) => document.getElementById(id);

const state = {
  model: null,       // data[0].id of /v1/models
  messages: [],      // the conversation sent with each request (system prompt aside)
  controller: null,  // the AbortController of the reply streaming now
};

// ------------------------------------------------------------------ requests

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// The message of an OpenAI-shaped error body, or the HTTP status if it has none.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return "HTTP " + response.status + " " + response.statusText;
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) return askForKey(await errorMessage(response));
  if (!response.ok) return showModel("error: " + (await errorMessage(response)));
  const card = (await response.json()).data[0];
  state.model = card.id;
  showModel(card.id + " · context " + card.max_model_len + " tokens");
  $("key-form").hidden = true;
  $("prompt").focus();
}

function showModel(text) {
  $("model").textContent = text;
}

// ------------------------------------------------------------------ API key

function askForKey(message) {
  const hadKey = sessionStorage.getItem(KEY_STORAGE) !== null;
  sessionStorage.removeItem(KEY_STORAGE);
  showModel("API key needed");
  $("key-form").hidden = false;
  // The first 401 only says a key is needed; after a key was tried, say why it failed.
  $("key-error").hidden = !hadKey;
  $("key-error").textContent = hadKey ? message : "";
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
  $("api-key").value = "";
  loadModel().catch((e) => showModel("error: " + e.message));
}

// ------------------------------------------------------------------ rendering

// A message bubble: { root, body, stats } elements.
function addBubble(role) {
  const root = document.createElement("article");
  root.className = "message " + role;
  const body = document.createElement("div");
  body.className = "body";
  const stats = document.createElement("p");
  stats.className = "stats";
  root.append(body, stats);
  $("conversation").append(root);
  return { root, body, stats };
}

// A reply's reasoning: a folded <details> above its answer, made on its first text.
function reasoningBox(bubble) {
  if (!bubble.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    bubble.reasoning = document.createElement("div");
    details.append(summary, bubble.reasoning);
    bubble.root.insertBefore(details, bubble.body);
  }
  return bubble.reasoning;
}

// Text with ``` fences as nodes: <pre><code> for the code, text nodes for the rest.
// An unclosed fence (a reply still streaming) shows as code up to the end.
function renderText(element, text) {
  const nodes = [];
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      // The fence's first line names the language; the code starts after it. A closed
      // fence on one line (```x = 1```) is all code; an open one is still naming it.
      const newline = part.indexOf("\n");
      const closed = i < parts.length - 1;
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      code.textContent = newline >= 0 ? part.slice(newline + 1) : closed ? part : "";
      pre.append(code);
      nodes.push(pre);
      return;
    }
    // The line breaks next to a fence would show as blank lines around the block.
    if (i > 0) part = part.replace(/^\n/, "");
    if (i < parts.length - 1) part = part.replace(/\n$/, "");
    if (part) nodes.push(document.createTextNode(part));
  });
  element.replaceChildren(...nodes);
}

function showError(bubble, message) {
  const p = document.createElement("p");
  p.className = "error";
  p.setAttribute("role", "alert");
  p.textContent = message;
  bubble.body.append(p);
}

// Runs update(), then keeps the newest text in view unless the reader had scrolled up.
function follow(update) {
  const c = $("conversation");
  const atEnd = c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  update();
  if (atEnd) c.scrollTop = c.scrollHeight;
}

// ------------------------------------------------------------------ chat

function numberField(id) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) ? value : undefined;
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.messages] : state.messages;
  return {
    model: state.model || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),  // none: up to the context length
  };
}

// Calls onEvent with each parsed `data: {...}` event of a server-sent event stream.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop();  // an incomplete line waits for the next read
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  $("prompt").value = "";
  const history = state.messages;  // New chat replaces it: a late reply must not leak in
  history.push({ role: "user", content: text });

  renderText(addBubble("user").body, text);
  const bubble = addBubble("assistant");
  bubble.root.classList.add("streaming");
  $("conversation").scrollTop = $("conversation").scrollHeight;  // one's own message
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);

  const started = performance.now();
  let firstAt = null;
  let reply = "";
  let thought = "";  // the model's reasoning (--reasoning-parser): shown folded, not sent back
  let chunks = 0;
  let usage = null;
  let stopped = false;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) {
      const message = await errorMessage(response);
      history.pop();  // a refused turn is not part of the conversation
      showError(bubble, message);
      if (response.status === 401) askForKey(message);
      return;
    }
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      if (delta && delta.reasoning_content) {
        if (firstAt === null) firstAt = performance.now();
        thought += delta.reasoning_content;
        chunks += 1;
        follow(() => { reasoningBox(bubble).textContent = thought; });
      }
      if (delta && delta.content) {
        if (firstAt === null) firstAt = performance.now();
        reply += delta.content;
        chunks += 1;
        follow(() => renderText(bubble.body, reply));
      }
    });
  } catch (error) {
    if (error.name === "AbortError") stopped = true;
    else showError(bubble, error.message);
  } finally {
    controller.abort();  // a no-op, unless an error event left the stream unread
    if (reply) history.push({ role: "assistant", content: reply });
    const notes = stopped ? ["stopped"] : [];
    if (firstAt !== null) {
      const tokens = usage ? usage.completion_tokens : chunks;
      notes.push(stats(tokens, started, firstAt, performance.now()));
    }
    follow(() => {
      bubble.stats.textContent = notes.join(" · ");
      bubble.root.classList.remove("streaming");
    });
    if (state.controller === controller) {
      state.controller = null;
      setBusy(false);
    }
  }
}

// "12 tokens · 31.4 tokens/s · first token 85 ms": the rate counts the tokens after the first.
function stats(tokens, started, firstAt, endedAt) {
  const seconds = (endedAt - firstAt) / 1000;
  const rate = tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) : "–";
  const ttft = Math.round(firstAt - started);
  return tokens + " tokens · " + rate + " tokens/s · first token " + ttft + " ms";
}

function stop() {
  if (state.controller) state.controller.abort();  // the server then aborts the request
}

function newChat() {
  stop();
  state.messages = [];
  $("conversation").replaceChildren();
  $("prompt").focus();
}

// ------------------------------------------------------------------ start

function start() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("key-form").addEventListener("submit", useKey);
  // Settings start folded on a narrow screen, where they would hide the conversation.
  if (window.matchMedia("(max-width: 700px)").matches) $("settings").open = false;
  loadModel().catch((e) => showModel("error: " + e.message));
}

start();
