"""Falcon-Mamba (`falcon_mamba`): Mamba1 with an RMSNorm, without weight, on each of x_proj's outputs (dt before
dt_proj, B and C), epsilon `mixer_rms_eps`; the rest (checkpoint names, layer layout, tied head) is Mamba's
(arch/mamba.py).
"""

from __future__ import annotations

from .mamba import Mamba1Spec, _spec, build, ignored  # noqa: F401  (build and ignored are Mamba's)

MODEL_TYPES = ("falcon_mamba",)


def spec(config: dict) -> Mamba1Spec:
    return _spec(config, "weightless")
