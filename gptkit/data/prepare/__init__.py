"""The library side of the prepare/ scripts: turning text into the token shards of ``gptkit/data/shards.py``.

local.py (files and folders), hub.py (Hugging Face corpora) and tiny_shakespeare.py (the two Shakespeare
datasets, also prepared on the fly by train.py) describe their input as a stream of small tasks;
pipeline.py runs any such stream on worker processes (pool.py) into writer.py's dataset folder,
resumably, with a progress bar; cuts.py says where a long text can be cut without changing its tokens;
script.py is the command line every prepare script shares.
"""
