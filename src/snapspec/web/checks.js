// What `snapspec browser-check` runs inside the page. The page reports raw results (token ids, logits as base64
// float32, counters); the Python side holds the oracle (onnxruntime CPU, the tokenizers library, the exact
// sampling law) and decides pass or fail. Only checks whose oracle is the page itself are decided here: rollback
// compared with a context that never decoded the rolled-back tokens.

import { Context, defaultMode } from './context.js';
import { Generator } from './generation.js';
import { SamplingParams, Rng, accept, pick, probs } from './sampling.js';

function base64(floats) {
  const bytes = new Uint8Array(floats.buffer, floats.byteOffset, floats.byteLength);
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function relErr(a, b) {
  let diff = 0, scale = 1e-6;
  for (let i = 0; i < a.length; i++) {
    const d = Math.abs(a[i] - b[i]);
    diff = d > diff || Number.isNaN(d) ? d : diff;
    scale = Math.max(scale, Math.abs(b[i]));
  }
  return diff / scale;
}

function counters(g) {
  const s = g.stats;
  return {
    rounds: s.rounds, drafted: s.drafted, accepted: s.accepted, emitted: s.emitted, new_tokens: s.newTokens,
    target_forwards: s.targetForwards, drafter_forwards: s.drafterForwards, lookups: s.lookups,
    lookup_hits: s.lookupHits, rollbacks: s.rollbacks,
    draft_lengths: s.draftLengths,
  };
}

async function prefillLogits(model, ids) {
  const ctx = new Context(model, { maxLen: ids.length + 1 });
  try {
    const rows = await ctx.forward(ids);
    const flat = new Float32Array(rows.length * rows[0].length);
    rows.forEach((r, i) => flat.set(r, i * r.length));
    return base64(flat);
  } finally {
    ctx.dispose();
  }
}

async function generate(target, ids, opts) {
  const g = new Generator(target, ids, { stopAtEos: false, ...opts });
  try {
    await g.run();
    return g;
  } finally {
    g.dispose();
  }
}

// Rolling back to each j in js (0..W) gives the logits of a context that decoded only those tokens (check_rollback of
// cli/conformance.py, on the probe logits): replay after one (W+1)-token forward, ring after W one-token steps.
async function rollbackCheck(model, role, toks, nPrompt, w, js) {
  const mode = defaultMode(model, role);
  let worst = 0, where = '';
  const modes = new Set();
  const probe = [toks[toks.length - 1]];
  for (const j of js) {
    const ctx = new Context(model, { maxLen: 128, mode, window: w });
    const ref = new Context(model, { maxLen: 128 });
    try {
      await ctx.forward(toks.slice(0, nPrompt));
      if (mode === 'ring') for (const x of toks.slice(nPrompt, nPrompt + w)) await ctx.forward([x]);
      else await ctx.forward(toks.slice(nPrompt, nPrompt + w + 1));
      modes.add(await ctx.rollback(nPrompt + j));
      await ref.forward(toks.slice(0, nPrompt + j));
      const err = relErr((await ctx.forward(probe))[0], (await ref.forward(probe))[0]);
      if (!(err <= worst) || !where) { worst = err; where = `j=${j}`; }
    } finally {
      ctx.dispose();
      ref.dispose();
    }
  }
  return { mode: model.hasRecurrent ? mode : 'truncate', worst, where, modes: [...modes].sort() };
}

// The first two tokens emitted by sampled speculation over synthetic conditional laws (tables keyed by prefix),
// counted over n trials; Python compares the counts with the exact target law.
function samplingLaw({ target, drafter, k, n, seed }) {
  const params = new SamplingParams({ temperature: 1 });
  const rng = new Rng(seed);
  const v = target[''].length;
  const counts = new Array(v * v).fill(0);
  for (let trial = 0; trial < n; trial++) {
    const out = [];
    while (out.length < 2) {
      const draft = [], qs = [];
      for (let i = 0; i < k; i++) {
        const [d, q] = pick(drafter[out.concat(draft).join(',')], params, rng);
        draft.push(d);
        qs.push(q);
      }
      const rows = [];
      for (let i = 0; i <= k; i++) rows.push(target[out.concat(draft.slice(0, i)).join(',')]);
      const [j, next] = accept(draft, qs, rows, params, rng);
      out.push(...draft.slice(0, j), next);
    }
    counts[out[0] * v + out[1]]++;
  }
  return counts;
}

export async function runChecks(app, spec) {
  const { target } = app;
  const drafter = app.drafter || target;
  const model = app.drafter && !(app.drafter.isHead || app.drafter.isLookup || app.drafter.isMixed) ? app.drafter : null;
  const seconds = {};
  const timed = async (name, fn) => {
    const t = performance.now();
    try { return await fn(); } finally { seconds[name] = (performance.now() - t) / 1000; }
  };
  const result = { ep: app.ep, device: app.device, seconds };
  const promptIds = spec.prompts.map((p) => target.encode(p));
  result.tokenizer = { ids: promptIds, decoded: spec.decode.map((ids) => target.decode(ids)) };
  result.logits = await timed('logits', async () => { // one run at a time: a session must not run concurrently
    const out = { target: [] };
    for (const ids of promptIds) out.target.push(await prefillLogits(target, ids));
    if (model) {
      out.drafter = [];
      for (const ids of promptIds) out.drafter.push(await prefillLogits(model, ids));
    }
    return out;
  });
  result.plain = await timed('plain', async () => {
    const out = [];
    for (const ids of promptIds) out.push([...(await generate(target, ids, { maxNewTokens: spec.newTokens })).tokens]);
    return out;
  });
  result.spec = await timed('speculative', async () => {
    const out = [];
    // [k, rollback, prompt, sampling]: sampling (top-k 1, so that the output is the greedy one) takes the sampled
    // path: the drafts' q rows and the rejection rule.
    for (const [k, rollback, p, params] of spec.runs) {
      const sampling = new SamplingParams(params || {});
      const g = await generate(target, promptIds[p], { drafter, maxNewTokens: spec.newTokens, draftMax: k, rollback, sampling });
      out.push({ k, rollback, prompt: p, sampled: !!params, tokens: [...g.tokens], stats: counters(g), modes: [...g.modesUsed].sort() });
    }
    return out;
  });
  result.self = await timed('self', async () => {
    const g = await generate(target, promptIds[1 % promptIds.length], { drafter: target, maxNewTokens: spec.newTokens, draftMax: 4 });
    return { acceptance: g.stats.acceptance, ...counters(g) };
  });
  result.rollback = await timed('rollback', async () => {
    const args = [spec.rollbackTokens, spec.rollbackPrompt, spec.window, spec.rollbackJs];
    const out = { target: await rollbackCheck(target, 'target', ...args) };
    if (model) out.drafter = await rollbackCheck(model, 'drafter', ...args);
    return out;
  });
  result.probs = spec.probs.map(({ row, params }) => Array.from(probs(row, new SamplingParams(params))));
  result.law = await timed('law', async () => spec.law.map(samplingLaw));
  return result;
}
