"""ulysses-jax: DeepSpeed-Ulysses sequence parallelism for JAX on GPUs."""
from .kernels import local_attention, reference_attention
from .mesh import DATA, RING, SEQ, act_spec, make_mesh, seq_axes
from .ring import hybrid_attention, inverse_zigzag_permutation, zigzag_permutation
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention

__all__ = [
    "DATA", "RING", "SEQ", "act_spec", "make_mesh", "seq_axes", "ulysses_attention",
    "hybrid_attention", "zigzag_permutation", "inverse_zigzag_permutation",
    "reference_attention", "local_attention", "seq_to_heads", "heads_to_seq",
]
