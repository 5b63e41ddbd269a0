"""``python -m ulysses_jax.compare deepspeed | hf``, kept at this path: the code is
``ulysses_jax.interop.compare``."""
import sys

from .interop.compare import *  # noqa: F401,F403
from .interop.compare import main

if __name__ == "__main__":
    sys.exit(main())
