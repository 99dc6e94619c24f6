"""Load an exported folder: verify the manifest, open ONNX Runtime sessions on the requested provider, say which
providers actually run the graph. Loading never executes code from the folder: JSON, ONNX and tokenizer.json only.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from snapspec import SnapspecError, manifest

from . import exactness, genai_folder, hugepages, standard_ops
from .cpu_load import spinning_pays
from .cuda_graph import GraphSession
from .providers import DEVICE, PROVIDERS, configure
from .policy import graph_for


log = logging.getLogger("snapspec")


@dataclass
class Model:
    """An exported folder opened on one execution provider."""

    manifest: manifest.Manifest
    ep: str
    session: ort.InferenceSession
    replay: ort.InferenceSession | None
    tokenizer: object
    threads: int | None = None
    requested_ep: str = "cpu"
    state_window: int | None = None  # W when the session runs the state-window graph (conv/recurrent state [W, ...])
    notes: list[str] = field(default_factory=list)
    graph_tokens: int = 0  # forwards of up to this many tokens replay CUDA graphs (0: none; runtime/cuda_graph.py)
    graphs: GraphSession | None = None
    role: str = "target"  # target or drafter, as loaded: the graph it runs (policy.graph_for)
    # load(share_head=True): the initializers shared with the folder's MTP head, as the OrtValues this session
    # holds; runtime/head.load_head hands the same ones to the head's session (kept alive here)
    shared_values: dict = field(default_factory=dict)
    spin: bool = False  # whether the forward session's threads spin between runs (load's `spin`, resolved)

    @property
    def folder(self) -> Path:
        return self.manifest.folder

    @property
    def device(self) -> str:
        return DEVICE[self.ep]

    @property
    def vocab_size(self) -> int:
        return int(self.manifest.model["vocab_size"])

    @property
    def eos_ids(self) -> list[int]:
        return list(self.manifest.tokens.get("eos_token_ids") or [])

    @property
    def has_recurrent(self) -> bool:
        return any(s["role"] in manifest.RECURRENT_ROLES for s in self.manifest.state)

    def position_ids(self, start: int, t: int) -> np.ndarray | None:
        """The forward's position_ids for t tokens from start: [1, T], or [R, 1, T] for a graph that takes R rows
        (an onnxruntime-genai Qwen3.5: multimodal RoPE, text positions in every row), None for a graph without
        the input (an onnxruntime-genai LFM2)."""
        rows = self.manifest.data["graphs"]["forward"].get("position_rows", 1)
        pos = np.arange(start, start + t, dtype=np.int64)[None]
        return None if rows == 0 else pos if rows == 1 else np.ascontiguousarray(np.broadcast_to(pos, (rows, 1, t)))

    def providers_used(self) -> list[str]:
        return self.session.get_providers()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def load(folder, ep: str = "cpu", *, allow_fallback: bool = False, threads: int | None = None,
         verify: bool = True, spin: bool | str = "auto", role: str = "target", rollback: str = "auto",
         cuda_graph: int = 0, share_head: bool = False) -> Model:
    """Open an exported folder on `ep` for a role (target or drafter).

    rollback: which forward graph carries the recurrent state (policy.graph_for decides; checkpoint is a
    per-generation choice and is refused here). auto: the state-window
    graph for a target on CUDA when the export has one (rollback picks a state; measured faster than replay there,
    docs/benchmarks/cuda-h200.md), else the forward graph with replay (target), or for a drafter, which rolls back
    by ring slots, the forward graph without the replay's rollback data when the export has it
    (src/snapspec/export/ring.py). replay / window force one.
    share_head: for a folder with an MTP head, give this session the initializers the head shares (embedding,
    output projection, rotary tables) as OrtValues made once, which runtime/head.load_head then gives the head's
    session: one copy for both on CUDA; on CPU it costs memory (runtime/head.py, docs/benchmarks/mtp.md).

    spin: let the forward session's threads spin between runs, which suits back-to-back target steps; "auto" (the
    default) spins only where the machine has an idle core for each of its threads (spinning_pays). Load a
    drafter with spin=False: every session owns a thread pool, and an idle pool that spins steals the cores the
    running one needs (pair-a on 2 cores: speculation ran at 0.75x of plain with every pool spinning, 1.5x with only
    the target's). Replay sessions never spin.
    """
    m = genai_folder.read_manifest(folder, verify)  # snapspec.json, or derived from an onnxruntime-genai folder
    spin = spinning_pays(threads) if spin == "auto" else bool(spin)
    opts = _options(threads, spin)
    # With graphs, every session of the model runs on snapspec's stream: replays are queued, not waited for.
    used_ep, providers = configure(ep, opts, allow_fallback, cuda_graph=cuda_graph > 0, shared_stream=cuda_graph > 0)
    if used_ep == "cuda":
        _check_cuda_support(m)
    if cuda_graph and used_ep != "cuda":
        raise SnapspecError(f"CUDA graphs (--cuda-graph) need the CUDA execution provider, not {used_ep}")
    if cuda_graph and genai_folder.is_builder(m):
        raise SnapspecError("CUDA graphs need a snapspec export (an onnxruntime-genai folder's inputs differ)")
    if role not in ("target", "drafter"):
        raise SnapspecError(f"role must be target or drafter, got {role!r}")
    graph = graph_for(m, used_ep, role, rollback)
    shared = {}
    if share_head:
        from .head import shared_values
        shared = shared_values(m, used_ep)
        for name, value in shared.items():
            opts.add_initializer(name, value)
    source, notes = m.graph_path(graph), []
    if used_ep == "cpu" and not genai_folder.is_builder(m):
        notes.append(exactness.experts_note(source, who=f"{m.folder.name}: "))
    if used_ep == "cpu" and m.data["export"].get("quant") == "int4":
        source, note = exactness.load_graph(source, opts, threads, who=f"{m.folder.name}: ")
        notes.append(note)
    session = _session(source, opts, providers, name=m.graph_path(graph))
    if used_ep != "cpu" and PROVIDERS[used_ep] not in session.get_providers():
        # onnxruntime drops a provider whose libraries or driver fail to load and runs on CPU without a word.
        raise SnapspecError(f"onnxruntime could not start the {used_ep} execution provider (its libraries or driver "
                            f"did not load; the session got {', '.join(session.get_providers())}); run `snapspec "
                            "doctor`, or use --ep cpu")
    replay, replay_path = None, m.graph_path("replay") if graph == "forward" else None
    if replay_path is not None:
        replay_opts = _options(threads, spin=False)
        _, replay_providers = configure(used_ep, replay_opts, allow_fallback,  # a plugin EP adds its device here
                                        shared_stream=cuda_graph > 0 and used_ep == "cuda")
        replay = _session(replay_path, replay_opts, replay_providers)
    if used_ep == "cpu":
        hugepages.advise()  # the weights just pre-packed: huge pages for the TLB (runtime/hugepages.py)
    tok_path = m.folder / "tokenizer.json"
    if not tok_path.exists():
        raise SnapspecError(f"{m.folder} has no tokenizer.json")
    from tokenizers import Tokenizer
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # the tokenizers library raises a bare Exception on a malformed file
        raise SnapspecError(f"cannot read {tok_path}: {exc}") from None
    model = Model(m, used_ep, session, replay, tokenizer, threads, requested_ep=ep,
                  state_window=m.rollback.get("state_window") if graph == "forward_window" else None,
                  graph_tokens=cuda_graph, graphs=GraphSession(session) if cuda_graph else None, role=role,
                  shared_values=shared, spin=spin)
    model.notes += [n for n in notes if n]
    if used_ep != ep:
        model.notes.append(f"requested {ep}, running on {used_ep} (--allow-fallback)")
    if genai_folder.is_builder(m):
        model.notes.append(genai_folder.note(m))
        log.warning(model.notes[-1])
    return model


def open_like(model: Model, graph: bytes, path: Path, weights: dict | None = None,
              spin: bool | None = None, cuda_graph: bool = False) -> ort.InferenceSession:
    """A session on another form of a model's graph (its bytes, whose weights lie beside `path`, or are given as
    {name: OrtValue} in `weights`, shared), on the model's provider with the forward session's options (spin: whether
    its threads spin between runs, default the model's): the scheduler's graphs for several sequences (scheduler.py;
    the MTP head's runs between the target's forwards, and does not spin, as load_head's session). cuda_graph: on
    CUDA, the session captures and replays CUDA graphs, on snapspec's stream (runners/batched_captured.py)."""
    opts = _options(model.threads, model.spin if spin is None else spin)
    for name, value in (weights or {}).items():
        opts.add_initializer(name, value)
    opts.add_session_config_entry(exactness.EXTERNAL_FOLDER, str(Path(path).parent))
    _, providers = configure(model.ep, opts, False, cuda_graph=cuda_graph, shared_stream=cuda_graph)
    return _session(graph, opts, providers, name=Path(path))


def _options(threads: int | None, spin: bool) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Memory patterns are cached per input shape, and the attention mask has a new shape at every position: with
    # them on, resident memory grows ~6 KB per position decoded (tests/runtime/test_long_run.py), at no gain in speed.
    opts.enable_mem_pattern = False
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return opts


def _session(source, opts: ort.SessionOptions, providers: list[str] | None,
             name: Path | None = None) -> ort.InferenceSession:
    """A session on a graph file, or on a graph's bytes (exactness.load_graph's rewrite; `name` is its file). A CPU
    session's weights go on huge pages as pre-packing writes them (hugepages.while_loading)."""
    path = Path(name or source)
    source = source if isinstance(source, bytes) else str(source)
    cpu = providers == [PROVIDERS["cpu"]]
    if cpu:  # the slow contrib kernels as standard ops (runtime/standard_ops.py)
        source = standard_ops.for_cpu(source, path, opts)
        # nodes in the graph's order: onnxruntime's default order ran independent branches first and kept their
        # results alive (the Qwen3.5-0.8B shape's 512-token prefill peaked at 1,675 MiB, 1,024 MiB in this order)
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    try:
        with hugepages.while_loading() if cpu else contextlib.nullcontext():
            if providers is None:  # a plugin EP device was added to the options
                return ort.InferenceSession(source, opts)
            return ort.InferenceSession(source, opts, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types for corrupt or truncated graphs
        msg = str(exc).splitlines()[0].split(" : FAIL : ")[-1].strip()[:500]
        raise SnapspecError(f"onnxruntime cannot load {path.name} from {path.parent}: {msg}") from None


def _check_cuda_support(m: manifest.Manifest) -> None:
    """What onnxruntime-gpu 1.31 can run, measured on an H200: refuse the rest instead of running it wrongly.

    GroupQueryAttention has no float32 CUDA kernel: the node falls back to CPU, its shared KV buffer is copied
    around it and multi-token forwards stop matching one-token steps (drafter == target accepted 0.2-0.7). fp16
    exports run; their gated delta rule is computed in float32 (the CUDA kernel wants state and activations in one
    dtype, and the state is float32). Exports made before that (fp16 activations into a float32 state) are refused.
    """
    if m.data["export"].get("embedding_dtype") == "int4":
        # Measured on an H200 (docs/benchmarks/cuda-h200.md, "Greedy drafts chained on the device"): pair-a
        # exported with the int4
        # GatherBlockQuantized embedding ran without error and produced degenerate text (acceptance 0.05-0.1
        # instead of 0.86); the same export with an fp16 table matched its CPU results.
        raise SnapspecError("int4-embedding exports (GatherBlockQuantized) give wrong results on onnxruntime-gpu "
                            "1.31's CUDA provider; re-export with --embedding-dtype fp16 for CUDA")
    dtype = m.data["export"]["dtype"]
    has_attention = any(s["role"].startswith("kv") for s in m.state)
    if dtype == "float32" and has_attention:
        raise SnapspecError("the CUDA execution provider has no float32 GroupQueryAttention kernel; re-export with "
                            "--dtype fp16 for CUDA, or use --ep cpu / --ep webgpu")
    mixed = any(s["role"] == "recurrent" and s["dtype"] != dtype for s in m.state)
    if dtype == "float16" and mixed and not _float32_rule(m):
        raise SnapspecError(f"{m.folder} feeds float16 activations to a float32 recurrent state, which the CUDA "
                            "kernel refuses; re-export it with this snapspec version")


def _float32_rule(m: manifest.Manifest) -> bool:
    """Whether the export computes the gated delta rule in float32 (its manifest says so; older exports did not)."""
    return bool(m.data["export"].get("float32_linear_attention"))
