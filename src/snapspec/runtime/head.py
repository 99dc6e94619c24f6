"""Open an exported folder's MTP draft head (`mtp.onnx`, export/mtp.py) beside its loaded target.

    head = load_head(model)          # model: runtime.model.load(folder) of a folder exported with a head
    head.session.run(...)            # inputs/outputs: head.inputs, head.outputs; its KV: head.state

The head's graph reads the embedding table, the output projection and the rotary tables from the target's data file
at the target's offsets (stored once on disk). In memory, onnxruntime maps or loads each session's initializers
itself; see `load_head`'s `share` for what sharing them across the two sessions does and costs (docs/mtp.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from snapspec import SnapspecError, manifest

from .providers import configure

NO_HEAD = "{folder} has no MTP head: export a checkpoint with mtp.* weights (without --no-mtp)"


@dataclass
class Head:
    """The head's session and what the manifest says about it (its `mtp` section and graph entry)."""

    session: ort.InferenceSession
    info: dict  # manifest data["mtp"]: graph, layers, hidden_size, state, bytes, shared
    graph: dict  # manifest data["graphs"]["mtp"]: file, inputs, outputs
    shared: list[str] = field(default_factory=list)  # initializers handed to the session as shared OrtValues
    values: list = field(default_factory=list, repr=False)  # their OrtValues, which must outlive the session

    @property
    def state(self) -> list[dict]:
        """The head's KV entries, in the form of the manifest's `state` (name, output, role, layer, shape, dtype)."""
        return self.info["state"]

    @property
    def layers(self) -> int:
        return int(self.info["layers"])

    @property
    def inputs(self) -> list[str]:
        return list(self.graph["inputs"])

    @property
    def outputs(self) -> list[str]:
        return list(self.graph["outputs"])


def has_head(m: manifest.Manifest) -> bool:
    """Whether the folder was exported with an MTP head (older folders have no `mtp` section: no head)."""
    return bool(m.data.get("mtp")) and "mtp" in m.data["graphs"]


def head_info(m: manifest.Manifest) -> dict:
    """The manifest's `mtp` section; a one-line error for a folder without a head."""
    if not has_head(m):
        raise SnapspecError(NO_HEAD.format(folder=m.folder))
    return m.data["mtp"]


def load_head(model, *, threads: int | None = None, share: bool | None = None, cuda_graph: bool = False) -> Head:
    """The MTP head of a loaded target (runtime.model.Model), on the target's execution provider.

    cuda_graph: on CUDA, a session that captures and replays CUDA graphs on snapspec's stream (the target's, when it
    was loaded with `cuda_graph`), for the head's fixed-address steps (drafters/mtp_chain.py).

    An int4 head on CPU is loaded as load() loads an int4 target (exactness.load_graph): where this CPU's one-row
    MatMulNBits kernel sums in another order than the several-row one, one-row calls run paired, so that every row
    gets the same bits whatever the row count, and the scheduler can run several sequences' head calls in one
    forward exactly (runners/batched_head.py).

    share: give the head's session the initializers it shares with the target (embedding, output projection,
    rotary tables) as OrtValues made once (SessionOptions.add_initializer, `shared_values`). Default: share exactly
    when the target was loaded with `load(..., share_head=True)`, whose session holds the same OrtValues, so that
    both sessions read one copy. On CPU that costs memory instead of saving it (pair-a fp32: +28 MB RSS over the
    unshared head, int4: +11 MB; docs/benchmarks/mtp.md): onnxruntime pre-packs a MatMul weight per session, and
    the shared buffer stays alive beside each packed copy (its pre-packed weights container, which would share the
    packed copies, is not reachable from Python). It is meant for CUDA, where nothing is pre-packed and each
    session would otherwise hold its own device copy of the output projection (1.2 GB at the 4B shape in fp16);
    not yet measured there.
    """
    m = model.manifest
    info = head_info(m)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    opts.enable_mem_pattern = False  # a new attention-mask shape at every position, as the target's (model.py)
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    threads = threads if threads is not None else getattr(model, "threads", None)
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    # The head runs between the target's forwards: its pool must not spin while the target's runs.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    ep = getattr(model, "ep", "cpu")
    values = getattr(model, "shared_values", None)
    if share is None:
        share = bool(values)
    if share and not values:
        values = shared_values(m, ep)
    values = values if share else {}
    for name, value in values.items():
        opts.add_initializer(name, value)
    graphs = cuda_graph and ep == "cuda"
    _, providers = configure(ep, opts, allow_fallback=False, cuda_graph=graphs, shared_stream=graphs)
    path = m.graph_path("mtp")
    source = str(path)
    if ep == "cpu" and int4_head(m):  # rows paired where this CPU's one-row kernel differs, as the target's
        from .exactness import load_graph
        source, _ = load_graph(path, opts, threads, who=f"{m.folder.name} MTP head: ")
    if ep == "cpu":  # its attention as grouped MatMuls where that pays (grouped_attention.py), as the target's
        from .standard_ops import for_cpu
        source = for_cpu(source, path, opts)
    try:
        session = (ort.InferenceSession(source, opts) if providers is None
                   else ort.InferenceSession(source, opts, providers=providers))
    except Exception as exc:  # onnxruntime raises its own exception types for corrupt or truncated graphs
        msg = str(exc).splitlines()[0].split(" : FAIL : ")[-1].strip()[:500]
        raise SnapspecError(f"onnxruntime cannot load {path.name} from {path.parent}: {msg}") from None
    names = sorted(values)
    return Head(session, info, m.data["graphs"]["mtp"], names, [values[n] for n in names])


def int4_head(m: manifest.Manifest) -> bool:
    """Whether the head's linears are int4 (an int4 export's head, or --mtp-quant int4 over a float target)."""
    return "int4" in (m.data["export"].get("quant"), head_info(m).get("quant"))


def shared_values(m: manifest.Manifest, ep: str = "cpu", *, copy: bool | None = None) -> dict[str, ort.OrtValue]:
    """{name: OrtValue} of the external initializers the head shares with the target (the manifest's mtp.shared),
    made once, to hand to both sessions (SessionOptions.add_initializer): see external_values. The caller keeps them
    alive as long as the sessions (runtime.model.Model.shared_values holds them). Empty for a folder without a
    head."""
    if not has_head(m):
        return {}
    return external_values(m, "mtp", set(m.data["mtp"].get("shared", [])), ep, copy=copy)


def external_values(m: manifest.Manifest, graph: str, names: set[str] | None = None, ep: str = "cpu", *,
                    copy: bool | None = None) -> dict[str, ort.OrtValue]:
    """{name: OrtValue} of a graph's external initializers (those in `names`, default all), to hand to several
    sessions (SessionOptions.add_initializer) that then hold one copy between them: on the CPU, views of one
    read-only memory map of the data file; under CUDA, one device copy each (device 0; `copy`, the default there,
    also on the CPU for tests). Used for the head's shared tensors and the scheduler's graphs for B sequences."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    source = onnx.load(str(m.graph_path(graph)), load_external_data=False).graph
    maps: dict[str, np.memmap] = {}
    values = {}
    for t in source.initializer:
        if (names is not None and t.name not in names) or t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        ext = {e.key: e.value for e in t.external_data}
        path = str(m.folder / ext["location"])
        if path not in maps:
            maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        offset = int(ext.get("offset", 0))
        arr = maps[path][offset:offset + int(ext["length"])].view(tensor_dtype_to_np_dtype(t.data_type))
        arr = arr.reshape(tuple(t.dims))
        on_device = ep == "cuda" if copy is None else copy
        values[t.name] = (_copy(arr, "cuda" if ep == "cuda" else "cpu") if on_device
                          else ort.OrtValue.ortvalue_from_numpy(arr))
    return values


def _copy(arr: np.ndarray, device: str) -> ort.OrtValue:
    """arr copied into a buffer on `device`, as an OrtValue that add_initializer accepts. onnxruntime takes only an
    initializer whose buffer the caller owns, and an OrtValue it allocated (any device copy) owns its buffer; a DLPack
    view of that OrtValue does not, and keeps it alive (its capsule holds it), so the view is what is handed out. A
    session uses a shared initializer as is only when it lies on the device the session planned for it (else it
    makes its own copy): device copies for CUDA sessions, host memory for CPU ones."""
    owner = ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), arr.dtype, device, 0)
    owner.update_inplace(np.ascontiguousarray(arr))
    view = ort.OrtValue.from_dlpack(owner._ortvalue.to_dlpack())
    view.owner = owner  # explicit, whatever the capsule does
    return view
