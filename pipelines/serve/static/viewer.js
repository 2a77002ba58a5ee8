// raylens viewer: streams tokens over /api/v1/generate/stream and paints their attention.
// No build step, no dependencies. An API key in this page's URL (?api_key=…) is passed on.
"use strict";

const params = new URLSearchParams(location.search);
const apiKey = params.get("api_key");
const $ = (id) => document.getElementById(id);
const state = { info: null, context: [], promptLength: 0, steps: [], selected: -1, ws: null };

function withKey(path) {
  return apiKey ? `${path}${path.includes("?") ? "&" : "?"}api_key=${encodeURIComponent(apiKey)}` : path;
}
$("features-link").href = withKey("features");

async function api(path, body) {
  const response = await fetch(withKey(path), body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const data = await response.json();
  if (!response.ok) throw new Error(`${data.error_code || response.status}: ${data.error || JSON.stringify(data)}`);
  return data;
}

function decodeAttention(info) {
  // base64 float32 [layers, heads, ctx] -> Float32Array plus its shape
  const bytes = Uint8Array.from(atob(info.data), (c) => c.charCodeAt(0));
  return { shape: info.shape, data: new Float32Array(bytes.buffer) };
}

function attentionRow(att, layer, head) {
  // the [ctx] row for the chosen layer/head, averaging where "mean" is chosen
  const [L, H, C] = att.shape, row = new Float32Array(C);
  const layers = layer === "mean" ? [...Array(L).keys()] : [Number(layer)];
  const heads = head === "mean" ? [...Array(H).keys()] : [Number(head)];
  for (const l of layers) for (const h of heads) {
    const base = (l * H + h) * C;
    for (let i = 0; i < C; i++) row[i] += att.data[base + i];
  }
  const n = layers.length * heads.length;
  for (let i = 0; i < C; i++) row[i] /= n;
  return row;
}

function colour(v, max) {
  const t = max > 0 ? Math.min(1, v / max) : 0;
  return `rgba(220, 60, 40, ${(0.08 + 0.92 * Math.sqrt(t)).toFixed(3)})`;
}

function render() {
  const box = $("tokens");
  box.textContent = "";
  const step = state.steps[state.selected];
  const row = step && step.attention ? attentionRow(step.attention, $("layer").value, $("head").value) : null;
  const max = row ? Math.max(...row) : 0;
  state.context.forEach((tok, i) => {
    const span = document.createElement("span");
    span.className = "tok" + (i >= state.promptLength ? " gen" : "") + (i === state.promptLength + state.selected ? " selected" : "");
    span.textContent = tok.text;
    span.title = `#${i} id ${tok.token_id}` + (row && i < row.length ? ` attention ${row[i].toFixed(4)}` : "");
    if (row && i < row.length) span.style.background = colour(row[i], max);
    if (i >= state.promptLength) span.onclick = () => { state.selected = i - state.promptLength; render(); };
    box.appendChild(span);
  });
  paintHeatmap();
}

function paintHeatmap() {
  const canvas = $("heatmap"), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const rows = state.steps.filter((s) => s.attention);
  if (!rows.length) return;
  const cols = state.context.length, cw = canvas.width / cols, rh = canvas.height / Math.max(rows.length, 8);
  rows.forEach((step, r) => {
    const row = attentionRow(step.attention, $("layer").value, $("head").value);
    const max = Math.max(...row);
    row.forEach((v, c) => { ctx.fillStyle = colour(v, max); ctx.fillRect(c * cw, r * rh, Math.ceil(cw), Math.ceil(rh)); });
  });
  canvas.dataset.rows = String(rows.length);
}

function renderFeatures() {
  const box = $("features");
  const steps = state.steps.filter((s) => s.features);
  if (!steps.length) return;
  box.textContent = "";
  for (const step of steps) {
    const div = document.createElement("div");
    div.className = "feature-step";
    const top = (step.features.indices || []).slice(0, 5).map((id, k) => `#${id} ${(step.features.values[k] || 0).toFixed(2)}`);
    div.textContent = `${step.text}\n${top.join("\n")}`;
    div.style.whiteSpace = "pre";
    box.appendChild(div);
  }
}

async function generate() {
  $("generate").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "tokenizing…";
  try {
    const tokens = await api("/api/v1/tokenize", { messages: [{ role: "user", content: $("prompt").value }] });
    state.context = tokens.tokens.slice();
    state.promptLength = tokens.token_count;
    state.steps = [];
    state.selected = -1;
    render();
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(withKey(`${scheme}://${location.host}/api/v1/generate/stream`));
    state.ws = ws;
    ws.onopen = () => {
      $("status").textContent = "generating…";
      ws.send(JSON.stringify({
        type: "generate", input_ids: tokens.token_ids, max_new_tokens: Number($("max-tokens").value),
        temperature: Number($("temperature").value), return_attention: true, attention_format: "per_layer",
        top_logprobs: 3, sae_features: Boolean(state.info && state.info.sae_features_available),
      }));
    };
    ws.onmessage = (message) => {
      const data = JSON.parse(message.data);
      if (data.type === "token") {
        state.context.push(data.token);
        state.steps.push({ text: data.token.text, attention: data.attention ? decodeAttention(data.attention) : null,
                           features: data.sae_features || null });
        state.selected = state.steps.length - 1;
        render();
        renderFeatures();
        $("status").textContent = `generating… ${state.steps.length} tokens`;
      } else if (data.type === "erased") {
        state.context.splice(state.context.length - data.n, data.n);
        state.steps.splice(state.steps.length - data.n, data.n);
        state.selected = state.steps.length - 1;
        render();
      } else if (data.type === "done") {
        $("status").textContent = `done: ${data.total_tokens} tokens, ${data.finish_reason}, ${Math.round(data.generation_time_ms)} ms`;
        document.body.dataset.done = "true";
        ws.close();
      } else if (data.type === "error") {
        $("status").textContent = `error ${data.error_code}: ${data.error}`;
        ws.close();
      }
    };
    ws.onclose = () => { $("generate").disabled = false; $("stop").disabled = true; };
  } catch (err) {
    $("status").textContent = String(err);
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

async function init() {
  try {
    const info = await api("/api/v1/model/info");
    state.info = info;
    $("model").textContent = `${info.model_name} · ${info.num_layers} layers × ${info.num_attention_heads} heads`;
    for (let l = 0; l < info.num_layers; l++) $("layer").add(new Option(`layer ${l}`, String(l)));
    for (let h = 0; h < info.num_attention_heads; h++) $("head").add(new Option(`head ${h}`, String(h)));
    if (!info.sae_features_available) $("features").textContent = "Not available on this server.";
  } catch (err) {
    $("model").textContent = String(err);
  }
  $("generate").onclick = generate;
  $("stop").onclick = () => state.ws && state.ws.readyState === 1 && state.ws.send(JSON.stringify({ type: "cancel" }));
  $("layer").onchange = render;
  $("head").onchange = render;
  if (params.get("prompt")) $("prompt").value = params.get("prompt");
  if (params.get("max_tokens")) $("max-tokens").value = params.get("max_tokens");
  if (params.get("autorun")) generate();
}

init();
