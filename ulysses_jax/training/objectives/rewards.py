"""GRPO's rewards and advantages: reward functions called as TRL's
GRPOTrainer calls them, their built-ins, and TRL's group-relative advantages.

A reward function is called ``f(prompts=..., completions=..., completion_ids=..., **columns)``
with one entry per completion in each list (the prompt repeated for each of its
completions; ``columns`` the prompt rows' other fields, repeated likewise) and returns one
float per completion, or None where it does not apply to a row. ``load`` takes a built-in's
name (``BUILTINS``) or a user function's import path, ``module:function``.

Advantages (``advantages``, TRL's default "sum_then_normalize"): the weighted sum of each
completion's rewards (a None skipped; a completion that every function skipped is left out
of the baselines and gets advantage 0), minus its group's mean (the ``num_generations``
completions of one prompt), divided by ``std + 1e-4`` where ``scale_rewards`` is ``group``
(the group's std) or ``batch`` (the std of all the rewards), not divided for ``none``. The
stds are the unbiased sample std (n - 1), as TRL's ``nanstd``.
"""
from __future__ import annotations

import importlib
import math
import re
import warnings
from typing import Callable, Sequence

import numpy as np

SCALES = ("group", "batch", "none")


class RewardError(ValueError):
    """A reward function that cannot be loaded, raises, or returns the wrong count (named)."""


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """A completion's final answer: the content of its last ``\\boxed{...}`` (nested braces
    kept whole), else its last number (thousands commas dropped), else None."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _same(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a.replace(",", "")), float(b.replace(",", "")),
                            rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return a.strip() == b.strip()


def _text(completion) -> str:
    """A completion's text: itself, or a conversational completion's message contents."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


def answer_match(completions, answer=None, **_) -> list[float | None]:
    """1.0 where the completion's ``final_answer`` equals the row's ``answer`` (numbers
    compared as numbers), else 0.0; None for a row without an ``answer``."""
    answers = answer if answer is not None else [None] * len(completions)
    out = []
    for completion, want in zip(completions, answers):
        if want is None:
            out.append(None)
            continue
        got = final_answer(_text(completion))
        out.append(float(got is not None and _same(got, str(want))))
    return out


def soft_overlong(max_length: int, cache: int) -> Callable:
    """DAPO's soft overlong punishment on completion token counts L: 0 up to
    ``max_length - cache`` tokens, falling linearly to -1 at ``max_length``, -1 beyond."""
    def reward(completion_ids, **_):
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= max_length - cache else
                       -1.0 if n > max_length else (max_length - cache - n) / cache)
        return out
    reward.__name__ = "soft_overlong"
    return reward


BUILTINS = ("answer_match", "soft_overlong")


def load(spec: str, max_completion_length: int = 0) -> Callable:
    """A reward function by built-in name or ``module:function`` import path."""
    if spec == "answer_match":
        return answer_match
    if spec == "soft_overlong":
        if max_completion_length < 4:
            raise RewardError(f"reward soft_overlong needs max_completion_length >= 4, got "
                              f"{max_completion_length}")
        return soft_overlong(max_completion_length, max_completion_length // 4)
    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        raise RewardError(f"reward function {spec!r} is neither a built-in "
                          f"({', '.join(BUILTINS)}) nor an import path module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"reward function {spec!r} cannot be imported: "
                          f"{type(e).__name__}: {e}") from None
    if not callable(fn):
        raise RewardError(f"reward function {spec!r} is a {type(fn).__name__}, not callable")
    return fn


def score(funcs: Sequence[tuple[str, Callable]], prompts: list, completions: list,
          completion_ids: list, columns: dict, first_row: int = 0) -> np.ndarray:
    """float64 [N, F]: each function's reward of each completion, NaN where it returned None.

    Raises:
      RewardError: a function raised (named, with the prompt rows of the call: ``first_row``
        on), returned something that is not a list of N numbers or None.
    """
    n = len(completions)
    out = np.full((n, len(funcs)), np.nan)
    for f, (name, fn) in enumerate(funcs):
        try:
            got = fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                     **columns)
        except Exception as e:  # noqa: BLE001 - user code: anything can come out of it
            raise RewardError(f"reward function {name} raised on the completions of prompt "
                              f"rows {first_row} to {first_row + n - 1}: "
                              f"{type(e).__name__}: {e}") from e
        if not isinstance(got, (list, tuple, np.ndarray)) or len(got) != n:
            what = f"{len(got)} values" if hasattr(got, "__len__") else type(got).__name__
            raise RewardError(f"reward function {name} must return one value per completion "
                              f"({n}), got {what}")
        for i, r in enumerate(got):
            if r is None:
                continue
            try:
                out[i, f] = float(r)
            except (TypeError, ValueError):
                raise RewardError(f"reward function {name} returned {r!r} for completion {i}: "
                                  f"a number or None is needed") from None
    return out


def _nanstd(x: np.ndarray, axis=None, keepdims=False) -> np.ndarray:
    """The unbiased std ignoring NaN (TRL's nanstd): NaN where fewer than 2 values."""
    count = np.sum(~np.isnan(x), axis=axis, keepdims=keepdims)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.nanmean((x - np.nanmean(x, axis=axis, keepdims=True)) ** 2, axis=axis,
                         keepdims=keepdims)
        return np.sqrt(var * count / (count - 1))


def advantages(per_func: np.ndarray, weights: Sequence[float], num_generations: int,
               scale: str = "group") -> tuple[np.ndarray, np.ndarray]:
    """(advantages [N], rewards [N]) from ``score``'s [N, F] (N = prompts x
    ``num_generations``, each prompt's completions together), as the module docstring says.
    A reward that every function skipped is NaN in ``rewards``."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALES)}, got {scale!r}")
    rewards = total(per_func, weights)
    groups = rewards.reshape(-1, num_generations)
    with warnings.catch_warnings():  # an all-NaN group's mean and std are NaN, quietly
        warnings.simplefilter("ignore", RuntimeWarning)
        adv = rewards - np.repeat(np.nanmean(groups, axis=1), num_generations)
        if scale != "none":
            adv = adv / (scales(rewards, num_generations, scale) + 1e-4)
    return np.nan_to_num(adv, nan=0.0), rewards


def total(per_func: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """float64 [N]: each completion's weighted sum of ``score``'s rewards (a None skipped),
    NaN where every function skipped it."""
    per_func = np.asarray(per_func, np.float64)
    rewards = np.nansum(per_func * np.asarray(weights, np.float64)[None], axis=1)
    rewards[np.isnan(per_func).all(axis=1)] = np.nan
    return rewards


def scales(rewards: np.ndarray, num_generations: int, scale: str) -> np.ndarray:
    """[N]: the std that divides each completion's advantage: its group's for ``group`` (and,
    for logging, ``none``), the whole batch's for ``batch`` (TRL's ``std_rewards``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if scale == "batch":
            return np.full_like(rewards, _nanstd(rewards))
        return np.repeat(_nanstd(rewards.reshape(-1, num_generations), axis=1),
                         num_generations)
