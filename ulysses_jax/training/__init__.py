"""From a config to a trained run: data packing, the train step, checkpoints, the loop."""
