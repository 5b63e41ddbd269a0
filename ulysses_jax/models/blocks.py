"""The family registry's model half: each family's decoder block class.

The traits of a family (what the config validates and the shared layers read) live below the
config in ``ulysses_jax/families.py``; the block classes are model code and live here, beside
the modules that define them. The decoder builds its layers from ``block_class``.
"""
from __future__ import annotations

from .gemma import GemmaBlock
from .llama import Block
from .qwen3_next import Qwen3NextBlock

BLOCKS = {
    "llama": Block,
    "gemma": GemmaBlock,
    "qwen3_next": Qwen3NextBlock,
    "qwen2_5_vl": Block,  # the Qwen2 text block; the vision tower is the decoder's (vision.py)
}


def block_class(name: str) -> type:
    """The decoder block class of the registered family ``name``.

    Raises:
      ValueError: ``name`` is not a registered family.
    """
    try:
        return BLOCKS[name]
    except KeyError:
        raise ValueError(f"model.family {name!r} has no decoder block; the blocks are "
                         f"{', '.join(BLOCKS)}") from None
