// Prompt lookup in the page: runtime/drafters/ngram.py's index and drafts, for `snapspec web --drafter ngram`.
//
// The longest suffix of the sequence, of nMax down to nMin tokens, that occurred earlier proposes the tokens that
// followed its most recent earlier occurrence; a continuation that runs into the suffix itself repeats with its
// period. The index maps each n-gram (as a comma-joined key) to the positions just after its occurrences, in order,
// so a lookup and an appended token cost O(nMax^2) whatever the sequence's length; a sequence that was rolled back
// pops the removed positions. NgramDraft puts it behind the page's draft-source interface (drafting.js): no model,
// no state to roll back, one-hot q rows when sampling (the rejection rule stays exact). A lookup that finds nothing
// proposes nothing, and the round is a plain target step.

export const DEFAULT_MIN = 2, DEFAULT_MAX = 4, LIMIT = 16;

export class NgramIndex {
  constructor(nMin = DEFAULT_MIN, nMax = DEFAULT_MAX) {
    if (!(nMin >= 1 && nMin <= nMax && nMax <= LIMIT)) {
      throw new Error(`n-gram sizes must satisfy 1 <= ngram-min <= ngram-max <= ${LIMIT}, got ${nMin}, ${nMax}`);
    }
    Object.assign(this, { nMin, nMax, seq: [], ends: new Map() });
  }

  extend(tokens) {
    for (const t of tokens) {
      const end = this.seq.length; // the n-grams ending here now have a following token: t
      for (let n = this.nMin; n <= Math.min(this.nMax, end); n++) {
        const key = this.seq.slice(end - n, end).join(',');
        if (!this.ends.has(key)) this.ends.set(key, []);
        this.ends.get(key).push(end);
      }
      this.seq.push(t);
    }
  }

  truncate(length) {
    while (this.seq.length > Math.max(length, 0)) {
      this.seq.pop();
      const end = this.seq.length;
      for (let n = this.nMin; n <= Math.min(this.nMax, end); n++) {
        const key = this.seq.slice(end - n, end).join(',');
        const hits = this.ends.get(key);
        hits.pop(); // the last position added for this n-gram is this one
        if (!hits.length) this.ends.delete(key);
      }
    }
  }

  // Hold seq: keep the longest common prefix with what is held, then append the rest.
  sync(seq) {
    let have = 0;
    const limit = Math.min(this.seq.length, seq.length);
    if (this.seq.length <= seq.length && this.seq.length && this.seq[this.seq.length - 1] === seq[this.seq.length - 1]) {
      have = this.seq.length; // within a generation the sequence only grows: one comparison confirms it
    } else {
      while (have < limit && this.seq[have] === seq[have]) have++;
      this.truncate(have);
    }
    this.extend(seq.slice(have));
  }

  // [n, end]: the longest suffix n-gram seen before and the position after its latest earlier occurrence.
  match() {
    const size = this.seq.length;
    for (let n = Math.min(this.nMax, size - 1); n >= this.nMin; n--) {
      const hits = this.ends.get(this.seq.slice(size - n).join(','));
      if (hits) return [n, hits[hits.length - 1]];
    }
    return [0, -1];
  }

  lookup(k) {
    const [n, end] = this.match();
    if (!n || k < 1) return [];
    const size = this.seq.length, draft = [];
    for (let i = 0; i < k; i++) {
      const p = end + i;
      draft.push(p < size ? this.seq[p] : draft[p - size]);
    }
    return draft;
  }
}

// What the page passes as its drafter for prompt lookup (in place of a drafter Model or the MTP Head).
export class Lookup {
  constructor(nMin = DEFAULT_MIN, nMax = DEFAULT_MAX) {
    new NgramIndex(nMin, nMax); // checks the sizes
    Object.assign(this, { isLookup: true, nMin, nMax, name: `n-gram lookup ${nMin}-${nMax}` });
  }
}

export class NgramDraft {
  constructor(lookup, { stats, sampling, vocabSize }) {
    Object.assign(this, { stats, sampling, vocabSize });
    this.index = new NgramIndex(lookup.nMin, lookup.nMax);
    this.wantsHidden = false;
  }

  get nSlots() { return 0; }

  async start(prompt) {
    this.index.truncate(0);
    this.index.extend(prompt);
  }

  async catchUp() {}

  checkpoint() {}

  restore() {}

  async propose(seq, k) {
    this.index.sync(seq);
    const tokens = this.index.lookup(k);
    this.stats.lookups++;
    if (tokens.length) this.stats.lookupHits++;
    const q = this.sampling.greedy ? [] : tokens.map((t) => {
      const row = new Float64Array(this.vocabSize);
      row[t] = 1;
      return row;
    });
    return { tokens, q };
  }

  async accepted() { return null; } // nothing consumed: the next lookup sees the accepted sequence

  observe() {}

  dispose() {}
}
