"""The rollback policy, decided here and nowhere else: which forward graph a model runs, which state store each side
of a pair keeps, how deep bounded rollback reaches, and whether a k-token draft can be undone without a checkpoint.
Every Context is opened here (`Policy.open`); the Pair holds one Policy and asks it.

One user-facing name, `rollback` (`--rollback`), with these values:
- auto: bounded rollback; each side's store follows from its export and its side of the pair (below);
- replay / window: force the target's recurrent store (window: onnxruntime's state_window graph, CUDA only); chosen
  when the target is loaded, since they pick its forward graph (a target loaded to batch several sequences takes
  `for_batching`'s: auto is replay on CUDA);
- checkpoint: copy the state before every round and restore it after (the slow baseline, for comparisons); a
  per-generation choice (load() takes auto, replay or window only).

The stores, for `auto` (docs/rollback-and-the-round.md has the table of costs):
- attention KV: truncation, always;
- a target's recurrent state: the state-window graph on CUDA when the export has one, else replay;
- a drafter's recurrent state: ring slots (its one-token steps write successive slots), on the forward graph without
  rollback data when the export has one (forward_ring).
A model is loaded for one role (load(role=...): the graph); the side a context serves picks its store, so a model
loaded as target can also draft for itself.

The window W (the deepest bounded rollback, `--rollback-window` at export) is read once, here: the target export's,
unless the caller gives another. Replay and ring stores undo up to W tokens; the state-window graph keeps W states
and so undoes W - 1.
"""

from __future__ import annotations

from snapspec import SnapspecError

from .context import Context

ROLLBACK = ("auto", "replay", "window", "checkpoint")
GRAPH_CHOICES = ("auto", "replay", "window")  # what load() acts on: the forward graph


def check(rollback: str) -> str:
    if rollback not in ROLLBACK:
        raise SnapspecError(f"unknown rollback {rollback!r}: use {', '.join(ROLLBACK)}")
    return rollback


def for_batching(rollback: str, ep: str) -> str:
    """The rollback a target that runs several sequences in one forward is loaded with: `auto` picks the state-window
    graph on CUDA, which runs one sequence (runtime/batched_session.batchable), so there it is replay, the forward
    graph. One sequence decodes alike on both (an H100, pair-a's shape: docs/serve.md, "Parallel requests"); the
    window graph's cheaper rollback is worth about 5% of a lone speculative sequence."""
    return "replay" if check(rollback) == "auto" and ep == "cuda" else rollback


def graph_for(m, ep: str, role: str, rollback: str) -> str:
    """forward, forward_window or forward_ring: the graph a model of this role runs under this rollback."""
    if check(rollback) == "checkpoint":
        raise SnapspecError("rollback=checkpoint is chosen per generation (generate(..., rollback='checkpoint'), "
                            "--rollback checkpoint), not when loading: load() takes auto, replay or window")
    has_window = m.graph_path("forward_window") is not None
    if rollback == "window":
        if not has_window:
            raise SnapspecError(f"{m.folder} has no state-window graph (exports with recurrent state and "
                                "--rollback-window <= 8 have one); use --rollback replay")
        if ep != "cuda":
            raise SnapspecError(f"the state-window graph runs on CUDA only (onnxruntime's state_window), not on {ep}; "
                                "use --ep cuda or --rollback replay")
        return "forward_window"
    if rollback == "auto" and has_window and ep == "cuda" and role == "target":
        return "forward_window"
    if rollback == "auto" and role == "drafter" and m.graph_path("forward_ring") is not None:
        return "forward_ring"
    return "forward"


def window_of(target, window: int | None = None) -> int:
    """The window W of bounded rollback: as given, else the target export's (`--rollback-window`); target: a loaded
    Model or its Manifest. The manifest's value is read here and nowhere else."""
    w = int(window or getattr(target, "manifest", target).rollback["window"])
    if w < 1:
        raise SnapspecError(f"rollback window must be >= 1, got {w}")
    return w


def store_for(model, side: str) -> str:
    """The recurrent store of a context over `model` on one side of a pair: window on the state-window graph,
    replay for a target that has the replay graph, ring otherwise (a drafter, or an export without replay)."""
    if model.state_window is not None:
        return "window"
    return "replay" if side == "target" and model.replay is not None else "ring"


class Policy:
    """Rollback and draft length for one target and its draft source (a drafter model, or None for a source
    without state of its own: n-gram lookup, an MTP head, whose KV truncates)."""

    def __init__(self, target, drafter=None, *, rollback: str = "auto", window: int | None = None):
        self.target, self.drafter = target, drafter
        self.rollback = check(rollback)
        self.window = window_of(target, window)
        if rollback in ("replay", "window") and target.has_recurrent and store_for(target, "target") != rollback:
            raise SnapspecError(f"rollback={rollback} is chosen when the target is loaded (load(..., rollback="
                                f"{rollback!r}) or --rollback {rollback}); this target runs "
                                f"{store_for(target, 'target')}")

    def under(self, rollback: str) -> Policy:
        """The same pair under another rollback value."""
        return Policy(self.target, self.drafter, rollback=rollback, window=self.window)

    # -- stores -----------------------------------------------------------------------------------------------------
    def open(self, model, length: int, side: str | None = None, *, store: str | None = None, **options) -> Context:
        """A Context over `model` for one side of the pair (target or drafter; default: the role it was loaded for),
        with the store that side keeps and the policy's window; store: force one (the conformance checks of each
        store)."""
        side = side or model.role
        if side not in ("target", "drafter"):
            raise SnapspecError(f"side must be target or drafter, got {side!r}")
        return Context(model, length, mode=store or store_for(model, side), window=self.window, **options)

    def depth(self, model, side: str) -> int | None:
        """The longest draft a side's context undoes in place: W (W - 1 on the state-window graph, which a drafter's
        one-token steps cannot use at all: 0); None when nothing limits it (attention only: truncation)."""
        if model is None or not model.has_recurrent:
            return None
        store = store_for(model, side)
        if store == "window":
            return 0 if side == "drafter" else min(self.window, int(model.state_window) - 1)
        return self.window

    def longest(self) -> int | None:
        """The longest draft both sides undo without a checkpoint; None when no side limits it. Forced checkpoint
        rollback has no bound (every round takes that path anyway)."""
        if self.rollback == "checkpoint":
            return None
        depths = [d for d in (self.depth(self.target, "target"), self.depth(self.drafter, "drafter"))
                  if d is not None]
        return min(depths) if depths else None

    @property
    def k_max(self) -> int:
        """The longest draft adaptive k chooses from: the longest bounded one, or W when nothing bounds it."""
        longest = self.longest()
        return self.window if longest is None else max(1, min(longest, self.window))

    # -- one round --------------------------------------------------------------------------------------------------
    def limit(self, k: int, tctx: Context, dctx: Context | None = None) -> tuple[str, str] | None:
        """None when the live contexts can undo a k-token draft in place (the target a k+1-token verify, the drafter
        k one-token steps); else (a warning key, the warning naming the setting that would allow it)."""
        if self.rollback == "checkpoint":
            return ("forced", "rollback=checkpoint: every round copies and restores the state (the baseline)")
        for ctx, side in ((tctx, "target"), (dctx, "drafter")):
            if ctx is None or ctx.recurrent is None:
                continue
            if side == "drafter" and ctx.mode == "window":
                return ("drafter-window", "a drafter on the state-window graph cannot undo its one-token draft "
                                          "steps: every round takes the checkpoint path (load the drafter with "
                                          "role='drafter')")
            if side == "target" and ctx.mode not in ("replay", "window"):
                return ("replay", f"{ctx.model.folder} has no replay graph: every round takes the checkpoint path "
                                  "(re-export it with this snapspec to enable bounded rollback)")
            depth = min(ctx.depth, self.window)
            if k > depth:
                return ("window", f"draft length {k} exceeds the rollback window {depth}: such rounds take the "
                                  "checkpoint path (re-export with a larger --rollback-window)")
        return None
