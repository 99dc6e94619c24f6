"""The rollback policy, decided here and nowhere else: which forward graph a model runs, which state store each
context keeps, and whether a k-token draft can be undone without a checkpoint.

One user-facing name, `rollback`, with these values:
- auto: bounded rollback; each side's store follows from its export and role (below);
- replay / window: force the target's recurrent store (window: onnxruntime's state_window graph, CUDA only);
- checkpoint: copy the state before every round and restore it after (the slow baseline, for comparisons).
`--recurrent-rollback` (replay / window) is the old spelling of the two forced values.

The stores, for `auto` (docs/rollback.md has the table of costs):
- attention KV: truncation, always;
- a target's recurrent state: the state-window graph on CUDA when the export has one, else replay;
- a drafter's recurrent state: ring slots (its one-token steps write successive slots), on the forward graph without
  rollback data when the export has one (forward_ring).
A model is loaded for one role (load(role=...): the graph); the Pair says which side each context serves (the
stores), so a model loaded as target can also draft for itself.
"""

from __future__ import annotations

from snapspec import SnapspecError

ROLLBACK = ("auto", "replay", "window", "checkpoint")
LOAD_CHOICES = ("auto", "replay", "window")  # what load() can act on; checkpoint is a per-round choice


def check(rollback: str) -> str:
    if rollback not in ROLLBACK:
        raise SnapspecError(f"unknown rollback {rollback!r}: use {', '.join(ROLLBACK)}")
    return rollback


def graph_for(m, ep: str, role: str, rollback: str) -> str:
    """forward, forward_window or forward_ring: the graph a model of this role runs under this rollback."""
    check(rollback)
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
    if rollback in ("auto", "checkpoint") and role == "drafter" and m.graph_path("forward_ring") is not None:
        return "forward_ring"
    return "forward"


def stores_for(model, side: str | None = None) -> str:
    """The recurrent store of a context over `model`: window on the state-window graph, replay for a target that
    has the replay graph, ring otherwise (a drafter, or an export without replay). side: the context's side of the
    pair (default: the role the model was loaded for); one Model can serve both sides."""
    if model.state_window is not None:
        return "window"
    return "replay" if (side or model.role) == "target" and model.replay is not None else "ring"


def undo_depth(model) -> int | None:
    """The longest draft a model's bounded rollback undoes: its export's rollback window W (the state-window graph
    keeps W states, so it undoes W - 1). None when nothing limits it (attention only: truncation undoes any length)."""
    window = model.manifest.rollback.get("window")
    if not model.has_recurrent or not window:
        return None
    return int(window) - (1 if model.state_window is not None else 0)


def undo_limit(ctx, k: int, side: str, depth: int | None = None) -> tuple[str, str] | None:
    """None when a context can undo a (k+1)-token verify (target) or k one-token draft steps (drafter) in place;
    else (a warning key, the warning naming the setting that would allow it). depth: the deepest rollback allowed
    (default: the context's)."""
    if ctx.recurrent is None:
        return None
    if side == "drafter" and ctx.mode == "window":
        return ("drafter-window", "a drafter on the state-window graph cannot undo its one-token draft steps: every "
                                  "round takes the checkpoint path (load the drafter with role='drafter')")
    depth = ctx.depth if depth is None else depth
    if k > depth:
        return ("window", f"draft length {k} exceeds the rollback window {depth}: such rounds take the "
                          "checkpoint path (re-export with a larger --rollback-window)")
    if side == "target" and ctx.mode not in ("replay", "window"):
        return ("replay", f"{ctx.model.folder} has no replay graph: every round takes the checkpoint path (re-export "
                          "it with this snapspec to enable bounded rollback)")
    return None
