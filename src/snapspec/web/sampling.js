// Turning logits rows into tokens, as runtime/sampling.py does: greedy, temperature / top-k / top-p sampling
// from a seeded generator, and the speculative acceptance rules (greedy match; Leviathan et al.'s rejection rule
// with the residual distribution, which leaves the output distributed exactly as the target's). Float64 throughout,
// like the NumPy code. The generator is not NumPy's PCG64, so a seed gives other draws than Python's: the rule and
// the distributions are the same, the samples are not.

export class SamplingParams {
  constructor({ temperature = 0, topK = 0, topP = 1, seed = null } = {}) {
    if (!Number.isFinite(temperature) || temperature < 0) throw new Error(`temperature must be >= 0, got ${temperature}`);
    if (!Number.isInteger(topK) || topK < 0) throw new Error(`top-k must be an integer >= 0, got ${topK}`);
    if (!(topP > 0 && topP <= 1)) throw new Error(`top-p must be in (0, 1], got ${topP}`);
    Object.assign(this, { temperature, topK, topP, seed });
  }

  get greedy() { return this.temperature === 0; }
}

// sfc32 (Chris Doty-Humphrey's small fast counter generator), seeded through splitmix32; doubles take 53 bits
// from two outputs, as NumPy's random() does from one 64-bit output.
export class Rng {
  constructor(seed = null) {
    let s = seed === null || seed === undefined ? crypto.getRandomValues(new Uint32Array(1))[0] : Number(seed) >>> 0;
    const splitmix = () => {
      s = (s + 0x9e3779b9) >>> 0;
      let z = s;
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
      return (z ^ (z >>> 16)) >>> 0;
    };
    this.a = splitmix(); this.b = splitmix(); this.c = splitmix(); this.d = splitmix();
    for (let i = 0; i < 12; i++) this.next32();
  }

  next32() {
    const t = (((this.a + this.b) >>> 0) + this.d) >>> 0;
    this.d = (this.d + 1) >>> 0;
    this.a = this.b ^ (this.b >>> 9);
    this.b = (this.c + (this.c << 3)) >>> 0;
    this.c = ((this.c << 21) | (this.c >>> 11)) >>> 0;
    this.c = (this.c + t) >>> 0;
    return t;
  }

  random() { // uniform in [0, 1)
    return ((this.next32() >>> 5) * 67108864 + (this.next32() >>> 6)) / 9007199254740992;
  }

  choice(dist) { // numpy Generator.choice(n, p=dist): cdf normalised by its last entry, searchsorted right
    const cdf = new Float64Array(dist.length);
    let acc = 0;
    for (let i = 0; i < dist.length; i++) { acc += dist[i]; cdf[i] = acc; }
    const u = this.random() * acc;
    let lo = 0, hi = cdf.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (cdf[mid] <= u) lo = mid + 1; else hi = mid; }
    return Math.min(lo, dist.length - 1);
  }
}

export function argmax(row) {
  let best = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;
  return best;
}

export function checkFinite(row, where) {
  for (let i = 0; i < row.length; i++) {
    if (!Number.isFinite(row[i])) {
      throw new Error(`non-finite logits from ${where}; stopping instead of emitting garbage`);
    }
  }
}

// The distribution actually sampled from: temperature, then top-k (ties with the k-th value stay), then top-p
// (the smallest prefix of the stably sorted distribution whose mass reaches top_p).
export function probs(row, p) {
  const n = row.length;
  const z = new Float64Array(n);
  for (let i = 0; i < n; i++) z[i] = row[i] / p.temperature;
  if (p.topK && p.topK < n) {
    const kth = Float64Array.from(z).sort()[n - p.topK];
    for (let i = 0; i < n; i++) if (z[i] < kth) z[i] = -Infinity;
  }
  let max = -Infinity;
  for (let i = 0; i < n; i++) if (z[i] > max) max = z[i];
  let sum = 0;
  for (let i = 0; i < n; i++) { z[i] = Math.exp(z[i] - max); sum += z[i]; }
  for (let i = 0; i < n; i++) z[i] /= sum;
  if (p.topP < 1) {
    const order = Array.from(z.keys()).sort((a, b) => z[b] - z[a] || a - b);
    let cum = 0, keep = n;
    for (let i = 0; i < n; i++) {
      cum += z[order[i]];
      if (cum >= p.topP) { keep = i + 1; break; }
    }
    const kept = new Float64Array(n);
    let total = 0;
    for (let i = 0; i < keep; i++) { kept[order[i]] = z[order[i]]; total += z[order[i]]; }
    for (let i = 0; i < n; i++) kept[i] /= total;
    return kept;
  }
  return z;
}

// One token from one logits row, and the distribution when sampling (the acceptance rule needs it).
export function pick(row, p, rng) {
  if (p.greedy) return [argmax(row), null];
  const dist = probs(row, p);
  return [rng.choice(dist), dist];
}

// [j accepted draft tokens, the target's next token] for target rows (k + 1 rows of logits).
export function accept(draft, q, rows, p, rng) {
  const k = draft.length;
  if (p.greedy) {
    let j = 0;
    while (j < k && draft[j] === argmax(rows[j])) j++;
    return [j, argmax(rows[j])];
  }
  for (let i = 0; i < k; i++) {
    const pt = probs(rows[i], p);
    const d = draft[i];
    if (rng.random() * q[i][d] < pt[d]) continue; // u < p/q without dividing by a tiny q
    const residual = new Float64Array(pt.length);
    let total = 0;
    for (let v = 0; v < pt.length; v++) { residual[v] = Math.max(pt[v] - q[i][v], 0); total += residual[v]; }
    if (total > 0) for (let v = 0; v < pt.length; v++) residual[v] /= total;
    return [i, rng.choice(total > 0 ? residual : pt)];
  }
  return [k, rng.choice(probs(rows[k], p))];
}
