"""gptkit: the library behind the scripts at the top of the repository (train.py, sample.py, eval.py, ...).

Each module has one topic; README.md's file map lists them. model.py, the GPT in one file, sits beside this
package and imports nothing from it. Importing the package does nothing.
"""
