"""Checkable tasks and their checkers, loaded by name from the config: what GRPO learns from (`objective=grpo`)
and what eval.py scores a task's held-out prompts with.

    task = load_task("tasks/arithmetic.py")                  # a file (or a module path: "tasks.arithmetic")
    check = load_checker("tasks/arithmetic.py:reward", time_limit=5.0)
    check(prompt, reply)                                    # -> float, or a CheckerError naming the prompt

A task is a Python file with `prompts(split, seed)` (split "train": an endless stream; "heldout": a fixed
list) and `reward(prompt, reply) -> float` (tasks/arithmetic.py). A checker is any such `reward` function,
named "path/to/file.py:function" or "package.module:function"; a relative file path is looked up from the
current directory, then from the checkout's root (where tasks/ is).

A checker is the user's code, run on the model's replies: whatever it does wrong becomes one CheckerError
naming the prompt, never a traceback. It may raise, return something that is not a finite number, or hang:
each call runs in a thread of its own and is given `time_limit` seconds (a thread that overruns is left
behind, a daemon, and the run stops with the error before it saves anything, so the checkpoints it already
wrote stay as they were).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from gptkit.errors import UserError

ROOT = Path(__file__).resolve().parents[1]  # the checkout: tasks/ lives here


class CheckerError(UserError):
    """A task or checker that cannot be loaded, or a checker call that raised, returned a non-number or hung."""


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def load_module(spec: str, what: str = "task") -> ModuleType:
    """The module a task or checker name points to: a .py file (relative: to the current directory, then to
    the checkout) or an importable module path."""
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        if not path.is_absolute() and not path.exists():
            path = ROOT / spec
        if not path.is_file():
            raise CheckerError(f"{what} file {spec!r} not found (looked in the current directory and in {ROOT}); "
                               f"name a Python file such as tasks/arithmetic.py")
        name = f"gptkit_task_{path.stem}_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            raise CheckerError(f"{what} file {spec!r} failed to load: {type(e).__name__}: {e}") from None
        sys.modules[name] = module
        return module
    try:
        return importlib.import_module(spec)
    except Exception as e:
        raise CheckerError(f"{what} module {spec!r} failed to import ({type(e).__name__}: {e}); name a file "
                           f"such as tasks/arithmetic.py or an importable module path") from None


@dataclass(frozen=True)
class Task:
    """A checkable task: its name (as the config gave it), its prompts, its reward function and the text that
    ends a reply (its STOP; None: only the tokenizer's end-of-text token, or max_tokens, ends one)."""

    name: str
    prompts: Callable[..., Iterator[str]]
    reward: Callable[[str, str], float]
    stop: str | None = None

    def stop_ids(self, tokenizer) -> frozenset[int]:
        """The tokens that end a reply: the tokenizer's end-of-text, and the task's STOP where it is one token."""
        ids = set() if tokenizer.eot_id is None else {tokenizer.eot_id}
        if self.stop:
            encoded = tokenizer.encode(self.stop)
            if len(encoded) != 1:
                raise CheckerError(f"task {self.name!r}: its STOP {self.stop!r} is {len(encoded)} tokens of this "
                                   f"model's tokenizer, not one; a reply can only stop on a single token")
            ids.add(encoded[0])
        return frozenset(ids)


def load_task(spec: str) -> Task:
    """The task `spec` names (a file or module with `prompts` and `reward`)."""
    module = load_module(spec)
    missing = [f for f in ("prompts", "reward") if not callable(getattr(module, f, None))]
    if missing:
        raise CheckerError(f"task {spec!r} lacks {' and '.join(missing)}(): a task defines prompts(split, seed) "
                           f"and reward(prompt, reply) (see tasks/arithmetic.py)")
    return Task(spec, module.prompts, module.reward, getattr(module, "STOP", None))


class Checker:
    """A reward function called safely: each call in a thread of its own, `time_limit` seconds at most; what
    it returns must be a finite real number (a bool counts as 0 or 1)."""

    def __init__(self, fn: Callable[[str, str], float], name: str, time_limit: float = 5.0):
        if not (isinstance(time_limit, (int, float)) and time_limit > 0):
            raise CheckerError(f"grpo_reward_timeout must be a positive number of seconds, got {time_limit!r}")
        self.fn, self.name, self.time_limit = fn, name, float(time_limit)

    def __call__(self, prompt: str, reply: str) -> float:
        box: dict = {}

        def call():
            try:
                box["value"] = self.fn(prompt, reply)
            except BaseException as e:  # (SystemExit too: a checker must not end the run)
                box["error"] = e

        worker = threading.Thread(target=call, daemon=True, name="gptkit-checker")
        worker.start()
        worker.join(self.time_limit)
        where = f"checker {self.name} on prompt {_short(prompt)}"
        if worker.is_alive():
            raise CheckerError(f"{where} did not return within {self.time_limit:g} s (grpo_reward_timeout); "
                               f"make it faster or raise the limit")
        if "error" in box:
            e = box["error"]
            raise CheckerError(f"{where} raised {type(e).__name__}: {' '.join(str(e).split())[:200]}; fix the "
                               f"checker (it is called with the prompt and the reply's text)")
        value = box["value"]
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise CheckerError(f"{where} returned {value!r:.80}, not a finite number; a checker returns a float "
                               f"reward (tasks/arithmetic.py: 1.0 right, 0.0 wrong)")
        return float(value)

    def score(self, prompts: list[str], replies: list[str]) -> list[float]:
        return [self(p, r) for p, r in zip(prompts, replies)]


def load_checker(spec: str, time_limit: float = 5.0) -> Checker:
    """The checker "file.py:function" or "module:function" names (the function defaults to `reward`)."""
    where, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "reward")
    if not where:
        raise CheckerError(f"checker {spec!r} names no file or module; write it as tasks/arithmetic.py:reward")
    fn = getattr(load_module(where, "checker"), attr or "reward", None)
    if not callable(fn):
        raise CheckerError(f"checker {spec!r}: {where} has no function {attr or 'reward'!r}")
    return Checker(fn, spec, time_limit)
