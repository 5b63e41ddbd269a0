"""The data pipeline, from raw files to the batches a train step reads.

``sources`` reads raw files (text, JSONL, parquet, datasets' arrow); ``prepare`` tokenizes them
into a token store (``store``), with chat masks (``chat``) and images or video (``media``,
``images``); ``text`` holds the tokenizers, the raw-text packer, the batch iterator and
``shard_batch``; ``packing`` plans a store's rows; ``vision_batches`` gives multimodal batches
static shapes; ``run_data`` builds a run's train and held-out data from its config. The CLI:
``python -m ulysses_jax.data prepare|show`` (``__main__.py``).
"""
