"""lm-evaluation-harness against serve.py, end to end: `lm_eval --model local-completions` (the harness's
client for any OpenAI-compatible server: /v1/completions with echo and logprobs) scores a tiny
multiple-choice task of our own, a YAML task over a local JSONL file (nothing is downloaded), and its
loglikelihoods equal eval.py's scoring code (gptkit/hellaswag.py's ending_losses) on the same items.

The model is a random character-level one; the harness tokenizes with its Hugging Face tokenizer files
(gptkit/hf_tokenizer.py, as export.py writes them), loaded offline from a folder."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import torch_threads

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is a dev dependency: pip install -e \".[dev]\"")
pytest.importorskip("transformers", reason="the harness loads the tokenizer with it")
from test_serve import CHARS, Server, save  # noqa: E402  (after the skips: the server's packages are optional)

from gptkit.hellaswag import Encoded, ending_losses  # noqa: E402
from gptkit.hf_tokenizer import hf_tokenizer_files  # noqa: E402
from gptkit.runtime import Runtime  # noqa: E402
from gptkit.tokenizer import Tokenizer  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

BLOCK = 64
ITEMS = [  # context, four choices, the right one
    {"context": "The cat sat on the", "choices": ["mat.", "moon!", "sky", "a chair"], "label": 0},
    {"context": "One, two, three,", "choices": ["four", "ten", "zebra", "42"], "label": 0},
    {"context": "To be or not to be:", "choices": ["that is the question", "yes", "no", "maybe so"], "label": 0},
    {"context": "x = 1 + 1 =", "choices": ["2", "11", "3", "x"], "label": 0},
]
TASK = """task: gptkit_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

# The harness's own command line (`lm_eval`, as `python -m lm_eval` runs it), its task index told to leave out the
# harness's built-in tasks: reading their ~14,000 YAML files is most of a run's time, and the task scored here is
# the one in --include_path.
HARNESS = """
import sys
from lm_eval.__main__ import cli_evaluate
from lm_eval.tasks import TaskManager
init = TaskManager.__init__
TaskManager.__init__ = lambda self, *args, **kwargs: init(self, *args, **{"include_defaults": False, **kwargs})
sys.argv[0] = "lm_eval"
cli_evaluate()
"""


def test_lm_eval_loglikelihoods_equal_evals(tmp_path):
    tokenizer = Tokenizer({"kind": "char", "chars": CHARS}).with_special(["<|endoftext|>"])
    torch.manual_seed(7)
    model = GPT(GPTConfig(block_size=BLOCK, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2,
                          n_embd=32)).eval()
    ckpt = save(tmp_path / "out-tiny", model, tokenizer)
    hf = tmp_path / "hf-tokenizer"
    hf.mkdir()
    for name, text in hf_tokenizer_files(tokenizer, model_max_length=BLOCK).items():
        (hf / name).write_text(text, encoding="utf-8")
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS), encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gptkit_tiny.yaml").write_text(TASK.format(data=data), encoding="utf-8")

    server = Server(ckpt, "--max_batch=4", "--max_queue=4").ready()
    try:
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        model_args = (f"model={server.model},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={hf},max_length={BLOCK},max_retries=1")
        # batch_size 4: four scored prompts per request, as token ids (the harness's own tokenization).
        command = [sys.executable, "-c", HARNESS, "--model", "local-completions", "--model_args", model_args,
                   "--tasks", "gptkit_tiny", "--include_path", str(tasks), "--batch_size", "4",
                   "--output_path", str(tmp_path / "results"), "--log_samples"]
        done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        server.stop()

    [samples] = (tmp_path / "results").rglob("samples_gptkit_tiny_*.jsonl")
    harness = {}
    for line in samples.read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):  # one per choice, in order
            harness[args["arg_0"], args["arg_1"]] = float(resp[0][0])  # (loglikelihood, is_greedy)
    assert len(harness) == 4 * len(ITEMS)

    # eval.py's scoring: the summed cross-entropy of each choice's tokens after the context.
    encoded = []
    for item in ITEMS:
        context = tokenizer.encode(item["context"])
        endings = [tokenizer.encode(" " + c) for c in item["choices"]]
        encoded.append(Encoded(rows=tuple(tuple(context + e) for e in endings),
                               ending_lengths=tuple(len(e) for e in endings), label=item["label"]))
    with torch.no_grad(), torch_threads(1):
        totals, _ = ending_losses(model, encoded, Runtime(device=torch.device("cpu"), dtype=torch.float32))
    right = 0
    for item, losses in zip(ITEMS, totals.tolist()):
        for choice, loss in zip(item["choices"], losses):
            assert math.isclose(harness[item["context"], " " + choice], -loss, abs_tol=1e-4), (item, choice)
        right += min(range(4), key=lambda i: losses[i]) == item["label"]
    [results] = (tmp_path / "results").rglob("results_*.json")
    assert json.loads(results.read_text())["results"]["gptkit_tiny"]["acc,none"] == right / len(ITEMS)

