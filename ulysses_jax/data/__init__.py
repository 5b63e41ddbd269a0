"""Data tools: ``python -m ulysses_jax.data prepare|show`` (see ``__main__.py``). The library
code lives in ``ulysses_jax.training`` (sources, prepare, store, packing, chat)."""
