"""Head layouts for the exchange: which query and kv heads each of P devices attends with,
including head counts that P does not divide. Pure integer rules (no JAX), so the config
validates with them; the padding itself (``pad_heads``) is the exchange's, in attention/heads.py.

Letters as in models/decoder.py: N query heads, K kv heads, G = N // K query heads per kv
head, H head dim; P the all-to-all degree (the seq axis size U on a ring mesh: the ring never
splits heads).

The exchange hands device i a contiguous block of the query heads and of the kv heads (copies)
they read, so each device must get a whole number of both. The even layouts need no padding:
K % P == 0 (kv heads split) or P % K == 0 (each kv head copied P/K times, a local copy), with
N % P == 0. For any other N, K, P a layout is found by padding, with the outputs of the added
heads discarded (exact: an added query head's output is never used, so its cotangent is zero
and it adds nothing to any gradient; added kv heads are read only by added query heads):

  - K' >= K kv heads (zero heads appended), each copied R times before the exchange, with
    K' * R a multiple of P: every device gets K'R/P kv copies;
  - G' >= G query heads per kv head, a multiple of R (zero heads appended to each group):
    copy c of kv head k serves G'/R of the group's query heads, and every device gets
    N' / P = (K'R / P) (G' / R) query heads, each beside the copy it reads.

Among these, ``head_layout`` takes the one that exchanges the fewest heads per token,
2 N' + 2 K'R (q in, output back, k and v in), and of those the fewest query heads N' (the
attention compute grows as N'/N). Examples: 3 heads on 2 devices: 4 heads (K' = 4), 1.33x
exchange and compute; 12 query / 4 kv heads on 8 devices: 16 query heads (G' = 4, each kv head
copied twice), 1.33x compute; 6 query / 3 kv heads on 2 devices: no query padding at all, each
kv head copied twice. The only error left is N % K != 0, where no GQA grouping exists.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How N query and K kv heads are laid out over P devices (see the module docstring)."""
    n: int          # query heads N
    k: int          # kv heads K
    p: int          # all-to-all degree P
    k_pad: int      # kv heads after padding, K'
    g_pad: int      # query heads per kv head after padding, G' (a multiple of reps)
    reps: int       # copies of each kv head before the exchange, R

    @property
    def n_pad(self) -> int:
        """Query heads exchanged, N' = K' G'."""
        return self.k_pad * self.g_pad

    @property
    def kv_sent(self) -> int:
        """kv heads exchanged (copies included), K' R."""
        return self.k_pad * self.reps

    @property
    def padded(self) -> bool:
        return (self.k_pad, self.g_pad) != (self.k, self.n // self.k)

    @property
    def n_local(self) -> int:
        """Query heads each device attends with."""
        return self.n_pad // self.p

    @property
    def k_local(self) -> int:
        """kv heads (copies) each device attends with."""
        return self.kv_sent // self.p

    def exchanged_heads(self) -> int:
        """Heads moved per token and layer, forward: q in, output back, k and v in."""
        return 2 * self.n_pad + 2 * self.kv_sent

    def describe(self) -> str:
        """One line: the padding and what it costs against the unpadded head counts."""
        if not self.padded:
            return f"{self.n} query / {self.k} kv heads over {self.p} devices: no padding"
        return (f"{self.n} query / {self.k} kv heads over {self.p} devices: padded to "
                f"{self.n_pad} query / {self.k_pad} kv heads (kv copies {self.reps}), "
                f"attention compute x{self.n_pad / self.n:.2f}; {self.exchanged_heads()} heads "
                f"exchanged per token, {2 * self.n + 2 * self.k} without padding or kv copies")


def head_layout(n: int, k: int, p: int, ring: int = 1) -> HeadLayout:
    """The layout of ``n`` query and ``k`` kv heads over ``p`` devices.

    Args:
      n, k: query and kv heads; n % k == 0.
      p: the all-to-all degree (seq axis size).
      ring: the ring axis size, for the message only (the ring does not split heads).

    Returns:
      A HeadLayout; the even layouts (no padding) whenever they exist.

    Raises:
      ValueError: n not a multiple of k.
    """
    if n % k:
        note = "" if ring == 1 else f" (ring axis size {ring})"
        raise ValueError(f"query heads {n} not divisible by kv heads {k} (GQA needs a whole "
                         f"number of query heads per kv head){note}")
    g = n // k
    if n % p == 0 and (k % p == 0 or p % k == 0):
        return HeadLayout(n, k, p, k, g, 1 if k % p == 0 else p // k)
    best = None
    for k_pad in range(k, -(-k // p) * p + 1):
        for reps in range(1, p + 1):
            if (k_pad * reps) % p:
                continue
            lay = HeadLayout(n, k, p, k_pad, -(-g // reps) * reps, reps)
            key = (lay.exchanged_heads(), lay.n_pad, lay.kv_sent)
            if best is None or key < best[0]:
                best = (key, lay)
    return best[1]
