"""Each family's decoder block class, as its record names it (``families.Family.block``).

The record lives below the config in ``ulysses_jax/families.py``; the block classes are model
code and live in their modules beside this one (``llama.py``, ``gemma.py``,
``qwen3_next.py``). The decoder builds its layers from ``block_class``.
"""
from __future__ import annotations

from ..families import FAMILIES, load

BLOCKS = {name: load(f.block) for name, f in FAMILIES.items()}


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
