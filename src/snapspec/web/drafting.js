// Draft sources: what the speculative round of generation.js drafts from, behind one interface (the page's
// runtime/drafters/base.py). The round calls only these members, whatever drafts:
//
//   nSlots                      recurrent state slots (0: rolls back by truncation); the round's window check
//   wantsHidden                 the target's forwards must return their hidden rows (rows.hidden)
//   start(prompt, prefill)      after the target's prefill (its rows)
//   catchUp(seq, n)             a checkpoint round: consume what was accepted since the checkpoint, up to n - 1
//   checkpoint(), restore()     a checkpoint round's state before drafting, and back to it after the verify
//   propose(seq, k)             k draft tokens after seq, and their q rows when sampling: {tokens, q}
//   accepted(n, k, j, verify, bounded)   after the verify of a round at n: j drafts accepted, verify = the verify's
//                               rows; roll back (bounded) or restore; returns the rollback mode counted, or null
//   observe(rows, end)          a plain target step's rows, whose last row is at position end
//   dispose()
//
// ModelDraft drafts with a drafter model's context (below); MtpDraft with the target's MTP head (mtp.js).

import { Context, defaultMode } from './context.js';
import { checkFinite, pick } from './sampling.js';

export class ModelDraft {
  constructor(model, { maxLen, window, stats, sampling, rng }) {
    Object.assign(this, { model, stats, sampling, rng });
    this.ctx = new Context(model, { maxLen, mode: defaultMode(model, 'drafter'), window });
    this.wantsHidden = false;
  }

  get nSlots() { return this.ctx.nSlots; }

  async start(prompt) {
    await this.ctx.forward(prompt);
    this.stats.drafterForwards++;
  }

  async catchUp(seq, n) {
    if (this.ctx.nPast < n - 1) {
      await this.ctx.forward(seq.slice(this.ctx.nPast, n - 1));
      this.stats.drafterForwards++;
    }
  }

  checkpoint() { this.ctx.checkpoint(); }

  restore() { this.ctx.restore(); }

  async propose(seq, k) {
    const tokens = [], q = [];
    let rows = await this.ctx.forward(seq.slice(this.ctx.nPast));
    for (let i = 0; i < k; i++) {
      checkFinite(rows[rows.length - 1], 'the drafter');
      const [d, dist] = pick(rows[rows.length - 1], this.sampling, this.rng);
      tokens.push(d);
      q.push(dist);
      if (i + 1 < k) rows = await this.ctx.forward([d]);
    }
    this.stats.drafterForwards += k;
    return { tokens, q };
  }

  // The drafter consumed t0 and d1..d(k-1): keep t0 and the accepted drafts (all k - 1 when j = k).
  async accepted(n, k, j, verify, bounded) {
    if (!bounded) {
      this.ctx.restore();
      return null;
    }
    const keep = Math.min(n + j, n + k - 1);
    return keep < this.ctx.nPast ? this.ctx.rollback(keep) : null;
  }

  observe() {}

  dispose() { this.ctx.dispose(); }
}
