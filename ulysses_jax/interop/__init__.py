"""Interoperability, apart from the product core: Hugging Face checkpoint import and export
(``hf.py``, with each family's config translation and tensor names in ``hf_<family>.py`` and
what they share in ``hf_variants.py``) and the PyTorch-baseline harnesses (``compare.py``: DeepSpeed's
``DistributedAttention`` and transformers' models against ours; ``_ds_worker.py``: the torch
rank processes). ``ulysses_jax.hf`` and ``python -m ulysses_jax.compare`` keep working at their
old paths.
"""
