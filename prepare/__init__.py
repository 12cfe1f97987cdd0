"""Turning text into the token shards of ``shards.py``.

Scripts (run from the repo root, e.g. ``python prepare/shakespeare_char.py``): shakespeare_char.py,
shakespeare.py, text.py, openwebtext.py, fineweb.py. The modules they share: tiny_shakespeare.py (the
Shakespeare datasets, also used by train.py), local.py (text that fits in memory), hub.py (Hugging Face
corpora, streamed), writer.py (the dataset folder and its rules) and script.py (the common command line).
"""
