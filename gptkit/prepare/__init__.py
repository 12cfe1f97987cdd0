"""The library side of the prepare/ scripts: turning text into the token shards of ``gptkit/shards.py``.

tiny_shakespeare.py (the two Shakespeare datasets, also prepared on the fly by train.py), local.py (text that
fits in memory), hub.py (Hugging Face corpora, streamed), writer.py (the dataset folder and its rules) and
script.py (the command line every prepare script shares).
"""
