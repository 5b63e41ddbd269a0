"""ulysses-jax: DeepSpeed-Ulysses sequence parallelism for JAX on GPUs."""
from .kernels import local_attention, reference_attention
from .mesh import ACT_BS, DATA, SEQ, make_mesh
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention

__all__ = [
    "ACT_BS", "DATA", "SEQ", "make_mesh", "ulysses_attention", "reference_attention",
    "local_attention", "seq_to_heads", "heads_to_seq",
]
