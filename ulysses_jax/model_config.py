"""The model section of the run configuration (``model.*``): the decoder's shape and runtime
options, RoPE scaling and the vision tower, and the rules that only concern them (which
variant keys fit which family, scalings, mixture of experts). ``config.py`` holds the rest of
the run configuration and re-exports everything here, so ``ulysses_jax.config.ModelConfig``
and the others keep their names.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .families import traits

LAYER_KINDS = "LG"  # local (sliding window), global
MIXERS = "DA"  # token mixers of qwen3_next layers: D Gated DeltaNet, A full attention
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # models/rope.py
ROPE_EXACT_FROM = 2**17  # positions from which RoPE angles are reduced exactly (models/rope.py)


@dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE scaling for context extension (models/rope.py), transformers' rope_parameters.

    Each type reads only its own fields: linear factor; llama3 factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings; yarn factor,
    original_max_position_embeddings, beta_fast, beta_slow, attention_factor, mscale,
    mscale_all_dim, truncate.
    """
    type: str = "default"           # default | linear | llama3 | yarn
    factor: float = 1.0             # context length x factor (>= 1)
    original_max_position_embeddings: int = 0  # the pretraining length (llama3, yarn)
    low_freq_factor: float = 1.0    # llama3: wavelengths > original / this are divided by factor
    high_freq_factor: float = 4.0   # llama3: wavelengths < original / this are kept
    beta_fast: float = 32.0         # yarn: dims with more turns than this are kept
    beta_slow: float = 1.0          # yarn: dims with fewer turns than this are interpolated
    attention_factor: float = 0.0   # yarn: cos / sin factor; 0 = from factor (and mscale)
    mscale: float = 0.0             # yarn: with mscale_all_dim, attention factor
    mscale_all_dim: float = 0.0     # (0.1 m ln f + 1) / (0.1 m_all ln f + 1); 0 = unset
    truncate: bool = True           # yarn: round the ramp's ends outwards to whole dims


def _local_scaling() -> RopeScalingConfig:
    return RopeScalingConfig(type="")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a multimodal family (Qwen2.5-VL, models/vision.py); its defaults are
    Qwen2.5-VL-7B's. Images are cut into patch x patch pixels over temporal_patch frames; each
    merge x merge block of patches becomes one token of the decoder."""
    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 3420
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112          # pixels per side of an attention window
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)  # blocks attending whole frames
    tokens_per_second: int = 2      # video: M-RoPE temporal positions per second
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Each device embeds its share of the batch's frames (then the features are gathered),
    # instead of every device embedding all of them (benchmarks/vision_memory.py).
    split: bool = True


# models/lora.py: the projections. gate/up/down: the dense MLP's and the shared expert's;
# experts: every routed expert's fused gate_up and its down projection (MoE layers);
# linear_qkvz / linear_ba / linear_out: Qwen3-Next's Gated DeltaNet in_proj_qkvz, in_proj_ba
# and out_proj. A target the model has no such projection for adapts nothing.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts", "linear_qkvz",
                "linear_ba", "linear_out")
LORA_GROUPS = ("embed", "norms", "head", "vision")  # extra groups a LoRA run may train
LORA_BASE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the dense projections (models/lora.py); rank 0 = off.

    Each chosen projection W gets A [in, rank] and B [rank, out]: its output becomes
    x W + s (x A) B with s = alpha / rank (alpha / sqrt(rank) with ``rslora``), B starting at
    zero. Only the adapters and the ``trainable`` groups are trained; every other parameter
    is frozen (no gradient, no optimizer state).
    """
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0            # only 0.0: adapter dropout is not implemented
    targets: tuple[str, ...] = LORA_TARGETS
    rslora: bool = False            # s = alpha / sqrt(rank) (rank-stabilised LoRA)
    # Extra groups trained in full (LongLoRA trains embeddings and norms): embed, norms, head,
    # vision (a multimodal model's whole vision tower; frozen otherwise).
    trainable: tuple[str, ...] = ()
    # Storage of the frozen layer matrices (the bulk of the weights); bfloat16 halves them.
    base_dtype: str = "float32"


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape and runtime options (compute dtype, remat, kernels, chunking)."""
    vocab_size: int = 257
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = False
    qkv_bias: bool = False          # biases on the q/k/v projections (Qwen2)
    tie_embeddings: bool = True
    dtype: str = "float32"          # compute dtype; parameters are always float32
    # Recomputation in the backward pass: auto | none | full | save_dots | save_attention
    # (full but cuDNN's attention forward) | offload (dots to host memory). auto: the least that fits, chosen when a run starts (training/fit.py);
    # a program built outside a run's start (inference, a step built by hand) recomputes
    # nothing under auto (``remat_policy``).
    remat: str = "auto"
    # With remat=full: keep each layer's input (the checkpoint the backward pass recomputes
    # the layer from) in host memory instead of the device's.
    offload_checkpoints: bool = False
    attn_impl: str = "auto"         # see ulysses_jax.attention.kernels.resolve_impl
    # Bound on documents per packed row for cuDNN's packed layout (GPU); rows with more run
    # an exact fallback kernel. 0 = from the data: 1.5 x the most any row of the first epoch
    # holds, rounded up to a multiple of 8 (64 where no data is loaded, e.g. --dry-run).
    max_segments: int = 0
    loss_chunk: int = 1024          # tokens per device per chunk of the loss and embedding
    vocab_parallel: bool = True     # split embedding and head over the sequence devices
    mlp_chunk: int = 0              # tokens per device per MLP chunk (TiledMLP); 0 = untiled
    init_std: float = 0.02
    # Attention variants and the Gemma block (models/gemma.py); the defaults are Llama's.
    family: str = "llama"           # llama (Llama, Mistral, Qwen2/3) | gemma (Gemma 2 and 3)
    sliding_window: int = 0         # keys a local layer's query sees, itself included; 0 = none
    layer_pattern: str = ""         # kinds, repeated over the layers: L local, G global; "" =
                                    # all L with a sliding_window, else all G
    rope_local_theta: float = 0.0   # RoPE base of local layers (Gemma 3); 0 = rope_theta
    # RoPE scaling of global layers, and of local ones (Gemma 3 scales only its global
    # layers); rope_local_scaling.type "" = as rope_scaling.
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    rope_local_scaling: RopeScalingConfig = field(default_factory=_local_scaling)
    # Positions from which RoPE angles are reduced modulo a turn before rounding (accurate at
    # millions of positions; models/rope.py); below it transformers' fp32(position x
    # inv_freq). 0 = exact everywhere; 2147483647 = transformers' everywhere.
    rope_exact_from: int = ROPE_EXACT_FROM
    attn_scale: float = 0.0         # softmax scale of q.k; 0 = head_dim ** -0.5
    attn_softcap: float = 0.0       # tanh cap on attention logits (Gemma 2); 0 = none
    final_softcap: float = 0.0      # tanh cap on the output logits (Gemma 2); 0 = none
    # Mixture of experts (Qwen3-MoE; models/moe.py). num_experts 0 = a dense model. Layer i is
    # an MoE layer when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
    # the others keep the dense MLP of ffn_dim. Experts are split over all mesh devices.
    num_experts: int = 0
    num_experts_per_tok: int = 2    # top-k
    moe_ffn_dim: int = 64           # each expert's SwiGLU width (moe_intermediate_size)
    norm_topk_prob: bool = False    # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the objective
    # Slots per (device, expert) = ceil(factor * tokens per device * top-k / num_experts);
    # assignments past them are dropped (counted in metrics). 0 = never drop (slots = tokens
    # per device, the worst case).
    moe_capacity_factor: float = 0.0
    moe_shared_ffn_dim: int = 0     # a sigmoid-gated shared expert (Qwen3-Next); 0 = none
    # Qwen3-Next (family qwen3_next, models/qwen3_next.py): per-layer token mixers, repeated
    # over the layers (D Gated DeltaNet, A gated full attention); its linear-attention shape;
    # the fraction of head_dim that RoPE rotates in its attention layers.
    mixer_pattern: str = "DDDA"
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    linear_conv: int = 4            # short convolution width
    partial_rotary_factor: float = 1.0
    # Qwen2.5-VL (family qwen2_5_vl, models/vision.py): M-RoPE's frequency runs (temporal,
    # height, width; they sum to head_dim / 2), the placeholder tokens whose embeddings the
    # vision features replace, and the vision tower.
    mrope_section: tuple[int, ...] = (16, 24, 24)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    vision: VisionConfig = field(default_factory=VisionConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def rope(self, kind: str) -> tuple[float, RopeScalingConfig]:
        """(RoPE base, scaling) of a layer of kind L (local) or G (global)."""
        if kind != "L":
            return self.rope_theta, self.rope_scaling
        local = self.rope_local_scaling
        return self.rope_local_theta or self.rope_theta, local if local.type else self.rope_scaling

    @property
    def remat_policy(self) -> str:
        """The recomputation the model's programs apply: ``remat``, with an unresolved
        ``auto`` as none."""
        return "none" if self.remat == "auto" else self.remat

    def layer_kinds(self) -> str:
        """One letter per layer, L (sliding window) or G (whole causal prefix)."""
        if not self.sliding_window:
            return "G" * self.n_layers
        pattern = self.layer_pattern or "L"
        return (pattern * -(-self.n_layers // len(pattern)))[:self.n_layers]

    def layer_mixers(self) -> str:
        """One letter per layer: D (Gated DeltaNet, qwen3_next only) or A (attention)."""
        if not traits(self.family).linear_attention:
            return "A" * self.n_layers
        pattern = self.mixer_pattern
        return (pattern * -(-self.n_layers // len(pattern)))[:self.n_layers]


def model_errors(m: ModelConfig) -> list[str]:
    """Messages for model keys that cannot work together (variants, families, scalings)."""
    return (_variant_errors(m) + rope_scaling_errors(m.rope_scaling, "model.rope_scaling")
            + rope_scaling_errors(m.rope_local_scaling, "model.rope_local_scaling",
                                  local=True))


def _variant_errors(m: ModelConfig) -> list[str]:
    """Messages for attention-variant keys that cannot work (see ModelConfig)."""
    errors = [f"model.{k} must be 0 (off) or positive, got {v}"
              for k, v in (("sliding_window", m.sliding_window),
                           ("rope_local_theta", m.rope_local_theta),
                           ("attn_scale", m.attn_scale), ("attn_softcap", m.attn_softcap),
                           ("final_softcap", m.final_softcap)) if v < 0]
    bad = sorted(set(m.layer_pattern) - set(LAYER_KINDS))
    if bad:
        errors.append(f"model.layer_pattern {m.layer_pattern!r} has {bad}; use L (local, "
                      f"sliding window) and G (global)")
    elif "L" in m.layer_pattern and not m.sliding_window:
        errors.append(f"model.layer_pattern {m.layer_pattern!r} has local layers (L) but "
                      f"model.sliding_window is 0")
    if m.sliding_window and not traits(m.family).sliding_windows:
        errors.append(f"model.family={m.family} has no sliding-window layers; set "
                      f"model.sliding_window=0, got {m.sliding_window}")
    errors += _qwen3_next_errors(m)
    errors += _vision_errors(m)
    errors += lora_errors(m)
    if not traits(m.family).experts and m.num_experts:
        errors.append(f"model.family={m.family} has no mixture-of-experts layers (the MoE block "
                      f"is Qwen3-MoE's); set model.num_experts=0, got {m.num_experts}")
    return errors


def lora_errors(m: ModelConfig) -> list[str]:
    """Rules of the ``model.lora`` keys (none apply beyond the rank when it is 0)."""
    lo = m.lora
    if lo.rank < 0:
        return [f"model.lora.rank must be 0 (off) or positive, got {lo.rank}"]
    if lo.rank == 0:
        return [] if not lo.trainable else [
            f"model.lora.trainable {list(lo.trainable)} needs adapters: set model.lora.rank "
            f"> 0 (with rank 0 every parameter is trained)"]
    errors = []
    if not lo.alpha > 0:
        errors.append(f"model.lora.alpha must be positive, got {lo.alpha}")
    if lo.dropout != 0.0:
        errors.append(f"model.lora.dropout must be 0.0: adapter dropout is not implemented "
                      f"yet, got {lo.dropout}")
    bad = [t for t in lo.targets if t not in LORA_TARGETS]
    if bad or not lo.targets or len(set(lo.targets)) != len(lo.targets):
        errors.append(f"model.lora.targets {list(lo.targets)} must be a non-empty list of "
                      f"distinct projections from {list(LORA_TARGETS)}")
    bad = [g for g in lo.trainable if g not in LORA_GROUPS]
    if bad:
        errors.append(f"model.lora.trainable {list(lo.trainable)} has {bad}; the groups are "
                      f"{list(LORA_GROUPS)}")
    if "head" in lo.trainable and m.tie_embeddings:
        errors.append("model.lora.trainable names 'head', but the head is the embedding "
                      "(model.tie_embeddings=true): name 'embed' instead")
    if lo.base_dtype not in LORA_BASE_DTYPES:
        errors.append(f"model.lora.base_dtype must be one of {', '.join(LORA_BASE_DTYPES)}, "
                      f"got {lo.base_dtype!r}")
    # Adapters exist for every family: llama (dense, MoE, Qwen2.5-VL's decoder), gemma and
    # qwen3_next.
    if "vision" in lo.trainable and not traits(m.family).vision:
        errors.append(f"model.lora.trainable names 'vision', but model.family={m.family} has "
                      f"no vision tower")
    return errors


def _qwen3_next_errors(m: ModelConfig) -> list[str]:
    """Rules of the linear-attention (Qwen3-Next) keys, for families that have them."""
    if not traits(m.family).linear_attention:
        return []
    errors = []
    bad = sorted(set(m.mixer_pattern) - set(MIXERS))
    if bad or not m.mixer_pattern:
        errors.append(f"model.mixer_pattern {m.mixer_pattern!r} must be a non-empty string of "
                      f"D (Gated DeltaNet) and A (full attention)")
    for key in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim",
                "linear_conv"):
        if getattr(m, key) < 1:
            errors.append(f"model.{key} must be positive, got {getattr(m, key)}")
    if not errors and m.linear_value_heads % m.linear_key_heads:
        errors.append(f"model.linear_value_heads {m.linear_value_heads} is not divisible by "
                      f"model.linear_key_heads {m.linear_key_heads}")
    rotary = int(m.head_dim * m.partial_rotary_factor)
    if not 0 < m.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2:
        errors.append(f"model.partial_rotary_factor {m.partial_rotary_factor} must be in (0, 1] "
                      f"and rotate an even number of head dims (model.head_dim {m.head_dim} x "
                      f"{m.partial_rotary_factor} = {rotary})")
    return errors


def _vision_errors(m: ModelConfig) -> list[str]:
    """Rules of the multimodal keys (M-RoPE, the vision tower), for families that have them."""
    if not traits(m.family).vision:
        return []
    v, errors = m.vision, []
    if sum(m.mrope_section) * 2 != m.head_dim or any(x < 0 for x in m.mrope_section):
        errors.append(f"model.mrope_section {list(m.mrope_section)} must be non-negative and "
                      f"sum to model.head_dim / 2 = {m.head_dim / 2:g}, got {sum(m.mrope_section)}")
    for key in ("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels",
                "patch_size", "temporal_patch_size", "spatial_merge_size", "window_size"):
        if getattr(v, key) < 1:
            errors.append(f"model.vision.{key} must be positive, got {getattr(v, key)}")
    if errors:
        return errors
    if v.hidden_size % v.num_heads or (v.hidden_size // v.num_heads) % 4:
        errors.append(f"model.vision.hidden_size {v.hidden_size} / num_heads {v.num_heads} must "
                      f"be a head dim divisible by 4 (2-D RoPE rotates a quarter per axis)")
    unit = v.spatial_merge_size * v.patch_size
    if v.window_size % unit:
        errors.append(f"model.vision.window_size {v.window_size} must be a multiple of "
                      f"spatial_merge_size x patch_size = {unit} pixels")
    bad = [i for i in v.fullatt_block_indexes if not 0 <= i < v.depth]
    if bad:
        errors.append(f"model.vision.fullatt_block_indexes {bad} are not blocks of a tower of "
                      f"depth {v.depth}")
    return errors


def rope_scaling_errors(s: RopeScalingConfig, key: str, local: bool = False) -> list[str]:
    """Messages for a RoPE scaling that cannot be computed (``key``: its dotted name)."""
    types = ROPE_TYPES + (("",) if local else ())
    if s.type not in types:
        shown = ", ".join(repr(t) for t in types)
        return [f"{key}.type must be one of {shown}, got {s.type!r}"]
    if s.type in ("", "default"):
        return [] if s.factor == 1.0 else [
            f"{key}.factor {s.factor} has no effect with {key}.type {s.type!r}; choose a type "
            f"(linear, llama3, yarn) or leave factor at 1"]
    errors = []
    if not s.factor >= 1.0:
        errors.append(f"{key}.factor must be >= 1 for type {s.type!r}, got {s.factor}")
    if s.type in ("llama3", "yarn") and s.original_max_position_embeddings < 1:
        errors.append(f"{key}.original_max_position_embeddings (the pretraining length) must "
                      f"be set for type {s.type!r}, got {s.original_max_position_embeddings}")
    if s.type == "llama3" and not 0 < s.low_freq_factor < s.high_freq_factor:
        errors.append(f"{key}: type 'llama3' needs 0 < low_freq_factor < high_freq_factor, "
                      f"got {s.low_freq_factor} and {s.high_freq_factor}")
    if s.type == "yarn":
        if not 0 < s.beta_slow < s.beta_fast:
            errors.append(f"{key}: type 'yarn' needs 0 < beta_slow < beta_fast, got "
                          f"beta_slow {s.beta_slow} and beta_fast {s.beta_fast}")
        errors += [f"{key}.{name} must be 0 (unset) or positive, got {v}"
                   for name, v in (("attention_factor", s.attention_factor),
                                   ("mscale", s.mscale), ("mscale_all_dim", s.mscale_all_dim))
                   if v < 0]
    return errors


def moe_errors(m: ModelConfig, devices: int) -> list[str]:
    """Rules of the mixture-of-experts keys (none apply when model.num_experts is 0)."""
    if m.num_experts < 0:
        return [f"model.num_experts must be 0 (dense) or positive, got {m.num_experts}"]
    if m.num_experts == 0:
        return []
    errors = []
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        errors.append(f"model.num_experts_per_tok must be in [1, model.num_experts "
                      f"{m.num_experts}], got {m.num_experts_per_tok}")
    for key, value in (("model.moe_ffn_dim", m.moe_ffn_dim),
                       ("model.decoder_sparse_step", m.decoder_sparse_step)):
        if value < 1:
            errors.append(f"{key} must be positive, got {value}")
    bad = [i for i in m.mlp_only_layers if not 0 <= i < m.n_layers]
    if bad:
        errors.append(f"model.mlp_only_layers {list(bad)} lie outside layers 0..{m.n_layers - 1}")
    if m.num_experts % devices:
        errors.append(f"model.num_experts {m.num_experts} is not divisible by the mesh's "
                      f"{devices} devices (mesh.data x mesh.ring x mesh.seq): experts are split "
                      f"evenly over all of them")
    for key, value in (("model.router_aux_loss_coef", m.router_aux_loss_coef),
                       ("model.moe_capacity_factor", m.moe_capacity_factor),
                       ("model.moe_shared_ffn_dim", m.moe_shared_ffn_dim)):
        if value < 0:
            errors.append(f"{key} must be >= 0, got {value}")
    return errors
