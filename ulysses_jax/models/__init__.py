"""Decoder families and what turns their hidden states into a loss (vocabulary split, chunked
cross-entropy)."""
