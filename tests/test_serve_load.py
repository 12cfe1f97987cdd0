"""benchmarks/serve_load.py's GPT-2-shaped random model: GPT-2 small's shape and vocabulary, loadable by serve.py,
with no tokenizer file to find. (The load itself starts serve.py: run by hand, see BENCHMARKS.md.)"""

from benchmarks import serve_load
from gptkit.checkpoint import load_model


def test_the_gpt2_shaped_random_model_loads_and_takes_the_prompt(tmp_path):
    folder = serve_load.write_checkpoint(tmp_path / "gpt2-random", "gpt2-random", n_layer=1)
    model, tokenizer, _ = load_model(str(folder))
    c = model.config
    assert (c.vocab_size, c.padded_vocab_size, c.n_embd, c.n_head, c.block_size, c.n_layer) == (
        50257, 50304, 768, 12, 1024, 1)
    ids = tokenizer.encode(serve_load.PROMPT)
    assert tokenizer.decode(ids) == serve_load.PROMPT and max(ids) < 96  # every prompt character is a token
    assert "\ufffd" not in tokenizer.decode(range(50257))  # no token a stream would hold back
