"""Checkable tasks (tasks/arithmetic.py) and their checkers loaded by name (gptkit/checker.py): the split is
deterministic and disjoint, the reward is right, and a checker that raises, returns a non-number or hangs is
one CheckerError naming the prompt."""

import threading

import pytest

from gptkit.checker import CheckerError, load_checker, load_task
from gptkit.errors import UserError


def test_arithmetic_split_is_seeded_and_disjoint():
    task = load_task("tasks/arithmetic.py")
    heldout = list(task.prompts("heldout", seed=0))
    assert len(heldout) == len(set(heldout)) == 200
    assert heldout == list(task.prompts("heldout", seed=0))
    assert heldout != list(task.prompts("heldout", seed=1))
    stream = task.prompts("train", seed=0)
    train = [next(stream) for _ in range(5000)]
    assert not set(train) & set(heldout)
    assert all(p.endswith("=") and "+" in p for p in train)
    again = task.prompts("train", seed=0)
    assert [next(again) for _ in range(50)] == train[:50]


def test_arithmetic_reward_checks_the_first_line():
    task = load_task("tasks.arithmetic")  # a module path works as a file path does
    assert task.reward("317+45=", "362\n") == 1.0
    assert task.reward("317+45=", "362") == 1.0
    assert task.reward("317+45=", "362\n999") == 1.0  # only the reply's first line counts
    for wrong in ("361\n", "0362\n", " 362\n", "", "36"):
        assert task.reward("317+45=", wrong) == 0.0


def test_checker_by_file_and_function(tmp_path):
    f = tmp_path / "check.py"
    f.write_text("def exact(prompt, reply):\n    return float(reply == 'yes')\n")
    check = load_checker(f"{f}:exact")
    assert check.score(["a", "b"], ["yes", "no"]) == [1.0, 0.0]
    assert load_checker("tasks/arithmetic.py:reward")("1+1=", "2\n") == 1.0
    assert load_checker("tasks/arithmetic.py")("1+1=", "3\n") == 0.0  # the function defaults to reward
    with pytest.raises(CheckerError, match="not found"):
        load_checker("tasks/nothing.py:reward")
    with pytest.raises(CheckerError, match="no function 'nope'"):
        load_checker(f"{f}:nope")


@pytest.mark.parametrize("body, says", [
    ("raise KeyError('boom')", "raised KeyError: 'boom'"),
    ("return 'right'", "returned 'right', not a finite number"),
    ("return float('nan')", "not a finite number"),
    ("return None", "returned None"),
    ("import time\n    time.sleep(30)", "did not return within 0.2 s"),
])
def test_a_bad_checker_is_one_line_naming_the_prompt(tmp_path, body, says):
    f = tmp_path / "bad.py"
    f.write_text(f"def reward(prompt, reply):\n    {body}\n")
    check = load_checker(f"{f}:reward", time_limit=0.2)
    with pytest.raises(CheckerError) as e:
        check("12+34=", "46\n")
    message = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in message
    assert "on prompt '12+34='" in message and says in message


def test_bools_and_ints_are_numbers(tmp_path):
    f = tmp_path / "b.py"
    f.write_text("def reward(prompt, reply):\n    return reply == 'x'\ndef two(p, r):\n    return 2\n")
    assert load_checker(f"{f}")("p", "x") == 1.0
    assert load_checker(f"{f}:two")("p", "x") == 2.0
    assert threading.active_count() < 50  # (each call's thread has ended)
