"""The causal conv with state (com.microsoft CausalConvWithState) that every recurrent layer starts with, its state
entry, and LFM2's short-conv layer built from it."""

from __future__ import annotations

from ..graph import MS, Graph
from .common import F32, StateEntry


class Conv:
    """The causal conv with state and the short-conv layer, as Decoder methods (a mixin)."""

    def _conv_state(self, layer: int, channels: int, kernel: int, elem: int | None = None) -> tuple[str, str]:
        """elem: the state's element type (default the export dtype; Gated DeltaNet keeps float32, see there)."""
        shape = ["batch", kernel - 1, channels]
        elem = self.fwd.onnx_dtype if elem is None else elem
        past = self.fwd.input(f"past_conv_state.{layer}", elem, shape)
        self.replay.input(past, elem, shape)
        present = f"present_conv_state.{layer}"
        self.state.append(StateEntry(past, present, "conv", layer, shape, "float32" if elem == F32 else "float16"))
        self.fwd.output(present, present, elem, shape)
        return past, present

    def _causal_conv(self, g: Graph, x: str, weight_name: str, state: str, present: str, activation: str,
                     leaf: str = "conv", bias: str = "") -> str:
        out, _ = g.op("CausalConvWithState", [x, weight_name, bias, state], leaf, n_out=2, domain=MS,
                      outputs=[g._unique(g._path(leaf) + "/output_0"), present],
                      activation=activation, channels_last=1)
        return out

    def short_conv(self, x: str, layer: int, *, in_w, conv_w, out_w, hidden: int, kernel: int,
                   in_b=None, conv_b=None, out_b=None) -> str:
        """y = out_proj(C * conv(B * x)); state is the last kernel-1 values of B * x."""
        g = self.fwd
        bcx = g.linear(x, in_w, "in_proj", bias=in_b)
        bg, cg, xv = g.split(bcx, [hidden, hidden, hidden], axis=-1, leaf="split_bcx")
        bx = g.op("Mul", [bg, xv], "bx")
        conv_weight = conv_w.reshape(hidden, 1, kernel)
        past, present = self._conv_state(layer, hidden, kernel)
        conv_out = self._causal_conv(g, bx, g.const("conv/weight", conv_weight), past, present, "none",
                                     bias=g.const("conv/bias", conv_b) if conv_b is not None else "")
        self._rollback_out(g, bx, layer, [("conv_input", hidden)], width=hidden)
        r = self.replay
        with r.scope(f"model/layers.{layer}/conv"):
            rin = [f"rollback.{layer}.conv_input", r.const("conv/weight", conv_weight),
                   r.const("conv/bias", conv_b) if conv_b is not None else "", past]
            r.op("CausalConvWithState", rin, "conv", n_out=2, domain=MS,
                 outputs=[r._unique(r._path("conv") + "/output_0"), present], activation="none", channels_last=1)
            r.output(present, present, r.onnx_dtype, ["batch", kernel - 1, hidden])
        return g.linear(g.op("Mul", [cg, conv_out], "cy"), out_w, "out_proj", bias=out_b)
