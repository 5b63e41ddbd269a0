"""Model FLOPs of a train step, from the shapes: what MFU divides by the step time.

XLA's ``cost_analysis()`` is no FLOP counter for this: it counts a loop body once (our
layers run in a ``lax.scan``, attention in while loops) and custom calls such as cuDNN not at
all; on an H200 it reported 2.09e11 flops for a step that does 7.39e13. So the trainer counts
the model's FLOPs the standard way (PaLM appendix B; Megatron's MFU) and keeps XLA's number
beside it under another name.

Per token, forward + backward = 3 x forward, a multiply-add = 2 FLOPs:
  - 6 x the weights a token passes through in matmuls: per layer q, k, v, o projections
    (D·N·H + 2·D·K·H + N·H·D) and the MLP (3·D·F, SwiGLU), plus the output head D·V. The
    embedding lookup is a gather, no matmul: an untied input table is not counted (a tied
    one is, once, as the head).
  - causal attention: QK^T and PV are 2·2·N·H FLOPs per (query, visible key) pair, forward;
    a query at position i sees i + 1 keys, about S/2 on average, so forward + backward is
    6·N·H·S per token per layer (6·L·N·H·S² per sequence). Without the causal mask: twice.
    A sliding window W sees min(i + 1, W) keys: local layers count W·S - W(W-1)/2 pairs.
  - Qwen3-Next (``model.family=qwen3_next``): an attention layer's q_proj also yields the
    output gate (D·N·2H); a Gated DeltaNet layer counts its projections (in_proj_qkvz,
    in_proj_ba, out_proj) as matmul weights and, in place of attention, the chunked delta
    rule's matmuls (``qwen3_next.deltanet_flops_per_token``: linear in S).
  - the vision tower (``model.family=qwen2_5_vl``), over every patch slot of the batch (the
    padding slots are computed too; ``vision_flops``): its weights (patch embedding, the
    blocks, the merger per merge^2 patches) and bidirectional attention over a window's
    patches, or at the full-attention blocks over a frame of ``frame_patches`` (an estimate:
    frames differ).
Recomputation (remat) is not counted (that would be hardware FLOPs, HFU), nor the tiles the
packed-document kernels skip: ``mfu`` counts every causal pair of the row, so packed rows do
less work than it counts (their "useful" attention is sum(l²)/S² of it).
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..models.moe import mlp_matmul_params
from ..models.qwen3_next import deltanet_flops_per_token, mixer_matmul_params


def matmul_params_per_token(m: ModelConfig) -> int:
    """Weights each token multiplies through: L x (attention + MLP projections) + head. An
    MoE layer's MLP counts its router and the experts a token is routed to
    (``moe.mlp_matmul_params``), not all experts."""
    mixers = sum(mixer_matmul_params(m, c) for c in m.layer_mixers())
    mlp = sum(mlp_matmul_params(m, i) for i in range(m.n_layers))
    return mixers + mlp + m.d_model * m.vocab_size


def attention_flops_per_token(m: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward + backward FLOPs of the score and value matmuls, per token of a row.

    A local layer (``model.sliding_window`` W < S, causal) counts its visible pairs,
    W·S - W(W-1)/2 per row instead of about S²/2. Gated DeltaNet layers (Qwen3-Next) count
    the delta rule's FLOPs instead."""
    linear = m.layer_mixers().count("D")
    if linear:
        full = dataclasses.replace(m, n_layers=m.n_layers - linear, family="llama")
        return (linear * deltanet_flops_per_token(m)
                + (attention_flops_per_token(full, seq_len, causal) if full.n_layers else 0.0))
    per_layer = 6 * m.n_heads * m.head_dim * seq_len  # causal: 12·N·H·S²/2 per row / S
    w = m.sliding_window
    if not causal or not w or w >= seq_len:
        return m.n_layers * per_layer * (1 if causal else 2)
    local = m.layer_kinds().count("L")
    windowed = 12 * m.n_heads * m.head_dim * (w * seq_len - w * (w - 1) / 2) / seq_len
    return (m.n_layers - local) * per_layer + local * windowed


def vision_flops(m: ModelConfig, patches: int, frame_patches: int) -> float:
    """Forward + backward FLOPs of the vision tower over ``patches`` patches."""
    v = m.vision
    d, f, m2 = v.hidden_size, v.intermediate_size, v.spatial_merge_size ** 2
    k = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    weights = k * d + v.depth * (4 * d * d + 3 * d * f) + (m2 * d * m2 * d + m2 * d * m.d_model) / m2
    window = (v.window_size // v.patch_size) ** 2
    full = len(v.fullatt_block_indexes)
    pairs = (v.depth - full) * window + full * frame_patches  # keys per query, all blocks
    return float(6 * weights + 12 * d * pairs) * patches


def train_step_flops(m: ModelConfig, batch_size: int, seq_len: int,
                     vision_patches: int = 0, frame_patches: int = 0) -> float:
    """Model FLOPs of one optimizer step (all devices together); ``vision_patches``: the
    vision tower's patch slots (a multimodal family), ``frame_patches`` a frame's."""
    per_token = 6 * matmul_params_per_token(m) + attention_flops_per_token(m, seq_len)
    tower = vision_flops(m, vision_patches, frame_patches) if vision_patches else 0.0
    return float(per_token) * batch_size * seq_len + tower


def active_params_per_token(cfg: ModelConfig) -> int:
    """Parameters a token passes through in one forward pass (MoE layers count only the
    A routed experts, the router and the shared expert); the embedding lookup is excluded,
    the output head and the norm scales included."""
    d, h = cfg.d_model, cfg.head_dim
    norms = 2 * h if cfg.qk_norm else 0
    mixers = cfg.layer_mixers()
    layers = sum(mixer_matmul_params(cfg, mixers[i]) + (norms if mixers[i] == "A" else 0)
                 + 2 * d + mlp_matmul_params(cfg, i) for i in range(cfg.n_layers))
    return layers + d + d * cfg.vocab_size
