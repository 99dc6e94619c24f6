// The page: loads the served folders on WebGPU (wasm when the browser has no adapter, or with ?ep=wasm), streams
// generated text and shows acceptance, rollbacks and tokens/s. window.snapspec exposes the loaded models to
// `snapspec browser-check` (checks.js).

import { ort } from './vendor.js';
import { fetchJson, loadModel } from './context.js';
import { Generator } from './generation.js';
import { LookupThenHead, loadHead } from './mtp.js';
import { Lookup } from './ngram.js';
import { SamplingParams } from './sampling.js';
import { runChecks } from './checks.js';

const $ = (id) => document.getElementById(id);

function status(text, error = false) {
  $('status').textContent = text;
  $('status').className = error ? 'error' : '';
}

// Whether an export holds float16 tensors, which WebGPU runs only on adapters with shader-f16.
function needsF16(manifest) {
  const e = manifest.export;
  return e.dtype === 'float16' || (e.embedding_dtype ?? (e.quant === 'int4' ? 'float16' : e.dtype)) === 'float16';
}

async function chooseEp(requested, manifests) {
  const adapter = navigator.gpu ? await navigator.gpu.requestAdapter().catch(() => null) : null;
  const wasm = (why) => ({ ep: 'wasm', device: 'wasm', why });
  if (requested === 'wasm') return wasm('');
  if (!adapter) {
    if (requested === 'webgpu') throw new Error('WebGPU was requested but this browser has no WebGPU adapter (Chromium on Linux: --enable-unsafe-webgpu)');
    return wasm('no WebGPU adapter');
  }
  const info = adapter.info || {};
  const name = [info.vendor, info.architecture, info.description].filter(Boolean).join(' ') || 'adapter';
  const f16 = manifests.filter(needsF16).map((m) => m.name);
  if (f16.length && !adapter.features.has('shader-f16')) {
    const why = `${f16.join(' and ')}: float16 tensors, and this WebGPU adapter (${name}) has no shader-f16; `
      + 're-export with --embedding-dtype fp32 (int4) or --dtype fp32';
    if (requested === 'webgpu') throw new Error(why);
    return wasm(why);
  }
  return { ep: 'webgpu', device: `WebGPU (${name})`, why: '' };
}

async function start() {
  const params = new URLSearchParams(location.search);
  const config = await fetchJson('config.json');
  const roles = Object.keys(config.models);
  const manifests = await Promise.all(roles.map(async (role) => ({
    ...(await fetchJson(config.models[role].url + 'snapspec.json')), name: config.models[role].name })));
  const { ep, device, why } = await chooseEp(params.get('ep'), manifests);
  // wasm threads: onnxruntime-web's default (half the cores, at most 4; 1 without cross-origin isolation), or ?threads=N.
  if (params.get('threads')) ort.env.wasm.numThreads = Number(params.get('threads'));
  const load = (role) => (config.models[role] ? loadModel({ ...config.models[role] }, ep, { onProgress: status }) : null);
  const target = await load('target');
  // config.draft === 'mtp' (`snapspec web --drafter mtp`): draft with the target's own MTP head (mtp.js); 'ngram':
  // prompt lookup (ngram.js, config.ngram = [shortest, longest] suffix), no model.
  // 'ngram+mtp': the lookup's draft where it finds one, the head's elsewhere.
  const head = ['mtp', 'ngram+mtp'].includes(config.draft) ? await loadHead(target, { onProgress: status }) : null;
  const lookup = ['ngram', 'ngram+mtp'].includes(config.draft) ? new Lookup(...(config.ngram || [])) : null;
  const drafter = head && lookup ? new LookupThenHead(lookup, head) : head || lookup || await load('drafter');
  const describe = (m) => `${m.name} (${m.manifest.model.model_type}, ${m.manifest.export.dtype}${m.manifest.export.quant !== 'none' ? ' ' + m.manifest.export.quant : ''})`;
  const drafterText = !drafter ? ' · no drafter (plain decoding)'
    : drafter.isHead ? ` · drafter: the target's MTP head (${drafter.graph.file})`
      : drafter.isLookup || drafter.isMixed ? ` · drafts: ${drafter.name}, no drafter model`
        : ` · drafter ${describe(drafter)}`;
  $('models').textContent = `target ${describe(target)}` + drafterText
    + ` · onnxruntime-web ${ort.env.versions.web} on ${ep === 'wasm' ? `wasm, ${ort.env.wasm.numThreads} thread(s)` : device}`
    + (why ? ` (wasm: ${why})` : '');
  if (!drafter) $('draft-k').value = 0;
  return { ep, device: ep === 'wasm' ? `wasm, ${ort.env.wasm.numThreads} thread(s)` : device, target, drafter };
}

let running = null;

function render(gen, done) {
  const s = gen.stats;
  let text = gen.target.decode(gen.tokens);
  if (!done) text = text.replace(/\ufffd+$/, ''); // an incomplete UTF-8 sequence: wait for the rest
  $('text').replaceChildren(Object.assign(document.createElement('span'), { className: 'prompt', textContent: $('prompt').value }), text);
  $('text').scrollTop = $('text').scrollHeight;
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
  const how = drafter && (drafter.isHead ? ' (MTP head)' : drafter.isLookup ? ' (n-gram lookup)'
    : drafter.isMixed ? ' (n-gram lookup, else the MTP head)' : '');
  status(drafter ? `generating: speculative${how}, k = ${k}` : 'generating: plain decoding');
  let painted = performance.now();
  try {
    for await (const _ of gen) {
      render(gen, false);
      if (running.stop) { gen.stopReason = 'stopped'; break; }
      // On wasm with one thread, inference runs on this thread: let the browser paint (and see a Stop click) every
      // 100 ms, or the text would appear all at once at the end.
      if (performance.now() - painted > 100) {
        await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
        painted = performance.now();
      }
    }
    render(gen, true);
    status(`done (${gen.stopReason})` + (gen.warnings.length ? ` · ${gen.warnings.join('; ')}` : ''));
  } finally {
    gen.dispose();
    running = null;
    $('go').textContent = 'Generate';
  }
}

// Plain and speculative decoding interleaved (P S P S ... P: every speculative run bracketed by plain runs) on one
// prompt, greedy: decode tokens/s of each run, and whether every text equals the first plain one.
async function timeDecoding(app, { prompt, newTokens, k, reps = 3 }) {
  const ids = app.target.encode(prompt);
  const plan = [null];
  for (let r = 0; r < reps && app.drafter; r++) plan.push(app.drafter, null);
  const runs = [];
  for (const drafter of plan) {
    const gen = new Generator(app.target, ids, { drafter, draftMax: k, maxNewTokens: newTokens, stopAtEos: false });
    try { await gen.run(); } finally { gen.dispose(); }
    runs.push({ speculative: !!drafter, k: drafter ? k : 0, tokens: gen.tokens.length, tokens_per_s: gen.stats.decodeTokensPerS,
      acceptance: gen.stats.acceptance, rounds: gen.stats.rounds, ids: [...gen.tokens] });
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
