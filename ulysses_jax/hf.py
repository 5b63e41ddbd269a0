"""Hugging Face import and export, kept at this path for its public names
(``ulysses_jax.hf.from_pretrained``, ``save_pretrained``, ...): the code is
``ulysses_jax.interop.hf``."""
from .interop.hf import *  # noqa: F401,F403
from .interop.hf import (ARCHS, config_from_hf, config_to_hf, from_pretrained,  # noqa: F401
                         load_params, read_config, save_pretrained, to_hf_tensors)
