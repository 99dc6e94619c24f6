// The page: loads the served folders on WebGPU (wasm when the browser has no adapter, or with ?ep=wasm), streams
// generated text and shows acceptance, rollbacks and tokens/s. window.snapspec exposes the loaded models to
// `snapspec browser-check` (checks.js).

import { ort } from './vendor.js';
import { fetchJson, loadModel } from './context.js';
import { Generator } from './generation.js';
import { SamplingParams } from './sampling.js';
import { runChecks } from './checks.js';

const $ = (id) => document.getElementById(id);

function status(text, error = false) {
  $('status').textContent = text;
  $('status').className = error ? 'error' : '';
}

async function chooseEp(requested) {
  const adapter = navigator.gpu ? await navigator.gpu.requestAdapter().catch(() => null) : null;
  if (requested === 'webgpu' && !adapter) {
    throw new Error('WebGPU was requested but this browser has no WebGPU adapter (Chromium: --enable-unsafe-webgpu on Linux)');
  }
  if (requested === 'wasm' || !adapter) return { ep: 'wasm', device: `wasm, ${ort.env.wasm.numThreads || 1} thread(s)` };
  const info = adapter.info || {};
  return { ep: 'webgpu', device: `WebGPU (${[info.vendor, info.architecture, info.description].filter(Boolean).join(' ') || 'adapter'})` };
}

async function start() {
  const params = new URLSearchParams(location.search);
  const config = await fetchJson('config.json');
  const { ep, device } = await chooseEp(params.get('ep'));
  // wasm threads: onnxruntime-web's default (half the cores, at most 4; 1 without cross-origin isolation), or ?threads=N.
  if (params.get('threads')) ort.env.wasm.numThreads = Number(params.get('threads'));
  const load = (role) => (config.models[role] ? loadModel({ ...config.models[role] }, ep, { onProgress: status }) : null);
  const target = await load('target');
  const drafter = await load('drafter');
  const describe = (m) => `${m.name} (${m.manifest.model.model_type}, ${m.manifest.export.dtype}${m.manifest.export.quant !== 'none' ? ' ' + m.manifest.export.quant : ''})`;
  $('models').textContent = `target ${describe(target)}` + (drafter ? ` · drafter ${describe(drafter)}` : ' · no drafter (plain decoding)')
    + ` · onnxruntime-web ${ort.env.versions.web} on ${ep === 'wasm' ? `wasm, ${ort.env.wasm.numThreads} thread(s)` : device}`;
  if (!drafter) $('draft-k').value = 0;
  return { ep, device, target, drafter };
}

let running = null;

function render(gen, done) {
  const s = gen.stats;
  let text = gen.target.decode(gen.tokens);
  if (!done) text = text.replace(/\ufffd+$/, ''); // an incomplete UTF-8 sequence: wait for the rest
  $('text').replaceChildren(Object.assign(document.createElement('span'), { className: 'prompt', textContent: $('prompt').value }), text);
  $('s-tokens').textContent = s.newTokens;
  const tps = s.decodeTokensPerS;
  $('s-tps').textContent = tps ? tps.toFixed(1) : '–';
  $('s-accept').textContent = s.acceptance === null ? '–' : s.acceptance.toFixed(2);
  $('s-rounds').textContent = s.rounds ? `${s.rounds} (${(s.emitted / s.rounds).toFixed(2)}/round)` : '–';
  const rb = Object.entries(s.rollbacks).map(([k, v]) => `${k} ×${v}`).join(', ');
  $('s-rollbacks').textContent = rb || '–';
}

async function generate(app) {
  if (running) { running.stop = true; return; }
  const k = Number($('draft-k').value);
  const drafter = k > 0 ? app.drafter : null;
  const sampling = new SamplingParams({
    temperature: Number($('temperature').value), topK: Number($('top-k').value), topP: Number($('top-p').value),
    seed: $('seed').value === '' ? null : Number($('seed').value),
  });
  const gen = new Generator(app.target, app.target.encode($('prompt').value), {
    drafter, draftMax: k || 1, maxNewTokens: Number($('max-new').value), sampling, rollback: $('rollback').value,
  });
  running = { stop: false, gen };
  $('go').textContent = 'Stop';
  status(drafter ? `generating: speculative, k = ${k}` : 'generating: plain decoding');
  try {
    for await (const _ of gen) {
      render(gen, false);
      if (running.stop) { gen.stopReason = 'stopped'; break; }
    }
    render(gen, true);
    status(`done (${gen.stopReason})` + (gen.warnings.length ? ` · ${gen.warnings.join('; ')}` : ''));
  } finally {
    gen.dispose();
    running = null;
    $('go').textContent = 'Generate';
  }
}

// Plain, speculative, plain (A B A) on one prompt, greedy: decode tokens/s of each run, and whether the texts match.
async function timeDecoding(app, { prompt, newTokens, k }) {
  const ids = app.target.encode(prompt);
  const runs = [];
  for (const drafter of app.drafter ? [null, app.drafter, null] : [null]) {
    const gen = new Generator(app.target, ids, { drafter, draftMax: k, maxNewTokens: newTokens, stopAtEos: false });
    try { await gen.run(); } finally { gen.dispose(); }
    runs.push({ speculative: !!drafter, k: drafter ? k : 0, tokens: gen.tokens.length, tokens_per_s: gen.stats.decodeTokensPerS,
      acceptance: gen.stats.acceptance, ids: [...gen.tokens] });
  }
  const same = runs.every((r) => JSON.stringify(r.ids) === JSON.stringify(runs[0].ids));
  runs.forEach((r) => delete r.ids);
  return { runs, same_text: same, threads: app.ep === 'wasm' ? ort.env.wasm.numThreads : null };
}

window.snapspecVersions = ort.env.versions;
window.snapspec = {
  ready: start().then((app) => {
    $('go').disabled = false;
    $('go').onclick = () => generate(app).catch((err) => status(`error: ${err.message}`, true));
    status(`ready on ${app.ep}`);
    window.snapspecCheck = (spec) => runChecks(app, spec);
    window.snapspecSpeed = (opts) => timeDecoding(app, opts);
    return { ep: app.ep, device: app.device };
  }).catch((err) => {
    status(`error: ${err.message || err}`, true);
    throw err;
  }),
};
