"""Warm-up: run the largest forwards a server will run once, before its first request, then empty the contexts.

onnxruntime gives each session a CPU arena (a BFC allocator) that never returns memory: it grows, region by region
(1, 2, 4, ... MiB: power of two by power of two), whenever a forward needs more than its free chunks hold, up to the
peak of the largest call that session runs (and what fragmentation adds on top). A server has several sessions per
model: the one-sequence forward (prefill chunks and lone steps run there), the scheduler's graphs for 2..N sequences
(runtime/scheduler.py) and a drafter model's. Without a warm-up each arena reaches its peak when the traffic first
brings its largest call (a long prompt's full prefill chunk; the first step of N sequences at once), so a server's
resident memory climbs for its first hundreds of requests (docs/benchmarks/serving.md, "Where the load run's memory
grows"). Here each session meets its largest call at start:

- every distinct model among the contexts: one prefill chunk (`chunk` tokens, the Generator's default), alone, from
  position 0, keeping one row with logits (a long prompt's first chunk);
- with a scheduler: for each batch size 2..N, one forward of that many of the target's contexts, each of the rows the
  scheduler batches at most (a verify of the deepest bounded draft), every row kept with logits
  (Scheduler.warm_rows);
- every context, with no forward: its runner's host buffers for a greedy call's outputs (rollback data, hidden rows,
  ids) sized for a whole chunk keeping every row (BoundRunner.reserve), and each chat mark's copy of the recurrent
  state (`marks`: SavedState.reserve). Both are allocated on first use otherwise, slot by slot as the traffic reaches
  them, and the host buffers grow by doubling as longer prompts come (Python's tracemalloc named them in a 16-slot
  server: docs/serve.md, "Under load"; what that server's memory grew by under load was the batched runners' kept
  bindings, runners/batched.py CACHED).

Position 0, not the deepest: the CPU attention kernel sizes its scratch by the KV buffer's length, not the position,
and a deeper start would fail on a graph whose rotary table is shorter than the context it was exported for.

The calls run on the contexts' own buffers with token 0; `reset` then empties every context (position 0, zero
recurrent state), so what a request meets afterwards is what it meets without a warm-up: tests/serve/test_warm.py
checks that served text is the same bit for bit.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .context import PREFILL_CHUNK

log = logging.getLogger("snapspec")


def warm(contexts: list, scheduler=None, chunk: int | None = None, marks: list = ()) -> dict:
    """Run the largest calls once through every session these contexts (and the scheduler) use, then reset the
    contexts and reserve their host buffers and the marks' copies. contexts: every context of every slot (target
    and drafter models'); scheduler: the target's, when slots decode together; marks: SavedStates. Returns what
    ran: {"alone": [(model folder name, rows)], "batched": [(sequences, rows)], "seconds": wall time}."""
    started = time.monotonic()
    chunk = int(chunk or PREFILL_CHUNK)
    done: dict = {"alone": [], "batched": []}
    seen: set[int] = set()
    for ctx in contexts:
        if id(ctx.model) in seen:
            continue
        seen.add(id(ctx.model))
        t = min(chunk, ctx.max_len - 1)  # a prompt leaves room for one new token
        ids = np.zeros((1, t), dtype=np.int64)
        ctx.bound.forward(ctx.keys(), ids, 0, 1, True)
        done["alone"].append((ctx.model.folder.name, t))
    if scheduler is not None:
        done["batched"] = scheduler.warm_rows([c for c in contexts if c.batch is scheduler])
    for ctx in contexts:
        ctx.reset()
        ctx.bound.reserve(ctx.keys(), min(chunk, ctx.max_len - 1))
    for saved in marks:  # their stores' contexts were just reset: position 0
        saved.reserve(0)
    done["seconds"] = time.monotonic() - started
    log.info("warm-up: %s in %.1f s", done, done["seconds"])
    return done
