"""A run's data, from text to batches: one topic a module.

    shards.py     the token-shard files and meta.json: the format every prepared dataset is written in
    loader.py     a token dataset as training and validation batches (deterministic, resumable, DDP-aware)
    pairs.py      a preference dataset as batches of whole pairs (DPO), and an unpaired one's labels
    unpaired.py   an unpaired preference dataset as batches of rows and their KL sequences (KTO)
    prepare/      the pipelines behind the prepare/ scripts: text, chat and preference data -> shards

Importing the package runs nothing: import the module you need (`from gptkit.data import shards`).
"""
