// An exported folder opened in onnxruntime-web, and a sequence's state store with the rollback modes of
// runtime/context.py. What differs from the Python runtime, and why:
//
// onnxruntime-web has no IOBinding of one buffer as both an input and an output, so every run writes its outputs
// into fresh tensors (GPU buffers on WebGPU, kept there; host arrays on wasm). That makes every state immutable once
// written, and the modes become reference juggling:
//   kv         truncate: each forward's present_* becomes the next forward's past_* (GroupQueryAttention copies the
//              valid prefix of past into present inside the kernel, on the device); rollback is a shorter
//              attention_mask, and the rows past it are never read. The first forward gets zeros of maxLen rows.
//   recurrent  S slots of (conv, recurrent) state, each a set of tensors with the position it belongs to.
//              ring (drafter): S = W + 1; a forward puts its state in the slot after `cur`, so the states of the
//                  last W positions survive, and rollback picks a slot (no copy, no compute).
//              replay (target): S = 2; the forward also returns the packed rollback_data, and replay.onnx advances
//                  the saved start state over the accepted prefix (a [1, j, width] view of the same GPU buffer).
//   checkpoint keeps a reference to the current slot's tensors (no copy is needed: nothing writes them again);
//              restore puts them back as the current slot, exactly where runtime/context.py copies.
// Tensors that no slot, checkpoint or pending replay refers to any more are disposed at once (GPU memory).

import { ort, Tokenizer } from './vendor.js';

const RECURRENT = new Set(['conv', 'recurrent', 'swa_key', 'swa_value', 'rglru']);  // manifest.py RECURRENT_ROLES
export const WEBGPU_CHUNK = 16;

export async function fetchJson(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

// entry: {url, name, external: {graph file: [external data files]}} from the server's /config.json.
export async function loadModel(entry, ep, { onProgress = () => {} } = {}) {
  const manifest = await fetchJson(entry.url + 'snapspec.json');
  if (manifest.format !== 'snapspec-export/1') {
    throw new Error(`${entry.name}: manifest format ${manifest.format}, this page reads snapspec-export/1`);
  }
  if (manifest.export.embedding_dtype === 'int4') { // onnxruntime-web 1.30 has no GatherBlockQuantized kernel
    throw new Error(`${entry.name}: an int4 embedding (GatherBlockQuantized) does not run in onnxruntime-web 1.30; `
      + 're-export with --embedding-dtype fp32 (or fp16 for WebGPU adapters with shader-f16)');
  }
  const open = (role) => openGraph(entry, manifest, role, ep, onProgress);
  const session = await open('forward');
  const replay = manifest.graphs.replay && manifest.rollback_data ? await open('replay') : null;
  const tokJson = await fetchJson(entry.url + 'tokenizer.json');
  const tokConfig = manifest.files['tokenizer_config.json'] ? await fetchJson(entry.url + 'tokenizer_config.json') : {};
  const model = new Model(entry.name, manifest, ep, session, replay, new Tokenizer(tokJson, tokConfig));
  model.entry = entry;
  return model;
}

// One graph of an exported folder (manifest.graphs[role]) as an onnxruntime-web session. On WebGPU the state outputs
// (the target's, and the MTP head's KV) stay on the GPU between calls; logits and hidden rows come back to the host.
export async function openGraph(entry, manifest, role, ep, onProgress = () => {}) {
  const state = [...manifest.state, ...(manifest.mtp ? manifest.mtp.state : [])];
  const outputsOnDevice = ep === 'webgpu'
    ? [...state.map((s) => s.output), ...(manifest.rollback_data ? [manifest.rollback_data.name] : [])]
    : [];
  const graph = manifest.graphs[role];
  onProgress(`${entry.name}: loading ${graph.file}`);
  const options = {
    executionProviders: [ep],
    graphOptimizationLevel: 'all',
    externalData: (entry.external[graph.file] || []).map((path) => ({ path, data: entry.url + path })),
    preferredOutputLocation: Object.fromEntries(graph.outputs.map(
      (name) => [name, outputsOnDevice.includes(name) ? 'gpu-buffer' : 'cpu'])),
    logSeverityLevel: 3,
  };
  try {
    return await ort.InferenceSession.create(entry.url + graph.file, options);
  } catch (err) {
    throw new Error(`onnxruntime-web (${ep}) cannot load ${entry.name}/${graph.file}: ${err.message || err}`);
  }
}

export class Model {
  constructor(name, manifest, ep, session, replay, tokenizer) {
    Object.assign(this, { name, manifest, ep, session, replay, tokenizer });
    this.vocabSize = manifest.model.vocab_size;
    this.eosIds = manifest.tokens.eos_token_ids || [];
    this.hasRecurrent = manifest.state.some((s) => RECURRENT.has(s.role));
    this.maxContext = manifest.model.max_context;
    this.inputs = new Set(manifest.graphs.forward.inputs);
  }

  encode(text) { return this.tokenizer.encode(text, { add_special_tokens: false }).ids; }

  decode(ids) { return this.tokenizer.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false }); }

  // position_ids for t tokens from start: [1, T], or [R, 1, T] for a graph that takes R rows, none without the input.
  positionIds(start, t) {
    if (!this.inputs.has('position_ids')) return null;
    const rows = this.manifest.graphs.forward.position_rows ?? 1;
    const data = new BigInt64Array(rows * t);
    for (let r = 0; r < rows; r++) for (let i = 0; i < t; i++) data[r * t + i] = BigInt(start + i);
    return new ort.Tensor('int64', data, rows === 1 ? [1, t] : [rows, 1, t]);
  }

  async release() {
    await this.session.release();
    if (this.replay) await this.replay.release();
  }
}

export function defaultMode(model, role = 'target') {
  return role === 'target' && model.replay ? 'replay' : 'ring';
}

export function zeros(spec, context) {
  const dims = spec.shape.map((d) => (d === 'batch' ? 1 : d === 'context' ? context : Number(d)));
  const size = dims.reduce((a, b) => a * b, 1);
  const data = spec.dtype === 'float32' ? new Float32Array(size) : new Uint16Array(size);
  return new ort.Tensor(spec.dtype, data, dims);
}

// A float32 copy of a logits tensor's host data (float16 exports return half floats as Uint16Array).
export function hostFloats(tensor) {
  if (tensor.type === 'float32') return tensor.data;
  if (tensor.type !== 'float16') throw new Error(`logits of type ${tensor.type}`);
  const src = tensor.data;
  const out = new Float32Array(src.length);
  for (let i = 0; i < src.length; i++) {
    const h = src[i], e = (h >> 10) & 31, m = h & 1023, s = h & 32768 ? -1 : 1;
    out[i] = e === 0 ? s * m * 2 ** -24 : e === 31 ? (m ? NaN : s * Infinity) : s * (1 + m / 1024) * 2 ** (e - 15);
  }
  return out;
}

// The rows of a [1, T, H] host tensor as T views (float32: Float32Array; float16: the raw Uint16Array halves).
export function splitRows(tensor, t) {
  const width = tensor.dims[tensor.dims.length - 1];
  return Array.from({ length: t }, (_, i) => tensor.data.subarray(i * width, (i + 1) * width));
}

export class RollbackError extends Error {}

export class Context {
  // mode: replay | ring for the recurrent state (pure-attention models: truncate only); window: W.
  constructor(model, { maxLen = null, mode = null, window = null } = {}) {
    const m = model.manifest;
    this.model = model;
    this.maxLen = maxLen || m.model.max_context;
    if (this.maxLen > m.model.max_context) throw new Error(`context ${this.maxLen} exceeds the export's ${m.model.max_context}`);
    mode = mode || defaultMode(model);
    if (!['replay', 'ring'].includes(mode)) throw new Error(`rollback mode ${mode} does not run in the browser (replay or ring)`);
    if (mode === 'replay' && !model.replay && model.hasRecurrent) throw new Error(`${model.name} has no replay graph; use ring`);
    this.window = window || m.rollback.window;
    this.mode = model.hasRecurrent ? mode : 'truncate';
    this.kvSpecs = m.state.filter((s) => s.role.startsWith('kv'));
    this.recSpecs = m.state.filter((s) => RECURRENT.has(s.role));
    this.nSlots = this.recSpecs.length ? (mode === 'ring' ? this.window + 1 : 2) : 0;
    this.rollbackName = m.rollback_data ? m.rollback_data.name : null;
    this.kv = null;
    this.slots = [];
    // Forwards also return the graph's `hidden` output (post-norm hidden rows, host typed arrays) as rows.hidden:
    // set for a draft source that reads them (the MTP head, mtp.js).
    this.hidden = false;
    this.reset();
  }

  get depth() { return this.window; }

  // -- tensor lifetimes -----------------------------------------------------------------------------------------
  _live() {
    const live = new Set();
    for (const s of this.slots) if (s) for (const t of Object.values(s)) live.add(t);
    if (this._checkpointState) for (const t of Object.values(this._checkpointState)) live.add(t);
    if (this._last) live.add(this._last.data);
    if (this.kv) for (const t of Object.values(this.kv)) live.add(t);
    return live;
  }

  _dispose(tensors) { // tensors no longer referenced by this context
    const live = this._live();
    for (const t of tensors) if (t && !live.has(t) && t.location === 'gpu-buffer') t.dispose();
  }

  _all() { return [...this._live()]; }

  dispose() {
    const all = this._all();
    this.slots = []; this.kv = null; this._checkpointState = null; this._last = null;
    this._dispose(all);
  }

  // -- position bookkeeping ----------------------------------------------------------------------------------
  reset() { // empty the sequence: position 0, zero recurrent state in slot 0
    const old = this._all();
    this.nPast = 0;
    this._last = null;
    this._checkpoint = null;
    this._checkpointState = null;
    // KV starts as zeros of maxLen rows, as in Python: GroupQueryAttention then always has a free row past the
    // sequence for the export's spare row (graphs.forward.spare_kv_row), and each present keeps that capacity.
    this.kv = Object.fromEntries(this.kvSpecs.map((s) => [s.name, zeros(s, this.maxLen)]));
    this.slots = new Array(this.nSlots).fill(null);
    this.slotPos = new Array(this.nSlots).fill(null);
    if (this.nSlots) {
      this.slots[0] = Object.fromEntries(this.recSpecs.map((s) => [s.name, zeros(s, 0)]));
      this.slotPos[0] = 0;
    }
    this.cur = 0;
    this._dispose(old);
  }

  // -- forward ----------------------------------------------------------------------------------------------------
  // Consume tokens; return their logits rows as Float32Array views, one per token. On WebGPU a forward of more than
  // WEBGPU_CHUNK tokens runs as several forwards of at most that many (a prefill; verify forwards are shorter):
  // onnxruntime-web 1.30's WebGPU GroupQueryAttention returns wrong rows, from the fifth on, for a call of 32 or
  // more new tokens (docs/browser.md). A replay then covers the last chunk only, as if the caller had
  // made those calls itself.
  async forward(tokens) {
    const t = tokens.length;
    if (t === 0) throw new Error('forward of zero tokens');
    if (this.nPast + t > this.maxLen) throw new Error(`context full: ${this.nPast} + ${t} tokens exceed ${this.maxLen}`);
    if (this.model.ep !== 'webgpu' || t <= WEBGPU_CHUNK) return this._forward(tokens);
    const rows = [], hidden = [];
    for (let i = 0; i < t; i += WEBGPU_CHUNK) {
      const part = await this._forward(tokens.slice(i, i + WEBGPU_CHUNK));
      rows.push(...part);
      if (part.hidden) hidden.push(...part.hidden);
    }
    if (this.hidden) rows.hidden = hidden;
    return rows;
  }

  async _forward(tokens) {
    const t = tokens.length;
    const model = this.model;
    const feeds = {
      input_ids: new ort.Tensor('int64', BigInt64Array.from(tokens, (x) => BigInt(x)), [1, t]),
      attention_mask: new ort.Tensor('int64', new BigInt64Array(this.nPast + t).fill(1n), [1, this.nPast + t]),
    };
    const positions = model.positionIds(this.nPast, t);
    if (positions) feeds.position_ids = positions;
    Object.assign(feeds, this.kv);
    if (this.nSlots) Object.assign(feeds, this.slots[this.cur]);
    // Only the outputs this runtime reads: a graph may declare more (they are then not computed).
    const fetches = ['logits', ...this.kvSpecs.map((s) => s.output), ...this.recSpecs.map((s) => s.output)];
    const packed = this.nSlots && this.mode === 'replay' && this.rollbackName;
    if (packed) fetches.push(this.rollbackName);
    if (this.hidden) fetches.push('hidden');
    const out = await model.session.run(feeds, fetches);
    const oldKv = Object.values(this.kv);
    this.kv = Object.fromEntries(this.kvSpecs.map((s) => [s.name, out[s.output]]));
    const replaced = [...oldKv];
    if (this.nSlots) {
      const outSlot = (this.cur + 1) % this.nSlots; // ring: overwrites the oldest; replay: the other slot
      if (this.slots[outSlot]) replaced.push(...Object.values(this.slots[outSlot]));
      if (this._last) replaced.push(this._last.data);
      this.slots[outSlot] = Object.fromEntries(this.recSpecs.map((s) => [s.name, out[s.output]]));
      this._last = packed ? { start: this.nPast, length: t, inSlot: this.cur, outSlot, data: out[this.rollbackName] } : null;
      this.slotPos[outSlot] = this.nPast + t;
      this.cur = outSlot;
    }
    this.nPast += t;
    this._dispose(replaced);
    const logits = out.logits;
    if (logits.dims.length !== 3 || logits.dims[1] !== t) {
      throw new Error(`${model.name}: logits of shape [${logits.dims}] for ${t} tokens; the page needs a row per token`);
    }
    const vocab = logits.dims[logits.dims.length - 1];
    const data = hostFloats(logits);
    const rows = [];
    for (let i = 0; i < t; i++) rows.push(data.subarray(i * vocab, (i + 1) * vocab));
    if (this.hidden) rows.hidden = splitRows(out.hidden, t);
    return rows;
  }

  // -- rollback -----------------------------------------------------------------------------------------------------
  // The mode that can undo the last n tokens, or null (the caller then needs checkpoint/restore).
  canRollback(n) {
    const pos = this.nPast - n;
    if (n < 0 || pos < 0) return null;
    if (n === 0) return 'none';
    if (!this.nSlots) return 'truncate';
    if (this.slotPos.includes(pos)) return this.mode;
    const last = this._last;
    if (last && last.start <= pos && pos < last.start + last.length && this.slotPos[last.inSlot] === last.start) return 'replay';
    return null;
  }

  // Return to position pos (keep the first pos tokens). Returns the mode used.
  async rollback(pos) {
    const mode = this.canRollback(this.nPast - pos);
    if (mode === null) {
      throw new RollbackError(`cannot roll back from ${this.nPast} to ${pos}: beyond the rollback window (mode ${this.mode}, window ${this.window})`);
    }
    if (this.nSlots && this.slotPos.includes(pos)) this.cur = this.slotPos.indexOf(pos);
    else if (mode === 'replay') await this._replay(pos);
    this.nPast = pos;
    this._invalidateAfter(pos);
    if (this._checkpoint !== null && pos < this._checkpoint) this._dropCheckpoint();
    return mode;
  }

  async _replay(pos) {
    const last = this._last;
    const j = pos - last.start;
    const data = last.data;
    const dims = [data.dims[0], j, ...data.dims.slice(2)];
    // The first j tokens of a [1, T, width] tensor: a prefix, so the same buffer with a shorter shape.
    const prefix = data.location === 'gpu-buffer'
      ? ort.Tensor.fromGpuBuffer(data.gpuBuffer, { dataType: data.type, dims })
      : new ort.Tensor(data.type, data.data.subarray(0, dims.reduce((a, b) => a * b, 1)), dims);
    const feeds = { ...this.slots[last.inSlot], [this.rollbackName]: prefix };
    const out = await this.model.replay.run(feeds, this.recSpecs.map((s) => s.output));
    const old = Object.values(this.slots[last.outSlot]);
    this.slots[last.outSlot] = Object.fromEntries(this.recSpecs.map((s) => [s.name, out[s.output]]));
    this.slotPos[last.outSlot] = pos;
    this.cur = last.outSlot;
    this._dispose(old);
  }

  _invalidateAfter(pos) {
    for (let i = 0; i < this.slotPos.length; i++) if (this.slotPos[i] !== null && this.slotPos[i] > pos) this.slotPos[i] = null;
    const last = this._last;
    if (last) {
      last.length = Math.min(last.length, pos - last.start);
      if (last.length <= 0 || this.slotPos[last.inSlot] !== last.start) {
        this._last = null;
        this._dispose([last.data]);
      }
    }
  }

  // -- checkpoint ---------------------------------------------------------------------------------------------------
  checkpoint() {
    const old = this._checkpointState ? Object.values(this._checkpointState) : [];
    this._checkpointState = this.nSlots ? this.slots[this.cur] : null;
    this._checkpoint = this.nPast;
    this._dispose(old);
  }

  restore() {
    if (this._checkpoint === null) throw new Error('restore() without checkpoint()');
    const old = [];
    if (this.nSlots) {
      if (this.slots[this.cur] !== this._checkpointState) old.push(...Object.values(this.slots[this.cur]));
      this.slots[this.cur] = this._checkpointState;
      this.slotPos = new Array(this.nSlots).fill(null);
      this.slotPos[this.cur] = this._checkpoint;
    }
    this.nPast = this._checkpoint;
    if (this._last) old.push(this._last.data);
    this._last = null;
    this._dispose(old);
  }

  _dropCheckpoint() {
    const old = this._checkpointState ? Object.values(this._checkpointState) : [];
    this._checkpoint = null;
    this._checkpointState = null;
    this._dispose(old);
  }
}
