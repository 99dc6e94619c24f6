// Drafting with the target's own multi-token-prediction head (mtp.onnx, docs/mtp.md) in the page: the browser's
// runtime/drafters/mtp.py, with the same bookkeeping.
//
// The head's position p holds the pair (t_{p+1}, h_p): the token after p and the target's post-norm hidden at p; its
// logits there predict t_{p+2}. The target's forwards return their hidden rows (Context.hidden); the rows of
// committed tokens wait here, by position, until the head consumes them (a verify's rows past the accepted prefix
// saw rejected drafts and are dropped). A round after seq (n tokens, seq[n-1] not consumed by the target yet):
//   - one multi-row head forward over the pairs not consumed yet, positions nPast..n-2 (the accepted tokens and the
//     bonus token with the verify's hidden rows; after the prompt, the first token), whose last row gives draft 1;
//   - k-1 one-row chained steps: (draft i, the head's own hidden_out) at position n-2+i gives draft i+1.
// After the verify the head's KV is truncated to n-1 (its rows from there were fed its own hidden, never the
// target's): a shorter attention mask, as the target's KV in context.js. Greedy drafts are the graph's next_tokens;
// sampled drafts are drawn from its logits under the target's sampling law (sampling.pick), q rows included.

import { ort } from './vendor.js';
import { WEBGPU_CHUNK, hostFloats, openGraph, splitRows, zeros } from './context.js';
import { NgramDraft } from './ngram.js';
import { checkFinite, pick } from './sampling.js';

// Head rows per forward while catching up on a prompt (wasm). onnxruntime-web takes no overridable initializer as an
// input, so the graph's logits_to_keep stays at its default (every row): a forward computes t rows of logits.
const PREFILL_CHUNK = 64;

// The head's session beside a loaded target; what Generator takes as `drafter` for MTP drafting.
export class Head {
  constructor(target, session) {
    Object.assign(this, { target, session });
    this.isHead = true;
    this.name = `${target.name} (MTP head)`;
    this.info = target.manifest.mtp;
    this.graph = target.manifest.graphs.mtp;
    this.inputs = new Set(session.inputNames); // the graph's inputs; logits_to_keep is an initializer
    this.maxContext = target.maxContext;
  }

  async release() { await this.session.release(); }
}

export function hasHead(manifest) {
  return !!(manifest.mtp && manifest.graphs.mtp && manifest.graphs.forward.outputs.includes('hidden'));
}

// mtp.onnx of a loaded target (context.js loadModel): it reads the embedding, output projection and rotary tables
// from the target's data file, which onnxruntime-web loads again for this session.
export async function loadHead(target, { onProgress = () => {} } = {}) {
  if (!hasHead(target.manifest)) {
    throw new Error(`${target.name} has no MTP head: export a checkpoint with mtp.* weights (without --no-mtp)`);
  }
  return new Head(target, await openGraph(target.entry, target.manifest, 'mtp', target.ep, onProgress));
}

// The head's KV over maxLen positions; forward consumes rows at nPast.., truncate rolls back.
class HeadContext {
  constructor(head, maxLen) {
    this.head = head;
    this.maxLen = maxLen;
    this.kvSpecs = head.info.state;
    // One spare row past the sequence (graphs.mtp.spare_kv_row), as runtime/drafters/mtp_head.py sizes it.
    this.kv = Object.fromEntries(this.kvSpecs.map((s) => [s.name, zeros(s, maxLen + 1)]));
    this.nPast = 0;
  }

  truncate(pos) {
    if (!(pos >= 0 && pos <= this.nPast)) throw new Error(`the MTP head cannot go from ${this.nPast} to ${pos}`);
    this.nPast = pos;
  }

  // ids [t], hidden: t rows (typed arrays of the export's dtype). Returns the last row's {id, hidden, logits}.
  async forward(ids, hidden, logits) {
    const t = ids.length, head = this.head;
    if (t === 0 || hidden.length !== t) throw new Error(`MTP head forward of ${t} tokens and ${hidden.length} hidden rows`);
    if (this.nPast + t > this.maxLen) throw new Error(`MTP head context full: ${this.nPast} + ${t} tokens exceed ${this.maxLen}`);
    const width = hidden[0].length;
    const flat = new hidden[0].constructor(t * width);
    hidden.forEach((row, i) => flat.set(row, i * width));
    const feeds = {
      input_ids: new ort.Tensor('int64', BigInt64Array.from(ids, (x) => BigInt(x)), [1, t]),
      hidden: new ort.Tensor(flat instanceof Float32Array ? 'float32' : 'float16', flat, [1, t, width]),
      attention_mask: new ort.Tensor('int64', new BigInt64Array(this.nPast + t).fill(1n), [1, this.nPast + t]),
      ...this.kv,
    };
    const positions = head.target.positionIds(this.nPast, t);
    if (positions && head.inputs.has('position_ids')) feeds.position_ids = positions;
    if (head.inputs.has('logits_to_keep')) feeds.logits_to_keep = new ort.Tensor('int64', BigInt64Array.of(1n), []);
    const fetches = ['next_tokens', 'hidden_out', ...this.kvSpecs.map((s) => s.output), ...(logits ? ['logits'] : [])];
    const out = await head.session.run(feeds, fetches);
    const old = Object.values(this.kv);
    this.kv = Object.fromEntries(this.kvSpecs.map((s) => [s.name, out[s.output]]));
    for (const x of old) if (x.location === 'gpu-buffer') x.dispose();
    this.nPast += t;
    const kept = out.next_tokens.dims[1];
    const rows = { id: Number(out.next_tokens.data[kept - 1]), hidden: splitRows(out.hidden_out, kept)[kept - 1] };
    if (logits) {
      const vocab = out.logits.dims[2];
      rows.logits = hostFloats(out.logits).subarray((kept - 1) * vocab, kept * vocab);
    }
    return rows;
  }

  dispose() {
    for (const x of Object.values(this.kv)) if (x.location === 'gpu-buffer') x.dispose();
    this.kv = {};
  }
}

// The draft-source interface of drafting.js over the head.
export class MtpDraft {
  constructor(head, { maxLen, stats, sampling, rng }) {
    Object.assign(this, { head, stats, sampling, rng });
    this.ctx = new HeadContext(head, maxLen);
    this.nSlots = 0;
    this.wantsHidden = true;
    this.hidden = new Map(); // the target's hidden rows not consumed yet, by position
    this.chunk = head.target.ep === 'webgpu' ? WEBGPU_CHUNK : PREFILL_CHUNK; // see Context.forward
  }

  async start(prompt, prefill) {
    if (!prefill.hidden) throw new Error("the target's prefill returned no hidden rows for the MTP head");
    const n = prompt.length;
    this._store(prefill.hidden, n - 1, n - 1);
    await this._catchUp(prompt, n - 1, false);
  }

  async catchUp() {} // the head's pairs come from hidden rows kept by position: propose catches up

  checkpoint() {}

  restore() {}

  async propose(seq, k) {
    const n = seq.length;
    const sampled = !this.sampling.greedy;
    let row = await this._catchUp(seq, n - 1, sampled); // pairs up to n - 2: its last row predicts t_n
    if (!row) throw new Error(`the MTP head has nothing to draft from at position ${n - 1}`);
    const tokens = [], q = [];
    for (let i = 0; i < k; i++) {
      let d = row.id, dist = null;
      if (sampled) {
        checkFinite(row.logits, 'the MTP head');
        [d, dist] = pick(row.logits, this.sampling, this.rng);
      }
      tokens.push(d);
      q.push(dist);
      if (i + 1 < k) {
        row = await this.ctx.forward([d], [row.hidden], sampled);
        this.stats.drafterForwards++;
      }
    }
    return { tokens, q };
  }

  // Truncation whether the target rolled back or restored a checkpoint: the verify's rows of committed tokens are
  // exact either way (they were computed from the committed state).
  async accepted(n, k, j, verify) {
    if (!verify.hidden) throw new Error("the target's verify returned no hidden rows for the MTP head");
    let mode = null;
    if (this.ctx.nPast > n - 1) {
      this.ctx.truncate(n - 1);
      mode = 'truncate';
    }
    this._store(verify.hidden, n + k - 1, n + j - 1); // rows past n + j - 1 saw rejected drafts
    return mode;
  }

  observe(rows, end) {
    if (rows.hidden) this._store(rows.hidden, end, end);
  }

  dispose() {
    this.ctx.dispose();
    this.hidden.clear();
  }

  // Keep the rows of a forward whose last row is at position end, up to position keepTo.
  _store(hidden, end, keepTo) {
    const start = end - hidden.length + 1;
    hidden.forEach((row, i) => {
      const p = start + i;
      if (p >= this.ctx.nPast && p <= keepTo) this.hidden.set(p, row);
    });
  }

  // Feed the head the pairs (seq[p + 1], h_p) for p = nPast..upto - 1, in chunks; the last forward's row.
  async _catchUp(seq, upto, logits) {
    let row = null;
    while (this.ctx.nPast < upto) {
      const p0 = this.ctx.nPast, p1 = Math.min(upto, p0 + this.chunk);
      const hidden = [];
      for (let p = p0; p < p1; p++) {
        const h = this.hidden.get(p);
        if (!h) throw new Error(`the MTP head has no hidden row of the target at position ${p}`);
        hidden.push(h);
        this.hidden.delete(p);
      }
      row = await this.ctx.forward(seq.slice(p0 + 1, p1 + 1), hidden, logits && p1 === upto);
      this.stats.drafterForwards++;
    }
    return row;
  }
}

// `--drafter ngram+mtp` (runtime/drafters/ngram_mtp.py): a lookup's draft where it finds one, the target's MTP head's
// elsewhere. The head (MtpDraft above) follows every verify whoever drafted: its accepted() keeps the verify's rows
// of the committed tokens by position, and its next draft consumes them in one catch-up forward.
export class LookupThenHead {
  constructor(lookup, head) {
    Object.assign(this, { isMixed: true, lookup, head, target: head.target, maxContext: head.maxContext });
    this.name = `${lookup.name}, else ${head.name}`;
  }
}

export class NgramMtpDraft {
  constructor(mixed, opts) {
    this.lookup = new NgramDraft(mixed.lookup, opts);
    this.head = new MtpDraft(mixed.head, opts);
    this.wantsHidden = true;
  }

  get nSlots() { return 0; }

  async start(prompt, prefill) {
    await this.lookup.start(prompt);
    await this.head.start(prompt, prefill);
  }

  async catchUp() {}

  checkpoint() {}

  restore() {}

  async propose(seq, k) {
    // the head's waiting rows stay within a chunk while lookups draft (drafters/mtp.py keep_up)
    if (seq.length - 1 - this.head.ctx.nPast >= this.head.chunk) await this.head._catchUp(seq, seq.length - 1, false);
    const draft = await this.lookup.propose(seq, k);
    return draft.tokens.length ? draft : this.head.propose(seq, k);
  }

  async accepted(n, k, j, verify, bounded) { return this.head.accepted(n, k, j, verify, bounded); }

  observe(rows, end) { this.head.observe(rows, end); }

  dispose() { this.head.dispose(); }
}
