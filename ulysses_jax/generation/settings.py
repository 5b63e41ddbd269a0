"""What a Hugging Face directory's generation_config.json and config.json say about
generation (stop ids, sampling defaults, positions), as transformers' ``generate`` reads
them: the CLI's defaults and the stop ids of GRPO's sampler."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

DEFAULT_MAX_NEW_TOKENS = 256


@dataclasses.dataclass
class Settings:
    """What generation_config.json gives, for the flags left unset."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()
    max_positions: int | None = None


# generation_config.json fields that change transformers' tokens, with their neutral values:
# a file that sets one is warned about, not silently followed in part.
UNSUPPORTED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0,
               "min_p": None, "typical_p": 1.0, "num_beams": 1, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0}


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    return out if isinstance(out, dict) else {}


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def model_settings(directory: str | None, tokenizer_eos: int | None) -> Settings:
    """Defaults of a Hugging Face directory's generation_config.json and config.json (none
    for a directory without them): as transformers' ``generate`` reads them."""
    gen = _read_json(os.path.join(directory, "generation_config.json")) if directory else {}
    cfg = _read_json(os.path.join(directory, "config.json")) if directory else {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    eos = _ids(gen.get("eos_token_id")) or _ids(text.get("eos_token_id")) \
        or _ids(cfg.get("eos_token_id")) or _ids(tokenizer_eos)
    s = Settings(eos_ids=eos, max_positions=text.get("max_position_embeddings"))
    ignored = {k: gen[k] for k, default in UNSUPPORTED.items()
               if gen.get(k) is not None and gen[k] != default}
    if ignored:
        print(f"warning: {directory}/generation_config.json sets "
              + ", ".join(f"{k}={v}" for k, v in ignored.items())
              + ", which this generator does not apply (transformers would)", file=sys.stderr)
    if gen.get("max_new_tokens"):
        s.max_new_tokens = int(gen["max_new_tokens"])
    if gen.get("do_sample"):  # transformers' defaults where the file is silent
        s.temperature = float(gen.get("temperature", 1.0))
        s.top_k = int(gen.get("top_k", 50) or 0)
        s.top_p = float(gen.get("top_p", 1.0))
    return s
