"""Hugging Face configs cut down: to 2 decoder layers at the model's own widths (`keep_layers`,
what `arfusion check` compiles) and further to tiny widths (`tiny_config`, what the tests and the
coverage sweeps build every architecture with).

`tiny_config(model_type)` shrinks the architecture's default config: 2 decoder layers, hidden 128,
4 heads of 32 with 2 KV heads (divisible by TP=2), a 512-token vocabulary, 4 experts with top-2
for MoE models, and every per-layer list (`layer_types`, `mlp_layer_types`, `mlp_only_layers`, ...)
cut to 2 layers that keep the architecture's distinct layer kinds where it has several (the first
layer and the first one that differs from it). Done generically from the config's attributes,
with `OVERRIDES` for what a generic rule cannot know. transformers is imported inside the functions.
"""

from __future__ import annotations

import copy
from typing import Any

LAYERS = 2
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer")
# At most this many of the first layers dense, so that a MoE layer remains among 2.
DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
# Lists of layer indices (not one entry per layer).
INDEX_LISTS = ("mlp_only_layers", "moe_layers", "ple_layer_ids")


def per_layer_lists(d: dict, layers: int) -> dict[str, list]:
    """The config entries that hold one value per layer (`layer_types`, `mlp_layer_types`, ...)."""
    return {k: v for k, v in d.items()
            if isinstance(v, list) and len(v) == layers and layers > 1 and k not in INDEX_LISTS
            and k != "eos_token_id"}


def chosen_layers(d: dict) -> list[int]:
    """The layers a 2-layer cut keeps: layer 0 and the first whose kinds differ from it (else 1)."""
    layers = d.get("num_hidden_layers") or d.get("num_layers") or d.get("n_layer") or LAYERS
    per_layer = per_layer_lists(d, layers)
    overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    if not per_layer and not overrides:
        return list(range(LAYERS))
    sig = [tuple(repr(v[i]) for v in per_layer.values()) + (repr(overrides.get(i)),) for i in range(layers)]
    return [0, next((i for i in range(1, layers) if sig[i] != sig[0]), 1)]


def keep_layers(d: dict, other=None, finish=None, override=None, _top: bool = True) -> dict:
    """A config dict (`config.to_dict()`) cut to 2 decoder layers of the kinds `chosen_layers`
    picks: layer counts, per-layer lists, index lists, dense prefixes, per-layer overrides; and
    the same in every sub-config (text_config, ...). Hooks for a caller that changes more
    (`tiny_config`): `other(key, value)` gives every other entry its value,
    `override(values, d)` each kept per-layer override's, `finish(d, top)` ends each level."""
    d = copy.deepcopy(d)
    source = dict(d)
    layers = d.get("num_hidden_layers") or d.get("num_layers") or d.get("n_layer") or LAYERS
    per_layer = per_layer_lists(d, layers)
    overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    chosen = chosen_layers(d)
    for key, value in list(d.items()):
        if key == "per_layer_config" and value:
            d[key] = {str(j): override(overrides[i], source) if override else overrides[i]
                      for j, i in enumerate(chosen) if i in overrides}
        elif isinstance(value, dict) and ("hidden_size" in value or "model_type" in value):
            d[key] = keep_layers(value, other, finish, override, _top=False)
        elif key in per_layer:
            d[key] = [value[i] for i in chosen]
        elif key in INDEX_LISTS and isinstance(value, list):
            d[key] = [j for j, i in enumerate(chosen) if i in value]
        elif key in DENSE_PREFIX and isinstance(value, int) and not isinstance(value, bool):
            d[key] = min(value, LAYERS - 1)
        elif key in LAYER_COUNTS and isinstance(value, int) and not isinstance(value, bool):
            d[key] = LAYERS
        elif other is not None:
            d[key] = other(key, value)
    return finish(d, _top) if finish else d


# ----------------------------------------------------------------------------- tiny widths
HIDDEN = 128
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
KV_HEADS = 2
VOCAB = 512

# Attribute -> tiny value, applied where the default config has the attribute set (not None).
TINY: dict[str, Any] = {
    "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "intermediate_size": 2 * HIDDEN, "ffn_hidden_size": 2 * HIDDEN, "dense_intermediate_size": 2 * HIDDEN,
    "intermediate_size_mlp": 2 * HIDDEN,
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "max_position_embeddings": 512,
    "original_max_position_embeddings": 512, "model_max_length": 512,
    # GPT-2-style names (GPT-J, CodeGen): no attribute map in to_dict().
    "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 512, "n_ctx": 512,
    "rotary_dim": HEAD_DIM // 2,
    # MoE: 4 experts, top-2, one shared expert, small expert MLPs (sharded over TP=2).
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64, "shared_intermediate_size": 64,
    "shared_experts_intermediate_size": 64, "expert_ffn_hidden_size": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "zero_expert_num": 2,
    # MLA.
    "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "qk_head_dim": 32, "v_head_dim": 32, "o_lora_rank": 32, "o_groups": 2,
    # Sparse-attention indexers.
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4, "index_topk_blocks": 2,
    # Linear attention / gated delta net / KDA.
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_num_heads": 4, "linear_head_dim": 32,
    # Mamba (expand 2 x hidden 128 = 8 heads x 32).
    "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_head": 32, "mamba_head_dim": 32,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 16, "mamba_chunk_size": 16,
    "chunk_size": 16, "n_groups": 2, "mamba_n_groups": 2, "mamba_d_ssm": 2 * HIDDEN,
    # Per-layer inputs, LAuReL, AltUp (Gemma3n).
    "laurel_rank": 16, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB,
    "num_kv_shared_layers": 0,
    # Sliding-window attention heads (Granite SWA and others).
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS, "swa_head_dim": HEAD_DIM,
    "num_nextn_predict_layers": 0,
}
# Set even where the default config leaves them None (the defaults of some architectures only
# work with a checkpoint's config: the modeling code reads them unconditionally).
ALWAYS = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "num_local_experts",
          "moe_intermediate_size", "n_shared_experts")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# What the generic rules cannot know: values per model type, applied last.
OVERRIDES: dict[str, dict[str, Any]] = {
    # layer 0: mamba + dense MLP, layer 1: attention + MoE
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 32, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    # num_hidden_layers = num_layers_per_stack * H_cycles * (L_cycles + 1) = 2
    "hrm_text": {"H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1], "num_layers_per_stack": 1},
    # Released Granite 3/4 checkpoints' multipliers: the defaults (1.0) make the scale between
    # all-reduce and residual add an identity, which Inductor drops.
    **{m: {"residual_multiplier": 0.22, "embedding_multiplier": 12.0}
       for m in ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared")},
    # MiniMax-Text-01: the residual is scaled (alpha), the all-reduced branch is not (beta = 1).
    "minimax": {"full_attn_alpha_factor": 3.5566, "linear_attn_alpha_factor": 3.5566, "mlp_alpha_factor": 3.5566},
    # A routed scaling factor other than the default 1.0 (an identity Inductor drops), so that the
    # routed term is scaled before it meets the shared one (DeepSeek-V3 ships 2.5).
    "laguna": {"moe_routed_scaling_factor": 2.5},
    # Dory (nGPT-style looped model): input, recurrent and output sections must add up to the
    # layers; one layer each of input and recurrent (looped twice), every layer an attention one.
    "dory": {"layer_types": ["sliding_attention", "full_attention"], "n_input_layers": 1,
             "n_recurrent_layers": 1, "n_output_layers": 0, "n_recurrent_loops": 2},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
}


def _shrink_layer_override(values: dict, mla: bool) -> dict:
    out = {}
    for key, value in values.items():
        if key == "head_dim":
            out[key] = 2 * HEAD_DIM  # a wider head than the other layers', as the original has
        elif key == "num_key_value_heads":
            out[key] = HEADS if mla else KV_HEADS
        else:
            out[key] = TINY.get(key, value)
    return out


def _tiny(key: str, value: Any) -> Any:
    if key in TINY and (value is not None or key in ALWAYS) and not isinstance(value, bool):
        return TINY[key]
    if key in TOKEN_IDS and value is not None:
        return [TOKEN_IDS[key]] if isinstance(value, list) else TOKEN_IDS[key]
    return value


def _is_mla(d: dict) -> bool:
    return d.get("kv_lora_rank") is not None and "qk_rope_head_dim" in d


def _finish(d: dict, model_type: str | None) -> dict:
    if _is_mla(d):
        # MLA: the rotary part is `head_dim` wide, q/k heads are nope + rope, K/V heads = Q heads.
        d["head_dim"] = d["qk_rope_head_dim"]
        if "num_key_value_heads" in d:
            d["num_key_value_heads"] = d["num_attention_heads"]
        if "qk_head_dim" in d:
            d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if "num_attention_heads_per_layer" in d and isinstance(d["num_attention_heads_per_layer"], list):
        d["num_attention_heads_per_layer"] = [HEADS] * len(d["num_attention_heads_per_layer"])
    d["tie_word_embeddings"] = False
    d.pop("architectures", None)
    d.update(OVERRIDES.get(model_type or d.get("model_type"), {}))
    return d


def shrink(d: dict, model_type: str | None = None) -> dict:
    """Tiny values for a config dict (nested sub-configs shrunk too): 2 layers as
    `arfusion.check.keep_layers` keeps them, then tiny widths."""
    return keep_layers(d, other=_tiny, override=lambda values, src: _shrink_layer_override(values, _is_mla(src)),
                       finish=lambda x, top: _finish(x, model_type if top else None))


def tiny_config(model_type: str):
    """The architecture's default config, shrunk (a transformers config object)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    d = shrink(default.to_dict(), model_type)
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    config = AutoConfig.for_model(model_type, **d)
    # A config spelled with names this table lacks would run full-size (minutes per compile).
    hidden = getattr(config.get_text_config(), "hidden_size", HIDDEN)
    if hidden > 4 * HIDDEN:
        raise ValueError(f"{model_type}: hidden size {hidden} was not shrunk (add its attribute names to TINY)")
    return config
