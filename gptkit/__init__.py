"""gptkit: the library behind the scripts at the top of the repository (train.py, sample.py, eval.py, ...).

Each module has one topic; README.md's file map lists them. Imports point down: scripts -> gptkit -> model.py,
with no circle and nothing here importing a script (tests/test_imports.py checks it). model.py, the GPT in one
file, sits beside this package and imports nothing from it at its top; the one exception to the direction is
its nanoGPT-style API: GPT.from_pretrained and GPT.generate import gptkit.hf_gpt2 and gptkit.generate when
called. Importing the package does nothing.
"""
