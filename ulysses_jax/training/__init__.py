"""From a config to a trained run: the train step, the optimizer, checkpoints, resume, the loop
(its data comes from ``ulysses_jax.data``)."""
