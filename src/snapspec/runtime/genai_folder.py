"""Folders made by onnxruntime-genai's model builder: genai_config.json and model.onnx, no snapspec manifest.

The builder's graph keeps its state explicit, as snapspec's does: GroupQueryAttention KV that can share one
past/present buffer, and conv and recurrent state as inputs and outputs. So the runtime can carry it between calls
once a manifest is derived here, from genai_config.json's name templates and the graph's declared inputs and outputs.
Layouts are taken from the graph as they are (the builder keeps conv state as [B, C, K-1], snapspec as [B, K-1, C]);
the runtime only moves the buffers. What such a folder lacks: the per-token rollback data a replay needs (a target
rolls back by checkpoint: copy, restore, re-decode; a drafter's one-token steps fill ring slots, which needs nothing
from the graph) and checksums (nothing verifies the files). The graph is read at the protobuf wire level, like the
manifest's external-data scan, so the runtime needs no onnx package; nothing from the folder is executed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from snapspec import SnapspecError, manifest

CONFIG = "genai_config.json"
FORMAT = "onnxruntime-genai"
WINDOW = 8  # the rollback window a snapspec export defaults to: the ring depth when such a folder drafts
_DTYPES = {1: "float32", 10: "float16"}  # TensorProto.DataType values the state store allocates
_ROLES = {"key": "kv_key", "value": "kv_value", "conv": "conv", "recurrent": "recurrent"}
_FED = ("input_ids", "attention_mask", "position_ids")  # inputs the context binds itself


def read_manifest(folder, verify: bool = True) -> manifest.Manifest:
    """The folder's manifest: snapspec.json when present, else one derived from an onnxruntime-genai folder."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / manifest.FILENAME).exists():
        return manifest.load(folder, verify=verify)
    if not (folder / CONFIG).exists():
        raise SnapspecError(f"{folder} is not a snapspec exported folder (no {manifest.FILENAME}) nor an "
                            f"onnxruntime-genai builder folder (no {CONFIG}); run `snapspec export` first")
    return read(folder)


def is_builder(m: manifest.Manifest) -> bool:
    return m.data.get("format") == FORMAT


def note(m: manifest.Manifest) -> str:
    """The one line a run prints about such a folder."""
    if not any(s["role"] in ("conv", "recurrent") for s in m.state):
        rollback = "truncate (attention only)"
    else:
        rollback = "checkpoint as a target (the graph has no rollback_data output to replay), ring slots as a drafter"
    return f"{m.folder}: onnxruntime-genai builder folder, unverified: no snapspec manifest; rollback: {rollback}"


def read(folder: Path) -> manifest.Manifest:
    config = _config(folder)
    model, decoder = config["model"], config["model"]["decoder"]
    graph = _graph_file(folder, decoder)
    inputs, outputs, ops, rotary_in_attention = _graph_io(graph)
    if "input_ids" not in inputs or "attention_mask" not in inputs or "logits" not in outputs:
        raise SnapspecError(f"{graph} must take input_ids and attention_mask and return logits (a builder folder "
                            "made with exclude_embeds, exclude_lm_head or paged attention is not supported)")
    state = _state_table(graph, decoder, inputs, outputs)
    if any(s["role"].startswith("kv") for s in state) and "GroupQueryAttention" not in ops:
        raise SnapspecError(f"{graph}: attention is not GroupQueryAttention, which snapspec's shared past/present "
                            "KV buffer needs")
    odd = sorted({s["shape"][3] for s in state if s["role"] == "kv_key" and s["shape"][3] % 16})
    if rotary_in_attention and odd:
        raise SnapspecError(f"{graph}: its GroupQueryAttention applies RoPE itself (do_rotary), which onnxruntime's "
                            f"kernel refuses for a head size that is not a multiple of 16 (head size {odd[0]})")
    vocab = outputs["logits"][1][-1] if outputs["logits"][1] else None
    vocab = vocab if isinstance(vocab, int) else model.get("vocab_size")
    if not isinstance(vocab, int) or vocab != model.get("vocab_size", vocab):
        raise SnapspecError(f"{graph} returns logits over {vocab} tokens, {CONFIG} says vocab_size "
                            f"{model.get('vocab_size')}")
    eos = model.get("eos_token_id")
    data = {
        "format": FORMAT,
        "model": {"model_type": model.get("type"), "layers": decoder.get("num_hidden_layers"),
                  "layer_kinds": _layer_kinds(state, decoder.get("num_hidden_layers")),
                  "hidden_size": decoder.get("hidden_size"), "vocab_size": vocab,
                  "max_context": _max_context(config)},
        "tokens": {"eos_token_ids": eos if isinstance(eos, list) else [] if eos is None else [eos],
                   "bos_token_id": model.get("bos_token_id"), "pad_token_id": model.get("pad_token_id")},
        "graphs": {"forward": {"file": decoder["filename"], "inputs": list(inputs), "outputs": list(outputs),
                               "position_rows": _position_rows(graph, inputs)}},
        "state": state,
        "rollback": {"kv": "truncate", "recurrent": "checkpoint", "window": WINDOW},
        "rollback_data": None,
        "export": {"dtype": _DTYPES.get(outputs["logits"][0], "float32"),
                   "quant": "int4" if "MatMulNBits" in ops else "none", "block_size": None, "int4_note": None},
        "files": {},  # no checksums: the folder is taken as it is
    }
    return manifest.Manifest(folder, data)


def _config(folder: Path) -> dict:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        decoder = config["model"]["decoder"]
        if not isinstance(decoder["filename"], str) or not all(isinstance(decoder[k], dict)
                                                                 for k in ("inputs", "outputs")):
            raise TypeError("filename, inputs or outputs")
        return config
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SnapspecError(f"corrupt {path}: {exc}") from None
    except (KeyError, TypeError) as exc:
        raise SnapspecError(f"{path} is not an onnxruntime-genai decoder config (model.decoder: {exc} missing or "
                            "malformed)") from None


def _max_context(config: dict) -> int:
    n = config["model"].get("context_length") or (config.get("search") or {}).get("max_length")
    if not isinstance(n, int) or n < 1:
        raise SnapspecError(f"{CONFIG} gives no context length (model.context_length or search.max_length)")
    return n


def _graph_file(folder: Path, decoder: dict) -> Path:
    root = folder.resolve()
    graph = folder / str(decoder["filename"])
    if root not in graph.resolve().parents:
        raise SnapspecError(f"{CONFIG} in {folder} names a graph outside the folder: {decoder['filename']}")
    if not graph.is_file():
        raise SnapspecError(f"{folder} is missing {decoder['filename']} (named by its {CONFIG})")
    for location in manifest.external_data_locations(graph):
        data = (folder / location).resolve()
        if root not in data.parents or not data.is_file():
            raise SnapspecError(f"{graph.name} in {folder} reads external data from {location!r}, which is not a "
                                "file of the folder; refusing to load it")
    return graph


def _state_table(graph: Path, decoder: dict, inputs: dict, outputs: dict) -> list[dict]:
    """One entry per state input, paired with its output through genai_config's past_*/present_* name templates."""
    state = []
    for name, (dtype, shape) in inputs.items():
        if name in _FED:
            continue
        kind, layer = _match(decoder["inputs"], "past_", name)
        if kind is None:
            raise SnapspecError(f"{graph.name} takes an input snapspec cannot feed: {name} (known: {', '.join(_FED)} "
                                f"and the state named in {CONFIG})")
        template = decoder["outputs"].get(f"present_{kind}_names")
        output = template % layer if template else None
        if output not in outputs or not _same_kind(outputs[output], inputs[name], role=_ROLES[kind]):
            raise SnapspecError(f"{graph.name}: state input {name} has no output of its shape and type ({output})")
        if dtype not in _DTYPES:
            raise SnapspecError(f"{graph.name}: state {name} has element type {dtype}; snapspec keeps state in "
                                "float32 or float16 (a quantized KV cache is not supported)")
        role = _ROLES[kind]
        state.append({"name": name, "output": output, "role": role, "layer": layer,
                      "shape": _shape(graph, name, shape, role, decoder), "dtype": _DTYPES[dtype]})
    return sorted(state, key=lambda s: (s["layer"], s["role"]))


def _same_kind(a: tuple, b: tuple, role: str) -> bool:
    """Same element type and shape; KV rows excepted (the past has past_sequence_length, the present more)."""
    (ea, sa), (eb, sb) = a, b
    if role.startswith("kv"):
        return ea == eb and len(sa) == len(sb) and sa[:2] == sb[:2] and sa[3:] == sb[3:]
    return a == b


def _match(templates: dict, prefix: str, name: str) -> tuple[str | None, int | None]:
    for key, template in templates.items():
        if key.startswith(prefix) and key.endswith("_names") and "%d" in str(template):
            m = re.fullmatch(re.escape(template).replace("%d", r"(\d+)"), name)
            if m and key[len(prefix):-len("_names")] in _ROLES:
                return key[len(prefix):-len("_names")], int(m.group(1))
    return None, None


def _shape(graph: Path, name: str, shape: list, role: str, decoder: dict) -> list:
    """The state table's shape: "batch", "context" (KV rows) and integers; a KV head size the graph leaves
    symbolic (the builder's kv_cache_dim) is genai_config's head_size."""
    out = ["batch"]
    for i, d in enumerate(shape[1:], start=1):
        if role.startswith("kv") and i == 2:
            out.append("context")
        elif isinstance(d, int) and d > 0:
            out.append(d)
        elif role.startswith("kv") and i == 3 and decoder.get("head_size"):
            out.append(int(decoder["head_size"]))
        else:
            raise SnapspecError(f"{graph.name}: state {name} has a dimension snapspec cannot size: {d!r}")
    if len(shape) < 2 or (role.startswith("kv") and len(out) != 4):
        raise SnapspecError(f"{graph.name}: state {name} has an unexpected shape {shape}")
    return out


def _position_rows(graph: Path, inputs: dict) -> int:
    """0: no position_ids input; 1: [B, T]; R: [R, B, T] (multimodal RoPE, every row the text position)."""
    if "position_ids" not in inputs:
        return 0
    shape = inputs["position_ids"][1]
    if len(shape) == 2:
        return 1
    if len(shape) == 3 and isinstance(shape[0], int):
        return shape[0]
    raise SnapspecError(f"{graph.name}: position_ids of shape {shape} is not one snapspec can feed")


def _layer_kinds(state: list[dict], layers) -> list[str]:
    roles: dict[int, set] = {}
    for s in state:
        roles.setdefault(s["layer"], set()).add(s["role"])
    kinds = {frozenset({"kv_key", "kv_value"}): "attention", frozenset({"conv"}): "short_conv",
             frozenset({"conv", "recurrent"}): "linear_attention"}
    return [kinds.get(frozenset(roles.get(i, ())), "other") for i in range(int(layers or 0))]


# -- graph inputs, outputs and op types, read from the protobuf wire format ---------------------------------------
# Field numbers from onnx.proto: ModelProto.graph 7; GraphProto.node 1, input 11, output 12; NodeProto.op_type 4,
# attribute 5; AttributeProto.name 1, i 3; ValueInfoProto.name 1, type 2; TypeProto.tensor_type 1; Tensor.elem_type 1, shape 2; TensorShapeProto.dim 1;
# Dimension.dim_value 1, dim_param 2.
def _graph_io(path: Path) -> tuple[dict, dict, set, bool]:
    """({input: (elem_type, shape)}, {output: (elem_type, shape)}, op types, whether an attention node applies
    RoPE itself). Shapes hold ints and dim names."""
    try:
        buf = memoryview(path.read_bytes())
        inputs, outputs, ops, rotary = {}, {}, set(), False
        for number, graph in manifest.wire_fields(buf):
            if number != 7:
                continue
            for field, value in manifest.wire_fields(graph):
                if field == 1:
                    op, attrs = _node(value)
                    ops.add(op)
                    rotary |= op == "GroupQueryAttention" and attrs.get("do_rotary") == 1
                elif field in (11, 12):
                    name, tensor = _value_info(value)
                    (inputs if field == 11 else outputs)[name] = tensor
        return inputs, outputs, ops, rotary
    except (IndexError, ValueError, UnicodeDecodeError):
        raise SnapspecError(f"{path} is not a readable ONNX graph (truncated or corrupt)") from None


def _node(buf) -> tuple[str, dict]:
    """(op type, {attribute name: integer value}) of a node."""
    op, attrs = "", {}
    for field, value in manifest.wire_fields(buf):
        if field == 4:
            op = bytes(value).decode()
        elif field == 5:
            parts = dict(manifest.wire_fields(value))
            if 1 in parts and 3 in parts:
                attrs[bytes(parts[1]).decode()] = parts[3]
    return op, attrs


def _value_info(buf) -> tuple[str, tuple[int, list]]:
    name, elem, shape = "", 0, []
    for field, value in manifest.wire_fields(buf):
        if field == 1:
            name = bytes(value).decode()
        elif field == 2:
            for f, tensor in manifest.wire_fields(value):
                if f != 1:
                    continue
                for g, v in manifest.wire_fields(tensor):
                    if g == 1:
                        elem = v
                    elif g == 2:
                        shape = [_dim(d) for h, d in manifest.wire_fields(v) if h == 1]
    return name, (elem, shape)


def _dim(buf):
    for field, value in manifest.wire_fields(buf):
        if field == 1:
            return int(value)
        if field == 2:
            return bytes(value).decode()
    return None
