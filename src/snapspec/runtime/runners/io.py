"""What a forward graph takes and gives, read once from its session and shared by the runners (a context's, and
the MTP head's on the fixed-address path)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..state import allocate

DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


class GraphIO:
    def __init__(self, session, rollback_data: dict | None = None):
        # logits_to_keep is an overridable initializer (default: every row), which onnxruntime lists apart
        inputs = {i.name for i in session.get_inputs() + session.get_overridable_initializers()}
        self.outputs = {o.name: o for o in session.get_outputs()}
        self.keeps_rows = "logits_to_keep" in inputs  # the graph computes only the kept rows
        self.argmax_in_graph = "next_tokens" in self.outputs
        self._packed = rollback_data or {}

    def shape(self, name: str, t: int, keep: int, batch: int = 1) -> tuple[list[int], type]:
        """A graph output's shape for a call of t tokens keeping `keep` rows (of `batch` sequences: the batched
        graph's), from the graph's own dimensions."""
        o = self.outputs[name]
        sizes = {"batch": batch, "sequence": t, "kept": keep if self.keeps_rows else t,
                 "rollback_rows": min(t, int(self._packed.get("rows") or t))}
        dims = [d if isinstance(d, int) else sizes[d] for d in o.shape]
        return dims, DTYPES[o.type]

    def bind_fixed(self, b, bound: list[str], t: int, keep: int, device: str, pinned: list) -> dict:
        """A fixed-address forward's binding beyond what the caller bound (`bound`: the state's outputs): the kept
        rows, and every other output in a buffer of its own, read back after each replay; returns those buffers.
        logits_to_keep is a shape input read on the host at capture and bound by pointer (see BoundRunner._keep),
        so its value lives in `pinned` as long as the binding; 0 (the default) keeps all rows."""
        if self.keeps_rows and keep < t:
            value = np.array(keep, dtype=np.int64)
            pinned.append(value)
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], value.ctypes.data)
        outs = {}
        for name in self.outputs:
            if name not in bound:
                dims, dt = self.shape(name, t, keep)
                outs[name] = allocate(dims, dt, device, 0)
                b.bind_ortvalue_output(name, outs[name])
        return outs


def outputs_after(binding: ort.IOBinding, first: int) -> list[ort.OrtValue]:
    """The outputs of a run from index `first` on, in binding order. IOBinding.get_outputs() wraps every bound output
    in a Python OrtValue: with 16 sequences' state bound, 800 of them per step, where a batched forward reads only
    the few bound after the state (runners/batched.py)."""
    inner = getattr(binding, "_iobinding", None)  # what onnxruntime's own get_outputs reads (1.31 and 1.32)
    if inner is None:  # another onnxruntime: the same values through the public call, all of them wrapped
        return binding.get_outputs()[first:]
    raw = inner.get_outputs()
    return [ort.OrtValue(raw[i], session=binding._session if raw[i]._is_webgpu_buffer() else None)
            for i in range(first, len(raw))]


def release(binding: ort.IOBinding, names: list[str]) -> None:
    """Drop a kept binding's hold on the outputs onnxruntime allocated for its last run (binding each name afresh,
    unallocated; each call binds them again, on their device, before it runs): the caller's OrtValues keep what it
    still reads. A binding kept for later calls (runners/bound.py, batched.py, the MTP head's) would otherwise hold
    them in the session's arena until its next run, or for good once it is not used again: with up to CACHED bindings
    per batched runner, long-lived blocks scattered among the forward's temporaries, and the arena grew by a region
    whenever a temporary found no free chunk large enough (docs/benchmarks/serving.md, "The arena's growth after
    request 40")."""
    for name in names:
        binding.bind_output(name, "cpu")
