"""Tiny random Hugging Face checkpoints, one per supported architecture, for parity tests.

Every axis gets its own size (hidden != heads * head_dim, Dk != Dv, key heads != value heads, kv heads != heads,
vocab != anything else) and every layer kind of the architecture is present, so a transposed or mis-split tensor
fails instead of passing by symmetry. Weights are drawn with a large initializer range and every norm weight is
perturbed away from its initial 0 or 1, so greedy output is not one token repeated and a `w` vs `1 + w` mix-up
shows. Checkpoints are saved in bf16, as real ones are; `load_hf` reads them back in float32, so the oracle and
the exporter see the same bf16-rounded values.

torch and transformers are imported inside the functions that build or load a checkpoint (`torch_module()`), so a test
that only needs MODEL_TYPES, VOCAB or make_tokenizer does not import them.
"""

from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    import torch

EOS = "<|endoftext|>"
VOCAB = 384

_TEXT = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
    "def forward(self, x):\n    return self.proj(torch.relu(x)) + x\n",
    "Speculative decoding drafts a few tokens with a small model and verifies them with the large one.",
    "A recurrent state only moves forward; an attention cache can be truncated to any position for free.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, i * i)\n",
    "Rolling back the state of a hybrid model means replaying the accepted tokens from a saved point.",
    "import numpy as np\nx = np.zeros((4, 8), dtype=np.float32)\ny = x.sum(axis=-1)\n",
]

# One row per model_type: (config class, model class, config kwargs). Every list of layer kinds holds each kind.
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
            linear_conv_kernel_dim=4)
_QWEN35_TEXT = dict(hidden_size=80, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_interleaved": True, "mrope_section": [2, 1, 1]},
                    tie_word_embeddings=True, **_GDN)
SPECS = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _QWEN35_TEXT),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(
        text_config=dict(_QWEN35_TEXT, tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=80,
                           num_position_embeddings=16),
        tie_word_embeddings=False)),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
        text_config=dict(_QWEN35_TEXT, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
                         moe_intermediate_size=48, shared_expert_intermediate_size=56),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=80,
                           num_position_embeddings=16),
        tie_word_embeddings=False)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=96, intermediate_size=120, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=56,
        decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True, tie_word_embeddings=False, **_GDN)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=136, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        hidden_size=96, intermediate_size=200, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)),
    # Mamba2 hybrids: heads != groups != d_state != head_dim, every multiplier away from 1, transformers' SSD chunk
    # (32) below the 70-token prefill, so its chunked scan crosses chunk boundaries.
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        hidden_size=96, intermediate_size=40, shared_intermediate_size=56, num_local_experts=5, num_experts_per_tok=2,
        num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=20, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=32, position_embedding_type="nope", embedding_multiplier=2.0, residual_multiplier=0.6,
        attention_multiplier=0.09, logits_scaling=1.5, tie_word_embeddings=False)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hidden_size=80, layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, mamba_num_heads=4, mamba_head_dim=22, n_groups=2,
        ssm_state_size=16, conv_kernel=3, chunk_size=32, intermediate_size=112, n_routed_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=36, moe_shared_expert_intermediate_size=52, n_group=2,
        topk_group=1, routed_scaling_factor=1.7, norm_topk_prob=True, tie_word_embeddings=False)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        hidden_size=80, head_dim=24, intermediate_size=104, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=20, mamba_d_conv=4,
        mamba_chunk_size=32, mamba_rms_norm=True, mamba_norm_before_gate=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, embedding_multiplier=1.3,
        lm_head_multiplier=0.7, mlp_multipliers=[0.8, 1.2], key_multiplier=0.9, attention_in_multiplier=1.1,
        attention_out_multiplier=0.75, ssm_multipliers=[0.9, 1.2, 0.8, 1.1, 0.7], ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.85, tie_word_embeddings=False)),
    # KDA + MLA + MoE: the published 3 KDA : 1 MLA (Kimi-Linear) and groups ending in MLA (Ling 3,
    # layer_group_size), a dense first layer (two for Ling), grouped sigmoid routing; KDA heads != MLA heads,
    # kv_lora_rank != any head size.
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        hidden_size=80, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], first_k_dense_replace=1, linear_num_heads=3,
        linear_head_dim=16, linear_conv_kernel_dim=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, num_experts=6, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=48,
        n_group=2, topk_group=1, routed_scaling_factor=2.446, tie_word_embeddings=False)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(
        hidden_size=80, intermediate_size=112, num_hidden_layers=4, layer_group_size=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, short_conv_kernel_size=4, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, num_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=2,
        num_mtp_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False)),
    # Bamba-9B's pattern (attention at a few attn_layer_indices among Mamba2 layers), partial RoPE (0.5).
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        hidden_size=96, intermediate_size=112, num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=20, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5}, tie_word_embeddings=False)),
    # Pure Mamba2 (mamba2-130m's layout: Mamba2 blocks only, tied embeddings): no attention, no KV cache.
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        hidden_size=96, num_hidden_layers=3, num_heads=6, head_dim=32, n_groups=2, state_size=20, conv_kernel=4,
        expand=2, chunk_size=32, tie_word_embeddings=True)),
    # LFM2-8B-A1B's layout: LFM2 layers, dense SwiGLU in the first num_dense_layers, sigmoid-routed experts after.
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        hidden_size=96, intermediate_size=112, moe_intermediate_size=48, num_hidden_layers=4, num_dense_layers=1,
        num_experts=6, num_experts_per_tok=2, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "conv", "full_attention", "conv"],
        conv_L_cache=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)),
    # Mamba1 (selective scan): d_inner != d_state != dt_rank != hidden; Jamba keeps the published pattern (attention
    # on an even layer with a dense MLP, experts on the odd Mamba layers) at period 4 instead of 8.
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(
        hidden_size=48, state_size=12, num_hidden_layers=3, expand=2, conv_kernel=4, time_step_rank=8,
        tie_word_embeddings=True)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        hidden_size=64, state_size=10, num_hidden_layers=3, expand=2, conv_kernel=3, mixer_rms_eps=1e-6,
        tie_word_embeddings=False)),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_experts=5, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4,
        attn_layer_offset=2, mamba_d_state=12, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        tie_word_embeddings=False)),
    # OLMo-Hybrid: three Gated DeltaNet layers then one post-norm attention layer (the published 3:1 pattern); RoPE
    # on here (the released checkpoints are NoPE) so that both paths are tested; Dk != Dv, kv heads != heads, key
    # heads != value heads (each key head serves two; the NoPE test keeps them equal).
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        hidden_size=80, intermediate_size=112, num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False)),
    # LFM3: the published layer pattern (full attention at i % 4 == 2, sliding at i % 4 == 0 for i > 0, else conv)
    # over 6 layers, a sliding window of 6 (the parity tests' 20- and 70-token prompts run past it), proportional
    # RoPE on the full layer, a sigmoid gate per head, sandwich norms.
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", dict(
        hidden_size=80, intermediate_size=112, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, conv_L_cache=4, sliding_window=6, tie_word_embeddings=True)),
    # Zamba2's layout (Zamba2-2.7B: two shared attention blocks used in turn, LoRA adapters per use, RoPE in them):
    # three hybrid layers over two blocks, so block 0 runs twice. Layer kinds in the published spelling; kv heads =
    # heads, as published (the adapters are 2 * hidden wide, so transformers cannot run them with fewer kv heads).
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        hidden_size=96, intermediate_size=112, num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"], num_attention_heads=4,
        n_mamba_heads=6, mamba_ngroups=2, mamba_d_state=20, mamba_d_conv=4, mamba_expand=2,
        chunk_size=32, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
        hidden_act="gelu", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True)),
    # RecurrentGemma: the published block pattern (recurrent, recurrent, attention), lru_width = hidden as published
    # (transformers' one-token path sizes the conv state by hidden_size, so it needs them equal), one kv head
    # (as recurrentgemma-2b), a local attention window of 6, a logits soft cap low enough to bend the tiny logits.
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
        hidden_size=96, intermediate_size=224, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        attention_window_size=6, conv1d_width=4, logits_soft_cap=6.0, w_init_variance_scale=0.5,
        tie_word_embeddings=True)),
}
MAMBA2_TYPES = ("granitemoehybrid", "nemotron_h", "falcon_h1", "bamba", "mamba2", "zamba2")
MAMBA1_TYPES = ("mamba", "falcon_mamba", "jamba")
MODEL_TYPES = tuple(SPECS)
# Large weights make greedy output varied but also amplify float32 rounding. Measured over 70-token prefills, as
# the worst error of transformers and of onnxruntime (each in float32) relative to the tensor's scale: Qwen3.5 at 0.2
# reaches 9e-5 (at one position of one prompt), at 0.15 stays under 3.5e-5; Qwen3-Next
# (MoE plus a sigmoid-gated shared expert grow the residual stream faster) at 0.2 reaches 3e-4, at 0.1 2e-5.
# Zamba2 (six layers, three shared attention blocks) at 0.2: transformers' own float32 forward is 6e-4 away from its
# float64 one, at 0.1 2e-6.
_INIT = {"qwen3_next": 0.1, "qwen3_5_text": 0.15, "qwen3_5": 0.15, "qwen3_5_moe": 0.1, "zamba2": 0.1}


def torch_module():
    """torch, imported on first use, with one thread: the oracle's tiny models gain nothing from two, and on a loaded
    machine (CI's 2 shared cores) two OpenMP threads spin-waiting on each other made transformers' forwards 20-100x
    slower (measured: 0.4-5.8 s vs 0.02-0.05 s for a 20-token Granite-4.0-H forward)."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return torch


def make_tokenizer(vocab_size: int = VOCAB, specials: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE trained on a few sentences, then `specials` (chat control tokens) as special tokens, padded
    with extra special tokens to exactly vocab_size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TEXT, trainer)
    tok.add_special_tokens(list(specials))
    missing = vocab_size - tok.get_vocab_size()
    if missing < 0:
        raise ValueError(f"tokenizer came out with {tok.get_vocab_size()} tokens, more than {vocab_size}")
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id(EOS) == 0
    return tok


def make_tiny(model_type: str, folder: Path, *, seed: int = 0, initializer_range: float | None = None,
              vocab_size: int = VOCAB, tokenizer: Tokenizer | None = None, mtp: bool = False, **overrides) -> Path:
    """Build, save (bf16 safetensors + tokenizer files) and return `folder` with a tiny random `model_type`
    (tokenizer: one of vocab_size tokens to save instead of make_tokenizer's). mtp: also write a random MTP head
    (`mtp.*`, add_mtp_head); the target's tensors are the same as without it."""
    import transformers

    torch = torch_module()
    config_cls, model_cls, kwargs = SPECS[model_type]
    initializer_range = initializer_range or _INIT.get(model_type, 0.2)
    kwargs = {**kwargs, **overrides}
    common = dict(vocab_size=vocab_size, initializer_range=initializer_range, eos_token_id=0, bos_token_id=0,
                  pad_token_id=0, max_position_embeddings=512)
    if "text_config" in kwargs:
        kwargs["text_config"] = {**kwargs["text_config"], **common}
        kwargs["vision_config"] = {**kwargs["vision_config"], "initializer_range": initializer_range}
    else:
        kwargs.update(common)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _perturb_norms(model, seed)
    _perturb_ssm(model, seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    (tokenizer or make_tokenizer(vocab_size)).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS, "pad_token": EOS,
         "model_max_length": 512}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}, indent=2))
    if mtp:
        add_mtp_head(folder, seed, initializer_range)
    return folder


MTP_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def add_mtp_head(folder: Path, seed: int, initializer_range: float) -> None:
    """Write a random multi-token-prediction head into a saved Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint, as
    published checkpoints carry it: top-level `mtp.*` tensors (transformers drops them when it loads or saves, so
    they are added to the safetensors file here), and `mtp_num_hidden_layers: 1` in a Qwen3.5 config (Qwen3-Next
    has no such key). mtp.layers.0 is named and shaped like the target's last full-attention layer (MoE in MoE
    checkpoints); norm weights are zero-centred and perturbed, like the target's."""
    from safetensors.torch import load_file, save_file

    torch = torch_module()

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    prefix = "model.language_model." if "text_config" in config else "model."
    full = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    layer = f"{prefix}layers.{full}."
    hidden = text["hidden_size"]
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
              "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    shapes.update({"mtp.layers.0." + n[len(layer):]: tuple(t.shape) for n, t in tensors.items() if n.startswith(layer)})
    gen = torch.Generator().manual_seed(seed + 3)
    for name, shape in shapes.items():
        scale = 0.2 if name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")) \
            else initializer_range
        tensors[name] = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    if config.get("model_type") != "qwen3_next":
        text["mtp_num_hidden_layers"] = 1
        (folder / "config.json").write_text(json.dumps(config, indent=2))


def _perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Move every norm weight away from its initial constant so that 1 + w and w give different models."""
    torch = torch_module()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.add_(torch.randn(module.weight.shape, generator=gen) * 0.2)


def _perturb_ssm(model: torch.nn.Module, seed: int) -> None:
    """Give every Mamba2 head (Mamba1 channel and state index) its own A, D and dt bias (transformers initialises
    them to 1..H, 1 and a constant, so a head mix-up would pass), and the Nemotron-H router a correction bias
    (initially zero). dt_bias around 0.5 keeps softplus(dt) clear of Nemotron-H's time_step_min clip, which
    transformers applies in its multi-token path only."""
    torch = torch_module()
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "A_log", None) is not None and getattr(module, "dt_proj", None) is not None:  # Mamba1
                e = module.D.shape
                module.A_log.copy_(torch.rand(module.A_log.shape, generator=gen) * 2.0 - 1.0)
                module.D.copy_(torch.randn(e, generator=gen) * 0.5 + 1.0)
                module.dt_proj.bias.copy_(torch.randn(e, generator=gen) * 0.5 + 0.5)
            elif getattr(module, "A_log", None) is not None and getattr(module, "D", None) is not None:  # Mamba2
                n = module.A_log.shape
                module.A_log.copy_(torch.rand(n, generator=gen) * 2.0 - 1.0)  # A in -[0.37, 2.7]
                module.D.copy_(torch.randn(n, generator=gen) * 0.5 + 1.0)
                module.dt_bias.copy_(torch.randn(n, generator=gen) * 0.5 + 0.5)
            if getattr(module, "expert_bias", None) is not None:  # LFM2-MoE's (initially zero)
                module.expert_bias.copy_(torch.randn(module.expert_bias.shape, generator=gen) * 0.1)
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape,
                                                                 generator=gen) * 0.1)


def load_hf(folder: Path, dtype: torch.dtype | None = None):
    """A saved tiny (or real) checkpoint as a transformers model in eval mode: eager attention, eager experts
    (the plain per-expert loop, which also runs in float64)."""
    import transformers

    dtype = dtype or torch_module().float32
    config = transformers.AutoConfig.from_pretrained(folder)
    cls = {"qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration}.get(config.model_type,
                                                                              transformers.AutoModelForCausalLM)
    moe = ("qwen3_next", "qwen3_5_moe", "granitemoehybrid", "nemotron_h", "kimi_linear", "bailing_hybrid", "lfm2_moe",
           "jamba")
    extra = {"experts_implementation": "eager"} if config.model_type in moe else {}
    return cls.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **extra).eval()
