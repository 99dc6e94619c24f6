"""The context's shape at run time: rows kept, ids in place of vocabulary rows, buffers sized to need, resumed turns.

Graphs with the `logits_to_keep` input and the `next_tokens` argmax output are made here from a tiny export by graph
surgery, where the export has not got them (the contract: an overridable int64 scalar initializer whose default, 0,
keeps every row; next_tokens = argmax of the kept rows), so both the older exports (the host slices and takes the
argmax) and the newer ones are covered.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from snapspec import manifest
from snapspec.runtime import Context, Generator, SamplingParams, load
from snapspec.runtime import Policy
from snapspec.runtime import context as context_mod

ARCHS = ["qwen3_5_text", "qwen3_next", "lfm2", "qwen3"]
PROMPT = "Rolling back the state of a hybrid model"




def with_kept_rows(src, dst):
    """A copy of an exported folder whose forward graph takes logits_to_keep and returns next_tokens."""
    shutil.copytree(src, dst)
    data = json.loads((dst / manifest.FILENAME).read_text())
    if data["graphs"]["forward"].get("logits_to_keep"):
        return dst
    m = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    g = m.graph
    for node in g.node:
        node.output[:] = ["logits_all" if o == "logits" else o for o in node.output]
    vocab = next(o for o in g.output if o.name == "logits").type.tensor_type.shape.dim[2].dim_value
    outputs = [o for o in g.output if o.name != "logits"]
    del g.output[:]
    g.output.extend(outputs + [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "kept", vocab]),
        helper.make_tensor_value_info("next_tokens", TensorProto.INT64, ["batch", "kept"])])
    g.input.append(helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, []))
    g.initializer.extend([helper.make_tensor("logits_to_keep", TensorProto.INT64, [], [0]),
                          helper.make_tensor("keep/axes", TensorProto.INT64, [1], [0]),
                          helper.make_tensor("keep/seq_axis", TensorProto.INT64, [1], [1]),
                          helper.make_tensor("keep/end", TensorProto.INT64, [1], [1 << 62])])
    g.node.extend([helper.make_node("Neg", ["logits_to_keep"], ["keep/neg"]),
                   helper.make_node("Unsqueeze", ["keep/neg", "keep/axes"], ["keep/start"]),
                   helper.make_node("Slice", ["logits_all", "keep/start", "keep/end", "keep/seq_axis"], ["logits"]),
                   helper.make_node("ArgMax", ["logits"], ["next_tokens"], axis=2, keepdims=0)])
    onnx.save(m, str(dst / "model.onnx"))  # the weights stay in model.onnx.data
    fwd = data["graphs"]["forward"]
    fwd["inputs"].append("logits_to_keep")
    fwd["outputs"].append("next_tokens")
    fwd["logits_to_keep"] = True
    data = {k: v for k, v in data.items() if k not in ("files", "format", manifest.SELF_KEY)}
    manifest.write(dst, data)
    return dst


@pytest.fixture(scope="module")
def kept(tiny_export, tmp_path_factory):
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = load(with_kept_rows(tiny_export(arch), tmp_path_factory.mktemp("kept") / arch), threads=1)
        return loaded[arch]

    return get


def _host_rows(m) -> Context:
    """A context that ignores the graph's logits_to_keep and next_tokens, as with an export made before them."""
    ctx = Policy(m).open(m, 64)
    ctx.io.keeps_rows = ctx.io.argmax_in_graph = False
    return ctx


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3"])
def test_forward_returns_only_the_rows_asked_for(model, kept, arch):
    """keep=n gives the last n rows of a full forward; ids are their argmax; logits only when asked. With the
    graph's logits_to_keep/next_tokens, and without them (the host slices and takes the argmax)."""
    m = kept(arch)
    assert Policy(m).open(m, 64).keeps_rows and Policy(m).open(m, 64).argmax_in_graph
    toks = m.encode(PROMPT)
    full = _host_rows(model(arch)).forward(toks).logits
    assert full.shape[0] == len(toks)
    for make in (lambda: Policy(m).open(m, 64), lambda: _host_rows(m)):
        for keep in (1, 3, len(toks)):
            rows = make().forward(toks, keep=keep)
            assert rows.logits.shape == (keep, full.shape[1])
            np.testing.assert_allclose(rows.logits, full[-keep:], rtol=1e-4, atol=1e-4)
            assert rows.ids.tolist() == full[-keep:].argmax(axis=-1).tolist()
        ids_only = make().forward(toks, keep=2, logits=False)
        assert ids_only.logits is None and ids_only.ids.tolist() == full[-2:].argmax(axis=-1).tolist()


@pytest.mark.parametrize("target,drafter", [("qwen3_5_text", "lfm2"), ("lfm2", "qwen3")])
def test_greedy_paths_move_ids_and_match_the_older_graph(model, kept, monkeypatch, target, drafter):
    """With the argmax in the graph, greedy plain and speculative decoding ask no forward for logits rows, and give
    the tokens of the older export; sampling asks for exactly the rows it samples from."""
    calls = []
    real = Context.forward

    def spy(self, tokens, keep=None, logits=True):
        calls.append((self.model.folder.name, len(tokens), keep, logits))
        return real(self, tokens, keep, logits)

    prompt = model(target).encode(PROMPT)
    reference = Generator(model(target), prompt, max_new_tokens=40, stop_at_eos=False).run()
    monkeypatch.setattr(Context, "forward", spy)
    t, d = kept(target), kept(drafter)
    assert Generator(t, prompt, max_new_tokens=40, stop_at_eos=False).run() == reference
    for k in (1, 3):
        g = Generator(t, prompt, drafter=d, max_new_tokens=40, draft_max=k, stop_at_eos=False)
        assert g.run() == reference and g.stats.rounds > 0
    assert calls and not any(logits for *_, logits in calls), [c for c in calls if c[-1]]
    assert all(keep is not None for _, _, keep, _ in calls)
    calls.clear()
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    Generator(t, prompt, drafter=d, max_new_tokens=20, draft_max=3, sampling=params, stop_at_eos=False).run()
    verifies = [c for c in calls if c[2] > 1]
    assert verifies and all(logits and keep == n for _, n, keep, logits in verifies)


def _state_bytes(m, ctx_len: int, roles, slots: int = 1) -> int:
    total = 0
    for s in m.manifest.state:
        if s["role"] in roles or (roles == "kv" and s["role"].startswith("kv")):
            dims = [1 if d == "batch" else ctx_len if d == "context" else int(d) for d in s["shape"]]
            total += int(np.prod(dims)) * (4 if s["dtype"] == "float32" else 2)
    return total * slots


def test_buffers_sized_to_need(model):
    """KV cache and recurrent state hold prompt + max new tokens + the rollback window (or --context), in target
    and drafter; each store reports its bytes; the generation and adaptive k's calibration fit in them."""
    t, d = model("qwen3_5_text"), model("lfm2")
    prompt = t.encode(PROMPT)
    w = t.manifest.rollback["window"]
    g = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max="auto", stop_at_eos=False)
    need = len(prompt) + 24 + w
    assert need < t.manifest.max_context
    assert g.tctx.max_len == g.dctx.max_len == need
    spare = int(t.manifest.data["graphs"]["forward"]["spare_kv_row"])  # one KV row past the context (blocks.py)
    assert spare == 1
    assert g.tctx.kv.nbytes == _state_bytes(t, need + spare, "kv")
    assert g.tctx.recurrent.nbytes == _state_bytes(t, need, ("conv", "recurrent"), slots=2)  # replay: 2 slots
    assert g.dctx.recurrent.nbytes == _state_bytes(d, need, ("conv", "recurrent"), slots=w + 1)  # ring: W + 1
    assert g.tctx.nbytes == g.tctx.kv.nbytes + g.tctx.recurrent.nbytes
    g.run()
    assert g.stop_reason == "length" and len(g.tokens) == 24
    assert g.costs is not None and len(g.costs.C) == g.window + 1  # calibrated in full, inside the same buffers
    explicit = Generator(t, prompt, drafter=d, max_new_tokens=24, context=100)
    assert explicit.tctx.max_len == explicit.dctx.max_len == 100
    assert explicit.tctx.kv.nbytes == _state_bytes(t, 100 + spare, "kv")
    plain = Generator(t, prompt, max_new_tokens=5000)  # more than the export holds: capped at its max_context
    assert plain.tctx.max_len == t.manifest.max_context


def test_checkpoint_reports_its_copy(model):
    m = model("qwen3_5_text")
    ctx = Policy(m).open(m, 32)
    before = ctx.nbytes
    ctx.forward([1, 2, 3])
    ctx.checkpoint()
    assert ctx.nbytes == before + ctx.recurrent.nbytes // 2  # one slot's worth of the two a replay store holds


@pytest.mark.parametrize("chunk", [1, 4, 512])
def test_chunked_prefill_generates_what_one_shot_prefill_does(model, chunk):
    t, d = model("qwen3_next"), model("qwen3")
    prompt = t.encode(PROMPT)
    one_shot = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=3, stop_at_eos=False,
                         prefill_chunk=len(prompt))
    assert one_shot.run()
    g = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=3, stop_at_eos=False, prefill_chunk=chunk)
    assert g.run() == one_shot.tokens
    assert g.stats.target_forwards - one_shot.stats.target_forwards == -(-len(prompt) // chunk) - 1


@pytest.mark.parametrize("target,drafter", [("qwen3_5_text", "lfm2"), ("lfm2", "qwen3_next"), ("qwen3", "qwen3")])
def test_resumed_turns_prefill_only_what_is_new(model, target, drafter):
    """A second turn on the first turn's contexts reuses the common prefix, prefills the rest, and gives the tokens
    of a fresh run on the whole conversation; a prompt that diverges early resets (or, attention only, truncates)."""
    t, d = model(target), model(drafter)
    first = t.encode("User: say something about foxes.\nAssistant:")
    kw = dict(drafter=d, max_new_tokens=20, draft_max=3, stop_at_eos=False, context=160)
    g1 = Generator(t, first, **kw)
    g1.run()
    assert g1.stats.prompt_reused == 0 and g1.stats.prompt_prefilled == len(first)
    second = first + g1.tokens + t.encode("\nUser: and about dogs?\nAssistant:")
    g2 = Generator(t, second, target_ctx=g1.tctx, drafter_ctx=g1.dctx, **kw)
    g2.run()
    fresh = Generator(t, second, **kw).run()
    assert g2.tokens == fresh
    reused = g2.stats.prompt_reused
    assert len(first) + len(g1.tokens) - 1 <= reused <= len(first) + len(g1.tokens), reused
    assert g2.stats.prompt_prefilled == len(second) - reused
    assert g2.tctx.tokens == (second + g2.tokens)[:g2.tctx.n_past]

    other = first[:5] + [(first[5] + 1) % t.vocab_size] + t.encode(" a different question?")
    g3 = Generator(t, other, target_ctx=g2.tctx, drafter_ctx=g2.dctx, **kw)
    g3.run()
    assert g3.tokens == Generator(t, other, **kw).run()
    assert g3.stats.prompt_reused == (5 if g3.tctx.recurrent is None else 0)


def test_resume_keeps_at_least_one_token_to_feed(model):
    t = model("qwen3")
    ctx = Policy(t).open(t, 64)
    ctx.forward([5, 6, 7, 8])
    assert ctx.resume([5, 6, 7, 8]) == 3 and ctx.n_past == 3 and ctx.tokens == [5, 6, 7]
    assert ctx.resume([9]) == 0 and ctx.n_past == 0


def test_attention_mask_is_a_view_of_one_buffer(model, monkeypatch):
    """No O(context) allocation per step: the mask is bound by pointer from one ones-buffer made with the context."""
    m = model("qwen3_5_text")
    ctx = Policy(m).open(m, 64)
    made = []
    real = np.ones
    monkeypatch.setattr(context_mod.np, "ones", lambda *a, **k: made.append(a) or real(*a, **k))
    for tok in range(1, 30):
        ctx.forward([tok], keep=1, logits=False)
    assert not made


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2"])
def test_int4_verify_equals_steps_at_the_end_of_the_context(model, arch):
    """An int4 export (accuracy level 4) in a context sized exactly to a prompt and a 5-token verify: the verify's
    ids and logits equal five one-token steps bit for bit, up to the very last position (the KV buffer's spare row
    leaves room for the attention's spare query row, src/snapspec/export/blocks/attention.py)."""
    m = model(arch, quant="int4", block_size=16)
    ids = list(np.random.default_rng(3).integers(1, m.vocab_size, 25))
    verify, steps = Policy(m).open(m, 25), Policy(m).open(m, 25)
    verify.prefill(ids[:20])
    steps.prefill(ids[:20])
    multi = verify.forward(ids[20:])
    singles = [steps.forward([tok]) for tok in ids[20:]]
    assert verify.n_past == steps.n_past == 25 == verify.max_len
    assert np.array_equal(multi.ids, np.concatenate([s.ids for s in singles]))
    assert np.array_equal(multi.logits, np.concatenate([s.logits for s in singles]))


def test_rollback_data_covers_the_first_window_rows(model):
    """The forward's rollback data holds the first W tokens of a call only (a prefill chunk's would otherwise hold
    every token): a long forward cannot be replayed into past them (the store says so instead of replaying rows it
    has not got), while a verify forward of k + 1 <= W + 1 tokens rolls back by replay to the state of decoding
    its prefix directly."""
    m = model("qwen3_5_text")
    w = m.manifest.rollback["window"]
    assert m.manifest.rollback_data["rows"] == w
    ids = list(np.random.default_rng(4).integers(1, m.vocab_size, 40))
    ctx = Policy(m).open(m, 48)
    ctx.forward(ids[:30])
    assert ctx.recurrent._last.data.shape()[1] == w  # [1, W, width], not [1, 30, width]
    assert ctx.can_rollback(3) is None  # keeping 27 of the 30 tokens would need rows 8..26
    assert ctx.can_rollback(30 - w) == "replay"  # keeping W tokens: the rows it has
    ctx.forward(ids[30:35])
    ctx.rollback(32)
    direct = Policy(m).open(m, 48)
    direct.forward(ids[:30])
    direct.forward(ids[30:32])
    got, want = ctx.state_snapshot(), direct.state_snapshot()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2"])
def test_greedy_cpu_forwards_read_nothing_back_through_onnxruntime(kept, monkeypatch, arch):
    """A greedy CPU forward writes its call-shaped outputs (rollback data, hidden rows, next ids) into the runner's
    own buffers (runners/bound.py) and never asks IOBinding.get_outputs(): ids it returned survive later forwards
    of other shapes, and a rollback by replay after them reaches the state of decoding the kept prefix directly."""
    import onnxruntime as ort

    m = kept(arch)
    calls, real = [], ort.IOBinding.get_outputs
    monkeypatch.setattr(ort.IOBinding, "get_outputs", lambda self: calls.append(1) or real(self))
    ids = [int(x) for x in np.random.default_rng(5).integers(1, m.vocab_size, 30)]
    ctx = Policy(m).open(m, 48)
    first = ctx.forward(ids[:10], keep=3, logits=False)
    held = first.ids.copy()
    for tok in ids[10:14]:
        ctx.forward([tok], keep=1, logits=False)
    ctx.forward(ids[14:18], keep=4, logits=False)
    assert np.array_equal(first.ids, held)
    assert ctx.can_rollback(2) == "replay"
    ctx.rollback(16)
    direct = Policy(m).open(m, 48)
    direct.forward(ids[:16], keep=1, logits=False)
    got, want = ctx.state_snapshot(), direct.state_snapshot()
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert not calls
    assert ctx.forward(ids[16:18], keep=2, logits=True).logits.shape[0] == 2 and calls  # logits: read back
