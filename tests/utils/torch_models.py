"""Random weights for the torch (transformers, peft) models the tests compare against: values
far from a fresh model's init, so that a mixed-up or dropped tensor changes the outputs."""
import re

# (name pattern, mean, std) rules for ``randomize``'s ``special``:
BIASES = (r"\.bias$", 0.0, 0.3)  # biases around 0 (transformers inits them to zeros)
ADAPTERS = ("lora_", 0.0, 0.2)   # peft's lora_A and lora_B


def randomize(module, seed: int, *, vector_mean: float = 1.0, special=(), only=None) -> None:
    """Redraws the parameters of a torch module in place, in ``named_parameters`` order, each
    from float32 standard normal noise of one generator seeded ``seed``: ``mean + std * noise``
    with the (mean, std) of the first rule of ``special`` whose pattern ``re.search``-es the
    parameter's name; else, for a vector (norm weights), ``vector_mean + 0.3 * noise``; else
    ``0.08 * noise``. With ``only`` (a pattern), a parameter whose name it does not match is
    left as it is and draws no noise."""
    import torch  # optional: the files that call this skip without it (pytest.importorskip)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if only is not None and not re.search(only, name):
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            mean, std = next(((m, s) for pattern, m, s in special if re.search(pattern, name)),
                             (vector_mean, 0.3) if p.ndim == 1 else (0.0, 0.08))
            p.copy_(std * noise if mean == 0 else mean + std * noise)
