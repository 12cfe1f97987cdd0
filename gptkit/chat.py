"""The chat template, written once: conversations -> token ids for training data (prepare/chat.py), for
chat.py's prompts and for the server's (gptkit/serving/routes.py), so the three can never drift apart; and the
same template in Jinja for a Hugging Face export's tokenizer_config.json.

A conversation is a list of messages {"role": "system" | "user" | "assistant", "content": "..."}:

    <|endoftext|><|system|>Be brief.<|end|><|user|>Hi!<|end|><|assistant|>Hello.<|end|><|user|>...

The markers are the tokenizer's special tokens (gptkit/tokenizer.py CHAT_SPECIALS): ids that ordinary text
never produces, so a user typing "<|end|>" cannot end a turn. Each content is encoded on its own and placed
between its markers. A prompt for the next reply ends with <|assistant|>; the model's reply ends with <|end|>.
In training only the assistant's replies and their <|end|> carry loss (`render`'s `trained` flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptkit.errors import UserError

ROLES = ("system", "user", "assistant")
BEGIN, END = "<|endoftext|>", "<|end|>"

# The template in Jinja, for transformers' apply_chat_template: the same text, which a tokenizer with these
# special tokens (export.py writes them) turns into exactly `render`'s ids. (A content holding a marker's
# name is the one difference: a Hugging Face tokenizer reads it as the special token, ours as text.)
HF_CHAT_TEMPLATE = (
    "{{ '<|endoftext|>' }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


class ChatError(UserError):
    """A conversation that is not a list of {role, content} messages, or a tokenizer without chat tokens."""


@dataclass(frozen=True)
class ChatTokens:
    """The ids of the template's markers in one tokenizer."""

    begin: int
    end: int
    role: dict[str, int]

    @classmethod
    def of(cls, tokenizer: Any) -> ChatTokens:
        special = getattr(tokenizer, "special", {})
        names = [BEGIN, END, *(f"<|{r}|>" for r in ROLES)]
        missing = [n for n in names if n not in special]
        if missing:
            raise ChatError(f"this model's tokenizer has no chat tokens ({', '.join(missing)} missing): it is not "
                            f"a chat model; fine-tune it on conversations first (python prepare/chat.py, then "
                            f"train.py), or sample it as a text model with sample.py")
        return cls(special[BEGIN], special[END], {r: special[f"<|{r}|>"] for r in ROLES})

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end a reply: <|end|>, and any other marker (a reply never holds one: a model that
        writes <|user|> has skipped its <|end|>)."""
        return frozenset({self.end, self.begin, *self.role.values()})


def is_chat_tokenizer(tokenizer: Any) -> bool:
    """Whether the tokenizer has every special token of the template."""
    try:
        ChatTokens.of(tokenizer)
    except ChatError:
        return False
    return True


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, str]]:
    """The conversation as a list of {"role", "content"} dicts, or a ChatError naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where} must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"{where}[{i}] must be an object with a role and a content")
        if m.get("role") not in ROLES:
            raise ChatError(f"{where}[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ChatError(f"{where}[{i}].content must be a string, got {type(m.get('content')).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render(messages: list[dict[str, str]], tokenizer: Any, *,
           add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and, for each, whether it is trained: True for the content and <|end|> of
    assistant messages (what the model must learn to say), False for everything else (the context). With
    add_generation_prompt the ids end with <|assistant|>, where the next reply starts."""
    marks = ChatTokens.of(tokenizer)
    ids, trained = [marks.begin], [False]
    for m in check_messages(messages):
        content = tokenizer.encode(m["content"])
        learn = m["role"] == "assistant"
        ids += [marks.role[m["role"]], *content, marks.end]
        trained += [False] + [learn] * (len(content) + 1)
    if add_generation_prompt:
        ids.append(marks.role["assistant"])
        trained.append(False)
    return ids, trained


def prompt_ids(messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """The ids a model continues to answer the conversation's last message."""
    return render(messages, tokenizer, add_generation_prompt=True)[0]


def fit_history(messages: list[dict[str, str]], tokenizer: Any, budget: int, *,
                drop_to: int | None = None) -> list[dict[str, str]]:
    """The conversation with its oldest turns dropped (a leading system message is kept) until its prompt
    has at most `budget` tokens; whole messages go, never part of one. When some must go, they go until the
    prompt has at most `drop_to` tokens (default `budget`: the fewest), the last message always kept. chat.py
    and the chat page drop to half the budget: the history then starts the same way for the next several turns,
    so the engine reuses its keys and values (the prefix cache) instead of computing the whole history again at
    every turn once the conversation has filled the context. A ChatError when even the last message alone (with
    the system message) does not fit, saying how much of the room the system message takes."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    target = budget
    while turns:
        length = len(prompt_ids(system + turns, tokenizer))
        if length <= target or (length <= budget and len(turns) == 1):
            return system + turns
        if drop_to is not None and length > budget:  # some must go: then as many as drop_to says
            target = min(target, drop_to)
        turns = turns[1:]
    need = len(prompt_ids(system + messages[-1:], tokenizer))
    if not system:
        raise ChatError(f"the last message does not fit in the model's context: its prompt has {need} tokens, "
                        f"and a prompt may have {budget}; send a shorter one")
    taken = len(render(system, tokenizer)[0])  # <|endoftext|> and the system message, with its markers
    if taken + 3 > budget:  # (a message adds at least <|user|>, <|end|> and <|assistant|>)
        raise ChatError(f"the system message takes {taken} of the {budget} tokens a prompt may have: no message "
                        f"fits beside it; set a shorter system message")
    raise ChatError(f"the last message does not fit beside the system message: a prompt may have {budget} "
                    f"tokens, the system message takes {taken} of them and this message {need - taken} more; "
                    f"send a shorter message, or set a shorter system message")
