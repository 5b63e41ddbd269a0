"""Interoperability, apart from the product core: Hugging Face checkpoint import and export
(``hf.py``, with the per-family config translations and tensor maps of ``hf_variants.py`` and
``hf_qwen3_next.py``) and the PyTorch-baseline harnesses (``compare.py``: DeepSpeed's
``DistributedAttention`` and transformers' models against ours; ``_ds_worker.py``: the torch
rank processes). ``ulysses_jax.hf`` and ``python -m ulysses_jax.compare`` keep working at their
old paths.
"""
