"""The serving engine's prefix cache: keys and values the engine has computed, kept for the next prompts that
start with the same tokens. Every chat client sends a conversation's whole history with each new message; with
the cache, the first token of a reply comes after the new message's tokens only, not after all of them again.

    cache = PrefixCache(model, bound=512 * 2**20)   # the model's KV cache's keys and values, at most 512 MiB
    found = cache.match(prompt)                     # the longest prefix of prompt held: found.length tokens
    cache.load(found, row)                          # -> slots 0..found.length-1 of that row of the KV cache
    cache.insert(tokens, row)                       # keep that row's first len(tokens) slots (what is new)

What is held is a radix tree over token ids: each node a run of tokens and their keys and values for every
layer, (layers, 2, heads, tokens, head_dim), its children the different ways the sequence goes on. A prefix
common to many sequences (one system message, many conversations; a prompt and its n choices) is held once,
and a prompt may match any number of a longer sequence's first tokens (the tree splits a node where a new
sequence leaves it). What is held is a copy: the engine's rows are never borrowed, so a row can be reused or
moved at any time and nothing held can change under a request.

The bound is in bytes (serve.py's --prefix_cache, in MiB): what the user has to spare is memory, and a token's
keys and values cost 100x more in one model than in another (GPT-2 small in float32: 72 KiB a token; a 6-layer
384-wide model: 18 KiB). When an insertion goes over it, the least recently used sequences' ends go first
(leaves of the tree, the oldest used first; a node is used when a match or an insertion passes through it), so
a prefix many prompts share stays longest.

Only the engine's thread calls these methods; the counters may be read from any thread (for /metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptkit.errors import UserError
from gptkit.runtime import ram

AUTO_SHARE = 4  # --prefix_cache=auto: a quarter of the memory available when the server starts ...
AUTO_MAX = 4 * 2**30  # ... and at most 4 GiB (~58,000 tokens of GPT-2 small in float32)


def auto_bound(device: torch.device) -> int:
    """The bound --prefix_cache=auto means, in bytes: a quarter of the memory available now (the GPU's free
    memory, or the machine's), at most AUTO_MAX. The cache only grows as conversations come, and a server
    that shares its machine should never take more than a part of what was free."""
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = ram()[1]
    return min(available // AUTO_SHARE, AUTO_MAX)


class PrefixCacheError(UserError):
    """A bound the machine cannot hold."""


def available_memory(device: torch.device) -> tuple[int, str]:
    """The bytes a cache on `device` could take now, and what they are, in words: the GPU's free memory, or
    the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {torch.cuda.get_device_name(device)}"
    total, available = ram()
    return available, f"available of this machine's {total / 2**30:.1f} GiB"


def check_bound(mib: int, device: torch.device) -> None:
    """--prefix_cache=MiB, refused in one line when it is more than the memory available now (the cache fills
    as conversations come, and would end the server with an out-of-memory error long after its start), with
    the largest that fits."""
    available, what = available_memory(device)
    if mib * 2**20 > available:
        raise PrefixCacheError(f"--prefix_cache={mib:,} MiB is more than the memory the cache could take: "
                               f"{available // 2**20:,} MiB {what}; the largest that fits is "
                               f"--prefix_cache={available // 2**20} (auto takes a quarter of it, at most "
                               f"{AUTO_MAX // 2**20:,})")


def token_bytes(model: torch.nn.Module) -> int:
    """The bytes of one token's keys and values in `model`'s KV cache (setup_kv_cache's: every layer, in the
    model's cache_dtype), to size a bound in tokens."""
    c = model.config
    return c.n_layer * 2 * c.n_embd * model.cache_dtype().itemsize


@dataclass(eq=False)
class _Node:
    tokens: list[int]  # the run of tokens this node adds to its parent's sequence
    kv: torch.Tensor | None  # their keys and values, (layers, 2, heads, len(tokens), head_dim); None: the root
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # by each child's first token
    used: int = 0  # the cache's clock when a match or an insertion last passed through


@dataclass
class Match:
    """The longest held prefix of a sequence: `length` tokens, taken from the nodes of `path` (a node and how
    many of its tokens; the last may be a part of a node). Valid until the next insert."""

    length: int = 0
    path: list[tuple[_Node, int]] = field(default_factory=list)


def common_length(a: list[int], b: list[int]) -> int:
    """How many first tokens a and b have in common."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # (the usual case, compared in C)
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Keys and values of token sequences, copied from and into the rows of `model`'s KV cache (set up
    before), at most `bound` bytes of them (see the module docstring).

    Counters (since it was made): lookups and hits (prompts looked up; those that reused any tokens, counted
    by the engine through `count`), prompt_tokens and reused_tokens (the prompts' tokens; those whose keys and
    values were reused instead of computed), inserted_tokens and evicted_tokens."""

    def __init__(self, model: torch.nn.Module, bound: int):
        if bound < 0:
            raise ValueError(f"the prefix cache's bound must be >= 0 bytes, got {bound}")
        self.model, self.bound = model, bound
        first = self._caches()[0].k  # (rows, heads, slots, head_dim)
        self.layers, self.heads, self.head_dim = len(self._caches()), first.size(1), first.size(3)
        self.dtype, self.device = first.dtype, first.device
        self.token_bytes = self.layers * 2 * self.heads * self.head_dim * first.element_size()  # (= token_bytes())
        self.root = _Node([], None, None)
        self.bytes = 0  # held now
        self._leaves: set[_Node] = set()
        self._clock = 0
        self.lookups = self.hits = self.prompt_tokens = self.reused_tokens = 0
        self.inserted_tokens = self.evicted_tokens = 0

    def _caches(self) -> list:
        return [block.attn.kv_cache for block in self.model.transformer.h]

    @property
    def tokens(self) -> int:
        """The tokens whose keys and values are held."""
        return self.bytes // self.token_bytes

    # ---- finding and loading

    def match(self, tokens: list[int]) -> Match:
        """The longest prefix of `tokens` held (every node it passes through counts as used now)."""
        self._clock += 1
        found, node, i = Match(), self.root, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            k = common_length(child.tokens, tokens[i:])
            child.used = self._clock
            found.path.append((child, k))
            i += k
            if k < len(child.tokens):
                break
            node = child
        found.length = i
        return found

    def load(self, found: Match, row: int) -> None:
        """Write the matched tokens' keys and values into slots 0..found.length-1 of `row` of every layer's
        KV cache."""
        caches, at = self._caches(), 0
        for node, k in found.path:
            for layer, cache in enumerate(caches):
                cache.k[row, :, at: at + k] = node.kv[layer, 0, :, :k]
                cache.v[row, :, at: at + k] = node.kv[layer, 1, :, :k]
            at += k

    def count(self, prompt_tokens: int, reused: int) -> None:
        """One prompt looked up by the engine: its tokens, and how many of them it did not compute."""
        self.lookups += 1
        self.hits += reused > 0
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += reused

    # ---- keeping

    def insert(self, tokens: list[int], row: int) -> None:
        """Keep the keys and values in slots 0..len(tokens)-1 of `row` (of every layer), which hold `tokens`:
        only what is not held yet is copied (as much of it as the bound allows), then the least recently
        used sequences' ends go until the bound holds."""
        if self.bound < self.token_bytes:
            return
        self._clock += 1
        tokens = tokens[: self.bound // self.token_bytes]  # a sequence's beginning is what prompts share
        node, i = self.root, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            k = common_length(child.tokens, tokens[i:])
            if k < len(child.tokens):
                self._split(child, k)
            child.used = self._clock
            node, i = child, i + k
        if i < len(tokens):
            new = tokens[i:]
            kv = torch.empty((self.layers, 2, self.heads, len(new), self.head_dim), dtype=self.dtype,
                             device=self.device)
            for layer, cache in enumerate(self._caches()):
                kv[layer, 0] = cache.k[row, :, i: len(tokens)]
                kv[layer, 1] = cache.v[row, :, i: len(tokens)]
            leaf = _Node(new, kv, node, used=self._clock)
            node.children[new[0]] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self.bytes += kv.nbytes
            self.inserted_tokens += len(new)
        self._evict()

    def _split(self, node: _Node, k: int) -> None:
        """Cut node after its first k tokens: it keeps those, and a new child of it the rest (with node's
        children). Both parts are copies, so that either can be freed alone."""
        head, rest = node.kv[:, :, :, :k].clone(), node.kv[:, :, :, k:].clone()  # (both before any change)
        tail = _Node(node.tokens[k:], rest, node, node.children, node.used)
        for child in tail.children.values():
            child.parent = tail
        node.tokens, node.kv, node.children = node.tokens[:k], head, {tail.tokens[0]: tail}
        if node in self._leaves:
            self._leaves.discard(node)
            self._leaves.add(tail)

    def _evict(self) -> None:
        """Remove the least recently used leaves until the bound holds."""
        while self.bytes > self.bound and self._leaves:
            leaf = min(self._leaves, key=lambda n: n.used)
            self.remove(leaf)

    def remove(self, leaf: _Node) -> None:
        """Forget a leaf (its parent may become one)."""
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        self._leaves.discard(leaf)
        self.bytes -= leaf.kv.nbytes
        self.evicted_tokens += len(leaf.tokens)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)

    def reset(self) -> None:
        """Forget everything held (the counters stay): after a step that failed, maybe half-way through an
        insertion."""
        self.evicted_tokens += self.tokens
        self.root, self.bytes, self._leaves = _Node([], None, None), 0, set()
