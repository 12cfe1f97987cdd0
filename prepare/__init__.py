"""Scripts that turn text into a dataset folder of token shards (run from the repository root, e.g.
``python prepare/shakespeare_char.py``): shakespeare_char.py, shakespeare.py, text.py, openwebtext.py,
fineweb.py. What they share lives in ``gptkit/data/prepare/``.
"""
