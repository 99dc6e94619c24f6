"""The multi-token-prediction (MTP) draft head of Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints -> `mtp.onnx`.

One head step at position p (docs/mtp.md): h_p is the target's hidden state at p after its final norm, t the token
after p;

    x   = mtp.fc(concat[rms(embed(t)) * (1 + w_e), rms(h_p) * (1 + w_h)])     embedding first, then the hidden
    x   = one full-attention decoder layer (mtp.layers.0, the target's own block builders) at rotary position p,
          with the head's own KV cache
    out = rms(x) * (1 + mtp.norm);  logits = lm_head(out)                      predicts the token two after p

The graph reuses the target's builders (attention, SwiGLU or MoE, residual stack, embedding, output projection), so
it rounds, quantizes and lays out its KV cache as the target's full-attention layers do. Its weights go into the
target's data file, and the initializers it shares with the target (the embedding table, the output projection, the
rotary tables) are not written again: the head's graph points at the target's bytes (`SharedGraph`), so they are
stored once on disk. The target's graphs gain a `hidden` output (`HiddenDecoder`) only when a head is exported; a
model without one exports exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import onnx

from snapspec import SnapspecError

import numpy as np
from onnx import TensorProto

from . import lazy
from .arch.common import lm_head, residual_stack
from .blocks import Decoder, StateEntry
from .checkpoint import Checkpoint
from .graph import Graph
from .weights import Weights

FILE = "mtp.onnx"
GRAPH = "mtp"
PREFIXES = ("mtp.", "model.mtp.")
# Initializer scopes whose tensors the head reads exactly as the target does: names equal in both graphs.
SHARED_SCOPES = ("/model/embed_tokens/", "/lm_head/", "/model/rotary_emb/")
KV_NAMES = {"past_key_values.0.key": "past_key_values.mtp.key", "past_key_values.0.value": "past_key_values.mtp.value",
            "present.0.key": "present_key_values.mtp.key", "present.0.value": "present_key_values.mtp.value"}


def prefix(ckpt: Checkpoint) -> str | None:
    """The name prefix of the checkpoint's MTP tensors (`mtp.`, or `model.mtp.`), None without a head."""
    names = ckpt.names()
    return next((p for p in PREFIXES if any(n.startswith(p) for n in names)), None)


def wanted(module, ckpt: Checkpoint, asked: bool) -> bool:
    """Whether this export writes a head: asked for (no --no-mtp), the architecture builds one, and the checkpoint
    has `mtp.*` tensors. A config asking for more than one MTP layer is refused (one is what published checkpoints
    carry and what the runtime drafts with)."""
    if not asked or not hasattr(module, "mtp_layer") or prefix(ckpt) is None:
        return False
    cfg = ckpt.config.get("text_config", ckpt.config)
    layers = int(cfg.get("mtp_num_hidden_layers", 1))
    if layers != 1:
        raise SnapspecError(f"{ckpt.folder / 'config.json'} asks for {layers} MTP layers; snapspec exports a head of "
                            "one layer (pass --no-mtp to export without it)")
    return True


def quant_for(ckpt: Checkpoint, head_wanted: bool, asked: str, dtype: str, quant: str) -> str | None:
    """The MTP head's own quantization (None: the target's). auto: int4 over a float32 target without --quant (the
    CPU path, where a head step costs its weight bytes: docs/mtp.md#an-int4-head-over-a-float-target), else the
    target's. --mtp-quant int4 without a head to apply it to is refused."""
    if asked not in ("auto", "same", "int4"):
        raise SnapspecError(f"unsupported MTP head quantization {asked!r}: use auto, same or int4")
    if asked == "int4" and not head_wanted:
        raise SnapspecError(f"--mtp-quant: {ckpt.folder} is exported without an MTP head (--no-mtp, or no mtp.* "
                            "weights)")
    if asked == "auto":
        asked = "int4" if dtype == "float32" and quant == "none" else "same"
    return None if asked == "same" or not head_wanted else asked


class HiddenDecoder(Decoder):
    """The target's Decoder with one more output, `hidden` [batch, sequence, hidden]: the post-final-norm hidden
    state of every input row, whatever `logits_to_keep` keeps (a prefill fills the head's KV cache from all of its
    rows). It is its own norm over the unsliced rows: the logits path is the same graph as without a head."""

    def final_norm(self, y: str, h: str, gamma, eps: float) -> str:
        g = self.fwd
        with g.scope("model/norm_all_rows"):
            full, _ = g.skip_rms_norm(y, h, gamma, eps, "norm")
        g.output(full, "hidden", g.onnx_dtype, ["batch", "sequence", int(gamma.shape[0])])
        return super().final_norm(y, h, gamma, eps)


class SharedGraph(Graph):
    """A Graph writing into the target's data file whose external initializers under SHARED_SCOPES are the target's
    own (same name, same bytes): const() hands back the target's TensorProto, which points at the same offset,
    instead of appending the values again (small inline constants are simply made again). Shapes and element types are checked: a difference is a bug, not a fallback."""

    def __init__(self, target: Graph, name: str, quant: str | None = None):
        super().__init__(name, "float16" if target.np_dtype.itemsize == 2 else "float32", quant or target.quant,
                         target.block_size, data=target.data, accuracy_level=target.accuracy_level)
        self.shared = {t.name: t for t in target.initializers
                       if t.name.startswith(SHARED_SCOPES) and t.data_location == onnx.TensorProto.EXTERNAL}
        self.reused: list[str] = []

    def const(self, leaf: str, value, keep_dtype: bool = False) -> str:
        name = self._path(leaf)
        proto = self.shared.get(name)
        if proto is None or name in self._used:
            return super().const(leaf, value, keep_dtype)
        if tuple(proto.dims) != tuple(value.shape):
            raise SnapspecError(f"internal error: the MTP head's {name} has shape {tuple(value.shape)}, the target's "
                                f"{tuple(proto.dims)}")
        self._used.add(name)
        copy = onnx.TensorProto()
        copy.CopyFrom(proto)
        self.initializers.append(copy)
        self.reused.append(name)
        return name


@dataclass
class Head:
    """The built head: its decoder (graph and state table) and the manifest's `mtp` section."""

    dec: Decoder
    draft_vocab: int  # the ids its output projection scores (the full vocabulary, or a subset: draft_vocab.py)
    quant: str  # its own linears' quantization: the target's, or int4 over a float target (--mtp-quant int4)
    layer: int  # the head's layer index in the state table: the target's layer count (vLLM numbers it so too)
    bytes: int  # the head's own weights in the data file (shared initializers not counted)

    def manifest(self, hidden: int) -> dict:
        # bytes: the head's own weights; shared: the target's initializers it reads (stored once)
        return {"graph": GRAPH, "layers": 1, "hidden_size": hidden, "state": self.dec.table()["state"],
                "bytes": self.bytes, "shared": sorted(self.dec.fwd.reused), "draft_vocab": self.draft_vocab,
                "quant": self.quant, "block_size": self.dec.fwd.block_size if self.quant == "int4" else None}

    def graph_entry(self) -> dict:
        g = self.dec.fwd
        return {"file": FILE, "inputs": [i.name for i in g.inputs], "outputs": [o.name for o in g.outputs],
                "logits_to_keep": True, "spare_kv_row": True}


def build(module, target: Decoder, weights: Weights, spec, ckpt: Checkpoint, max_context: int,
          draft_ids: np.ndarray | None = None, quant: str | None = None) -> Head:
    """Build the head graph beside the built target (its data file still open). `weights` is the target's checked
    view: the head's tensors are marked read there, so they are neither reported as skipped nor left unread.
    draft_ids: the sorted ids of a draft vocabulary smaller than the target's (export/draft_vocab.py), None for all.
    quant: "int4" quantizes the head's own linears (fc, its layer, and its own int4 copy of the output projection)
    over a float target, whose embedding it still reads as stored (a draft's precision never changes the output:
    the target verifies it); None: the target's quantization, the projection shared."""
    hp = prefix(ckpt)
    hw = Weights(ckpt, hp)
    start = target.fwd.data.size if target.fwd.data is not None else 0
    g = SharedGraph(target.fwd, GRAPH, quant)
    own_quant = g.quant != target.fwd.quant
    # With its own quantization the head gathers the target's embedding table as the target stored it (shared).
    embedding = target.embedding_storage if own_quant else target.embedding_dtype
    dec = Decoder(g, Graph("mtp_replay", target.dtype_name), embedding_dtype=embedding)
    D, eps = spec.hidden, spec.eps
    dec.token_inputs()
    hidden = g.input("hidden", g.onnx_dtype, ["batch", "sequence", D])
    # Read exactly as the target read them, so that SharedGraph finds the same initializers.
    e = dec.embed(weights.get("embed_tokens.weight", (spec.vocab, D)))
    rotary = dec.rotary_cache(spec.rotary_dim, spec.rope_theta, max_context)
    with g.scope("mtp"):
        en = g.rms_norm(e, 1.0 + hw.get("pre_fc_norm_embedding.weight", (D,)), eps, "pre_fc_norm_embedding")
        hn = g.rms_norm(hidden, 1.0 + hw.get("pre_fc_norm_hidden.weight", (D,)), eps, "pre_fc_norm_hidden")
        x = g.linear(g.op("Concat", [en, hn], "concat", axis=-1), hw.get("fc.weight", (D, 2 * D)), "fc")
    s = replace(spec, layers=1, layer_types=("full_attention",), prefix=hp)
    mixer, ffn = module.mtp_layer(dec, hw, s, rotary)
    out = residual_stack(dec, x, 1, eps, lambda i: 1.0 + hw.get("layers.0.input_layernorm.weight", (D,)),
                         lambda i: 1.0 + hw.get("layers.0.post_attention_layernorm.weight", (D,)), mixer, ffn,
                         1.0 + hw.get("norm.weight", (D,)))
    g.output(out, "hidden_out", g.onnx_dtype, ["batch", "kept", D])
    table = lm_head(weights, spec.vocab, D, spec.prefix)
    if draft_ids is None or len(draft_ids) >= spec.vocab:
        dec.logits(out, table)
    else:
        _draft_logits(g, out, table, np.asarray(draft_ids, dtype=np.int64))
    _rename_kv(dec, spec.layers)
    unread = [n for n in ckpt.names() if n.startswith(hp) and n not in hw.used]
    if unread:
        more = f" (and {len(unread) - 5} more)" if len(unread) > 5 else ""
        raise SnapspecError(f"checkpoint has MTP tensors this exporter does not understand: {', '.join(unread[:5])}"
                            f"{more} (pass --no-mtp to export without the head)")
    weights.used |= hw.used
    end = target.fwd.data.size if target.fwd.data is not None else 0
    n = spec.vocab if draft_ids is None else min(len(draft_ids), spec.vocab)
    return Head(dec, n, g.quant, spec.layers, end - start)


def _draft_logits(g: Graph, x: str, table, ids: np.ndarray) -> None:
    """The head's outputs over a draft vocabulary: the output projection's rows `ids` only (its own weight, the
    target's rows copied), `next_tokens` the best of them as a vocabulary id, and `logits` over the whole vocabulary
    with every id outside the subset at float32's lowest value (finite, so the runtime's checks pass; exp of it is 0,
    so sampling never draws one), the shapes the runtime reads from a full head."""
    vocab, n = int(table.shape[0]), len(ids)
    with g.scope("lm_head_draft"):
        y = g.linear(x, lazy.take(table, ids), "proj")
        if g.onnx_dtype != TensorProto.FLOAT:
            y = g.op("Cast", [y], "Cast", to=TensorProto.FLOAT)
        ids_c = g.ints("draft_ids", ids)
        best = g.op("ArgMax", [y], "ArgMax", axis=-1, keepdims=0, select_last_index=0)
        tokens = g.op("Gather", [ids_c, best], "to_vocab", axis=0)
        lead = g.op("Shape", [y], "Shape", start=0, end=2)  # [batch, kept]
        full = g.op("Concat", [lead, g.ints("vocab", [vocab])], "full_shape", axis=0)
        lowest = g.const("lowest", np.asarray(np.finfo(np.float32).min, dtype=np.float32), keep_dtype=True)
        fill = g.op("Expand", [lowest, full], "fill")
        ids_3d = g.op("Reshape", [ids_c, g.ints("shape_3d", [1, 1, n])], "ids_3d")
        where = g.op("Expand", [ids_3d, g.op("Shape", [y], "rows")], "where")
        logits = g.op("ScatterElements", [fill, where, y], "scatter", axis=-1)
    g.output(tokens, "next_tokens", TensorProto.INT64, ["batch", "kept"])
    g.output(logits, "logits", TensorProto.FLOAT, ["batch", "kept", vocab])


def _rename_kv(dec: Decoder, layer: int) -> None:
    """The head's KV cache under its own names (past_key_values.mtp.*, present_key_values.mtp.*), so that a runtime
    can hold it beside the target's without a clash; the state table says layer = the target's layer count."""
    g = dec.fwd
    for node in g.nodes:
        node.input[:] = [KV_NAMES.get(n, n) for n in node.input]
        node.output[:] = [KV_NAMES.get(n, n) for n in node.output]
    for value in list(g.inputs) + list(g.outputs):
        value.name = KV_NAMES.get(value.name, value.name)
    dec.state = [StateEntry(KV_NAMES[s.name], KV_NAMES[s.output], s.role, layer, s.shape, s.dtype)
                 for s in dec.state]
