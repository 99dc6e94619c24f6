// Plain and speculative generation over contexts: runtime/generation.py's loop, round for round.
//
// A speculative round drafts k tokens from a draft source (drafting.js: a drafter model; the target's MTP head in
// mtp.js; prompt lookup in ngram.js, which may find fewer or none: then the step is a plain one), verifies
// [t0, d1..dk] in one target forward, accepts a prefix, emits it plus one target token, and rolls the target and the
// source back to the accepted position (replay for the target, ring slots for a drafter model, truncation for KV and
// the head). A round that bounded rollback cannot serve (a draft longer than the window, a target without a replay
// graph, or rollback forced to checkpoint) keeps the state from before drafting, restores it
// after, and lets the next forward re-decode the accepted tokens. Counters count every round.

import { Context, defaultMode } from './context.js';
import { ModelDraft } from './drafting.js';
import { MtpDraft, NgramMtpDraft } from './mtp.js';
import { NgramDraft } from './ngram.js';
import { SamplingParams, Rng, accept, checkFinite, pick } from './sampling.js';

export class Stats {
  constructor(promptTokens) {
    Object.assign(this, {
      promptTokens, newTokens: 0, rounds: 0, drafted: 0, accepted: 0, emitted: 0, targetForwards: 0,
      drafterForwards: 0, lookups: 0, lookupHits: 0, rollbacks: {}, draftLengths: {}, seconds: {},
    });
  }

  async timed(what, fn) {
    const t = performance.now();
    try { return await fn(); } finally { this.seconds[what] = (this.seconds[what] || 0) + (performance.now() - t) / 1000; }
  }

  count(table, key) { this[table][key] = (this[table][key] || 0) + 1; }

  get acceptance() { return this.drafted ? this.accepted / this.drafted : null; }

  get decodeTokensPerS() {
    const t = this.seconds.decode || 0;
    return t > 0 && this.newTokens > 1 ? (this.newTokens - 1) / t : null;
  }

  toJSON() {
    return { ...this, acceptance: this.acceptance, decode_tokens_per_s: this.decodeTokensPerS };
  }
}

export function checkPair(target, drafter) {
  const a = target.tokenizer.get_vocab(true), b = drafter.tokenizer.get_vocab(true);
  let same = target.vocabSize === drafter.vocabSize && a.size === b.size;
  if (same) for (const [tok, id] of a) if (b.get(tok) !== id) { same = false; break; }
  if (!same) throw new Error(`drafter and target have different vocabularies (${drafter.vocabSize} vs ${target.vocabSize} tokens, or different tokenizers)`);
}

export class Generator {
  constructor(target, promptIds, {
    drafter = null, maxNewTokens = 128, sampling = new SamplingParams(), draftMax = 4, rollback = 'auto',
    stopStrings = [], stopAtEos = true, context = null, window = null,
  } = {}) {
    this.target = target;
    this.drafter = drafter;
    this.prompt = [...promptIds];
    if (!this.prompt.length) throw new Error('empty prompt: give at least one token of text');
    if (maxNewTokens < 1) throw new Error(`max new tokens must be >= 1, got ${maxNewTokens}`);
    if (!['auto', 'checkpoint'].includes(rollback)) throw new Error(`rollback must be auto or checkpoint, got ${rollback}`);
    this.maxNew = maxNewTokens;
    this.sampling = sampling;
    this.rng = new Rng(sampling.seed);
    this.stopStrings = stopStrings.filter((s) => s);
    this.eos = new Set(stopAtEos ? target.eosIds : []);
    this.window = window || target.manifest.rollback.window;
    this.stats = new Stats(this.prompt.length);
    this.tokens = [];
    this.stopReason = null;
    this.modesUsed = new Set();
    this.warnings = [];
    let ctxLen = context || target.maxContext;
    if (drafter) {
      if ((drafter.isHead || drafter.isMixed) && drafter.target !== target) throw new Error(`${drafter.name} is not ${target.name}'s head`);
      if (!drafter.isHead && !drafter.isLookup && !drafter.isMixed) checkPair(target, drafter);
      if (!drafter.isLookup) ctxLen = Math.min(ctxLen, drafter.maxContext);
      if (!(draftMax >= 1)) throw new Error(`draft length must be >= 1 (got ${draftMax})`);
    }
    if (this.prompt.length >= ctxLen) throw new Error(`prompt of ${this.prompt.length} tokens does not fit the context of ${ctxLen}`);
    this.draftMax = draftMax;
    this.rollback = rollback;
    this.tctx = new Context(target, { maxLen: ctxLen, mode: defaultMode(target), window: this.window });
    // drafter: a drafter Model, the target's MTP Head or a LookupThenHead (mtp.js), a Lookup (ngram.js): one draft
    // source for the round.
    const Source = !drafter ? null : drafter.isMixed ? NgramMtpDraft : drafter.isLookup ? NgramDraft
      : drafter.isHead ? MtpDraft : ModelDraft;
    this.source = drafter ? new Source(drafter, {
      maxLen: ctxLen, window: this.window, stats: this.stats, sampling, rng: this.rng, vocabSize: target.vocabSize,
    }) : null;
    this.tctx.hidden = !!(this.source && this.source.wantsHidden);
    if (this.source && this.tctx.nSlots) this.window = Math.min(this.window, this.tctx.depth);
    this.ctxLen = ctxLen;
  }

  get seq() { return this.prompt.concat(this.tokens); }

  dispose() {
    this.tctx.dispose();
    if (this.source) this.source.dispose();
  }

  _warnOnce(message) { if (!this.warnings.includes(message)) this.warnings.push(message); }

  // Append tokens, cutting at EOS, the token budget, the context or a stop string; set stopReason.
  _emit(next) {
    const out = [];
    for (const t of next) {
      if (this.eos.has(t)) { this.stopReason = 'eos'; break; }
      out.push(t);
      if (this.tokens.length + out.length >= this.maxNew) { this.stopReason = 'length'; break; }
      if (this.prompt.length + this.tokens.length + out.length >= this.ctxLen) { this.stopReason = 'context'; break; }
    }
    this.tokens.push(...out);
    this.stats.newTokens = this.tokens.length;
    if (this.stopStrings.length && this.stopReason === null) {
      const text = this.target.decode(this.tokens);
      if (this.stopStrings.some((s) => text.includes(s))) this.stopReason = 'stop_string';
    }
    return out;
  }

  // Yields the new token ids of each step or round.
  async *[Symbol.asyncIterator]() {
    const st = this.stats;
    let rows;
    await st.timed('prefill', async () => {
      rows = await this.tctx.forward(this.prompt);
      st.targetForwards++;
      if (this.source) await this.source.start(this.prompt, rows);
    });
    checkFinite(rows[rows.length - 1], "the target's prefill");
    const [first] = pick(rows[rows.length - 1], this.sampling, this.rng);
    let out = this._emit([first]);
    if (out.length) yield out;
    while (this.stopReason === null) {
      await st.timed('decode', async () => {
        const next = this.source ? await this._round() : await this._plainStep();
        out = this._emit(next);
      });
      if (out.length) yield out;
    }
  }

  async run() {
    for await (const _ of this) { /* the tokens accumulate in this.tokens */ }
    return this.tokens;
  }

  async _plainStep() {
    const rows = await this.tctx.forward(this.seq.slice(this.tctx.nPast));
    this.stats.targetForwards++;
    if (this.source) this.source.observe(rows, this.seq.length - 1);
    checkFinite(rows[rows.length - 1], 'the target');
    return [pick(rows[rows.length - 1], this.sampling, this.rng)[0]];
  }

  _draftLength() {
    const room = Math.min(this.maxNew - this.tokens.length - 1, this.ctxLen - this.seq.length - 1);
    return Math.max(0, Math.min(this.draftMax, room));
  }

  async _round() {
    let k = this._draftLength();
    if (k === 0) return this._plainStep();
    const { stats: st, tctx, source } = this;
    const n = this.seq.length; // the last accepted token t0 = seq[n-1] is consumed by neither the target nor the source
    const bounded = this._bounded(k);
    if (!bounded) {
      // A restore left the target (and a drafter model) at its checkpoint: re-decode the tokens accepted since (all
      // but t0) first.
      await st.timed('rollback', async () => {
        if (tctx.nPast < n - 1) {
          await tctx.forward(this.seq.slice(tctx.nPast, n - 1));
          st.targetForwards++;
        }
        await source.catchUp(this.seq, n);
      });
      tctx.checkpoint();
      source.checkpoint();
    }
    let draft, q;
    await st.timed('draft', async () => { ({ tokens: draft, q } = await source.propose(this.seq, k)); });
    if (!draft.length) return this._plainStep(); // a lookup that found nothing: a checkpoint taken is not needed
    k = draft.length; // a lookup may find fewer than asked
    let rows;
    await st.timed('verify', async () => {
      const all = await tctx.forward(this.seq.slice(tctx.nPast).concat(draft));
      rows = all.slice(-(k + 1));
      if (all.hidden) rows.hidden = all.hidden;
      st.targetForwards++;
    });
    for (const row of rows) checkFinite(row, "the target's verify");
    const [j, next] = accept(draft, q, rows, this.sampling, this.rng);
    st.rounds++;
    st.drafted += k;
    st.accepted += j;
    st.emitted += j + 1;
    st.count('draftLengths', k);
    await st.timed('rollback', async () => {
      const counted = (mode) => { st.count('rollbacks', mode); this.modesUsed.add(mode); };
      if (bounded && n + j < tctx.nPast) counted(`target:${await tctx.rollback(n + j)}`);
      const mode = await source.accepted(n, k, j, rows, bounded);
      if (mode) counted(`drafter:${mode}`);
      if (!bounded) {
        tctx.restore();
        counted('checkpoint');
      }
    });
    return draft.slice(0, j).concat([next]);
  }

  // Can this round roll back without a checkpoint? Warn once, naming the cause, when it cannot.
  _bounded(k) {
    if (this.rollback === 'checkpoint') return false;
    if (k > this.window && (this.tctx.nSlots || this.source.nSlots)) {
      this._warnOnce(`draft length ${k} exceeds the rollback window ${this.window}: such rounds take the checkpoint path`);
      return false;
    }
    if (this.tctx.nSlots && this.tctx.mode !== 'replay') {
      this._warnOnce(`${this.target.name} has no replay graph: every round takes the checkpoint path`);
      return false;
    }
    return true;
  }
}
