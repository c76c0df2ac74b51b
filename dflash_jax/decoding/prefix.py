"""Prompt prefixes kept for reuse: the one mechanism behind the library's ``prefix=`` and the server's prefix cache.

Sits on the loop (``loop.Prefix``: rows of prompt prefilled so far, before their first token), under ``api.py``
(``prefill_prefix``, ``generate(prefix=)``) and ``serve/engine.py`` (``PrefixStore``). A prefilled row is cut at a
token boundary L into two parts, found from the shapes of the loop's own state (``Layout``), so every proposer's
state is covered without naming its fields:

- per position: every array with an axis as long as the cache (the target's attention K/V, the DFlash drafter's
  injected context K/V, the MTP head's entries), kept as pages of positions [start, start + size) (``cut``);
- at the boundary: every other array of the row (each Gated DeltaNet layer's recurrent and conv state, the
  lengths, the MTP head's parked hidden state, the logits at the last token), copied whole (``snapshot``).

Arrays that are not per row (the RoPE tables) are the loop's own and come from ``SpeculativeLoop.empty``. A row
resumes at L by pasting the pages of [0, L) into an empty row (``paste``) and setting its boundary (``resume``);
``SpeculativeLoop.extend`` then prefills the rest. A hit that restored the target but not the drafter (vLLM's
DFlash2 bug) cannot happen here: the drafter's state is part of the row like the target's.

``PrefixStore`` keeps pages per block of ``block`` tokens, keyed by a chain over token blocks (vLLM's scheme: a
block's key is its parent's entry and its tokens), with boundary snapshots only where a prompt was cut (a Gated
DeltaNet state of Qwen3.5-27B weighs ~157 MB, as much as ~2,400 tokens of its K/V): a lookup resumes from the
deepest snapshot whose blocks all match. A snapshot at a length that is not whole blocks (a finished request's
decode row, ``of_state``: its prompt and reply, the state existing only there) is a tail entry under its last whole
block. Its bytes are bounded; the least recently used entries go first.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.decoding.loop import LoopState, Prefix, SpeculativeLoop
from dflash_jax.decoding.mtp import MTPProposer

DEFAULT_BLOCK = 64  # tokens per store block: a hit restores one page per block, each a program call
DEFAULT_CAPACITY_BYTES = 1 << 30  # the server's default store size (--prefix-cache-size)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each array of a loop's ``Prefix`` keeps what (static, hashable): ``axes[i]`` for its i-th leaf is the
    position axis of a per-position array, ``BOUNDARY`` for another per-row array, ``SHARED`` for one that is not
    per row."""

    treedef: jax.tree_util.PyTreeDef
    axes: tuple[int, ...]

    BOUNDARY = -1
    SHARED = -2

    @classmethod
    def of(cls, loop: SpeculativeLoop, params) -> Layout:
        """The layout of ``loop``'s prefixes (its spec's capacity set): from the shapes of ``empty`` at two
        capacities and two batch sizes (nothing runs)."""
        capacity = loop.spec.capacity
        if capacity is None:
            raise ValueError("prefix layout: the loop's spec needs a capacity (SpecConfig.capacity)")
        wider = dataclasses.replace(loop, spec=dataclasses.replace(loop.spec, capacity=capacity + 1))
        shapes = [jax.eval_shape(lambda p, lp=lp, b=b: lp.empty(p, b), params)
                  for lp, b in ((loop, 1), (wider, 1), (loop, 2))]
        (one, treedef), (longer, _), (two, _) = (jax.tree.flatten(s) for s in shapes)
        axes = []
        for a, c, b in zip(one, longer, two, strict=True):
            if not a.shape or a.shape[0] != 1 or b.shape[0] != 2:
                axes.append(cls.SHARED)
                continue
            grown = [i for i, (x, y) in enumerate(zip(a.shape, c.shape, strict=True)) if x != y]
            if len(grown) > 1:
                raise ValueError(f"prefix layout: an array of shape {a.shape} has {len(grown)} position axes")
            axes.append(grown[0] if grown else cls.BOUNDARY)
        return cls(treedef, tuple(axes))

    def kept(self, kind: str) -> list[int]:
        """Indices of the leaves kept per position ("pages") or at the boundary ("boundary")."""
        if kind == "pages":
            return [i for i, a in enumerate(self.axes) if a >= 0]
        return [i for i, a in enumerate(self.axes) if a == self.BOUNDARY]


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@functools.partial(jax.jit, static_argnames=("layout", "size"))
def cut(layout: Layout, prefix: Prefix, start, *, size: int, row=0) -> tuple[jax.Array, ...]:
    """Copies of row ``row``'s positions [start, start + size) of every per-position array of ``prefix``: a page."""
    leaves = jax.tree.leaves(prefix)
    return tuple(jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_slice_in_dim(leaves[i], row, 1), start, size,
                                              axis=layout.axes[i])
                 for i in layout.kept("pages"))


@functools.partial(jax.jit, static_argnames="layout")
def snapshot(layout: Layout, prefix: Prefix, row=0) -> tuple[jax.Array, ...]:
    """Copies of row ``row``'s per-row arrays that are not per position: the state at its boundary."""
    leaves = jax.tree.leaves(prefix)
    return tuple(jax.lax.dynamic_slice_in_dim(leaves[i], row, 1) for i in layout.kept("boundary"))


def of_state(state: LoopState, logits: jax.Array) -> Prefix:
    """The rows of a decode state as prefilled rows, to ``cut`` and ``snapshot`` (nothing copied): each row's
    target cache and proposer state after the tokens its target has processed (its prompt and its emitted tokens
    but the last: the loop's invariant), ``logits`` [B, V] standing for the logits at its last one (a resumed
    prompt prefills at least one token, whose logits replace them). Only for proposers whose decode state is one
    ``Proposer.extend`` continues (``keeps_replies``)."""
    return Prefix(cache=state.cache, proposer=state.proposer, logits=logits)


def keeps_replies(loop: SpeculativeLoop) -> bool:
    """Whether a decode state's rows can be stored and resumed as prefilled rows (``of_state``): every proposer's
    but the MTP head's, whose commit parks the verified entries until its next propose writes them (``MTPState``)
    while ``extend`` continues from at most one parked entry."""
    return not isinstance(loop.proposer, MTPProposer)


@functools.partial(jax.jit, static_argnames="layout", donate_argnames="prefix")
def paste(layout: Layout, prefix: Prefix, page: tuple[jax.Array, ...], start) -> Prefix:
    """``prefix`` (donated) with ``page`` (``cut``'s, of one row) written at positions ``start`` onwards of every
    row."""
    leaves = jax.tree.leaves(prefix)
    for i, p in zip(layout.kept("pages"), page, strict=True):
        x, axis = leaves[i], layout.axes[i]
        p = jnp.broadcast_to(p, x.shape[:axis] + p.shape[axis:axis + 1] + x.shape[axis + 1:])
        leaves[i] = jax.lax.dynamic_update_slice_in_dim(x, p.astype(x.dtype), start, axis=axis)
    return jax.tree.unflatten(layout.treedef, leaves)


@functools.partial(jax.jit, static_argnames="layout", donate_argnames="prefix")
def resume(layout: Layout, prefix: Prefix, boundary: tuple[jax.Array, ...]) -> Prefix:
    """``prefix`` (donated; its pages pasted) with every row's boundary state set to ``boundary`` (``snapshot``'s)."""
    leaves = jax.tree.leaves(prefix)
    for i, b in zip(layout.kept("boundary"), boundary, strict=True):
        leaves[i] = jnp.broadcast_to(b, leaves[i].shape).astype(leaves[i].dtype)
    return jax.tree.unflatten(layout.treedef, leaves)


@dataclasses.dataclass(eq=False)
class _Entry:
    key: tuple  # (parent entry's id or -1, the block's tokens: a whole block, or fewer for a tail)
    id: int
    page: tuple  # cut's arrays for the block's positions (a tail's: its tokens' first, the rest unused)
    boundary: tuple | None  # snapshot at the entry's end, or None (a tail always has one)
    children: set = dataclasses.field(default_factory=set)  # keys of the entries whose parent this is

    @property
    def nbytes(self) -> int:
        return nbytes(self.page) + (0 if self.boundary is None else nbytes(self.boundary))


@dataclasses.dataclass(frozen=True)
class Hit:
    """What a lookup found: ``length`` tokens to resume from, their ``pages`` (one per block, in order; the last
    one partly used when ``length`` is not a whole number of blocks) and the ``boundary`` snapshot at their end;
    length 0: nothing."""

    length: int
    pages: list
    boundary: tuple | None


class PrefixStore:
    """Pages of prefilled prompts per block of ``block`` tokens and boundary snapshots, at most ``capacity_bytes``
    (LRU). Used from one thread (the engine's); ``stats`` may be read from any.

    A snapshot at a length that is not a whole number of blocks (a finished request's prompt and reply: its state
    exists only at the tokens its target processed) is a tail entry: keyed by its last whole block's entry and the
    tokens after it, fewer than a block, with their page and the snapshot; a prompt that starts with them resumes
    there."""

    def __init__(self, block: int, capacity_bytes: int):
        if block < 1:
            raise ValueError(f"prefix cache block must be >= 1, got {block}")
        self.block, self.capacity_bytes = block, capacity_bytes
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()  # LRU first
        self._tails: dict[int, set[tuple]] = collections.defaultdict(set)  # parent id -> its tails' keys
        self._ids = 0
        self.bytes = 0
        self.counts = dict(hits=0, misses=0, evictions=0, cached_tokens=0)

    def _chain(self, tokens) -> list[_Entry]:
        """The stored entries of ``tokens``' whole blocks, from the first, as far as they match."""
        chain, parent = [], -1
        for start in range(0, len(tokens) - self.block + 1, self.block):
            entry = self._entries.get((parent, tuple(tokens[start:start + self.block])))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.id
        return chain

    def _touch(self, chain: list[_Entry]) -> None:
        """Marks a chain used, its root last: an entry is evicted before its ancestors."""
        for entry in reversed(chain):
            self._entries.move_to_end(entry.key)

    def lookup(self, prompt) -> Hit:
        """The deepest snapshot of ``prompt`` (at a block's end or a tail's) that leaves at least one of its tokens
        to prefill (the one whose logits choose the first token); counts a hit or a miss."""
        usable = len(prompt) - 1
        chain = self._chain(prompt[:usable])
        depth = max((d + 1 for d, e in enumerate(chain) if e.boundary is not None), default=0)
        path, length = chain[:depth], depth * self.block
        for d in range(len(chain) + 1):  # a tail under the root or under any matched block
            start = d * self.block
            for key in self._tails.get(chain[d - 1].id if d else -1, ()):
                end = start + len(key[1])
                if length < end <= usable and tuple(prompt[start:end]) == key[1]:
                    path, length = [*chain[:d], self._entries[key]], end
        self._touch(path)
        if not length:
            self.counts["misses"] += 1
            return Hit(0, [], None)
        self.counts["hits"] += 1
        self.counts["cached_tokens"] += length
        return Hit(length, [e.page for e in path], path[-1].boundary)

    def add(self, tokens, pages, boundary) -> None:
        """Stores the blocks of ``tokens`` and the snapshot at their end (a tail entry after the last whole block
        when they are not a whole number of blocks): ``pages(b)`` gives the page of block b (the one starting at
        token b * block), ``boundary()`` the snapshot, each called only if not stored yet (an entry larger than
        the whole store is not), and the page of the last block stored before them again."""
        whole = len(tokens) // self.block
        chain, parent = self._chain(tokens[:whole * self.block]), -1
        if chain and len(chain) < whole:
            # The row has now processed past the stored chain's last block: copy its page again. A proposer's
            # per-position state may lag the tokens (the MTP head's entry t needs token t + 1), so a block cut where
            # its chunk ended holds a dead last entry, which a deeper resume would read.
            old = chain[-1]
            self.bytes -= nbytes(old.page)
            old.page = pages(len(chain) - 1)
            self.bytes += nbytes(old.page)
        if chain:
            parent = chain[-1].id
        for b in range(len(chain), whole):
            entry = self._new((parent, tuple(tokens[b * self.block:(b + 1) * self.block])), pages(b), None, chain)
            if entry is None:
                break
            chain.append(entry)
            parent = entry.id
        if len(chain) == whole and len(tokens) > whole * self.block:
            key = (parent, tuple(tokens[whole * self.block:]))
            tail = self._entries.get(key) or self._new(key, pages(whole), boundary(), chain)
            if tail is not None:
                self._tails[parent].add(key)
                chain.append(tail)
        elif chain and chain[-1].boundary is None and len(chain) == whole:
            chain[-1].boundary = boundary()
            self.bytes += nbytes(chain[-1].boundary)
        self._touch(chain)
        self._evict()

    def _new(self, key: tuple, page: tuple, snapshot: tuple | None, chain: list[_Entry]) -> _Entry | None:
        """A new entry under ``chain``'s last (None if it alone would exceed the store: it would evict everything
        and then itself)."""
        entry = _Entry(key, self._ids, page, snapshot)
        if entry.nbytes > self.capacity_bytes:
            return None
        self._ids += 1
        if chain:
            chain[-1].children.add(key)
        self._entries[key] = entry
        self.bytes += entry.nbytes
        return entry

    def _evict(self) -> None:
        while self.bytes > self.capacity_bytes and self._entries:
            self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: _Entry) -> None:
        """Removes ``entry`` and its descendants (no lookup can reach them without it)."""
        for key in list(entry.children):
            if key in self._entries:
                self._drop(self._entries[key])
        del self._entries[entry.key]
        tails = self._tails.get(entry.key[0])
        if tails is not None and entry.key in tails:
            tails.discard(entry.key)
            if not tails:
                del self._tails[entry.key[0]]
        self.bytes -= entry.nbytes
        self.counts["evictions"] += 1

    def stats(self) -> dict:
        """hits / misses (lookups that resumed from a stored prefix or not), evictions (entries), bytes held,
        capacity_bytes, entries, cached_tokens (prompt tokens served from the store)."""
        return dict(self.counts, bytes=self.bytes, capacity_bytes=self.capacity_bytes, entries=len(self._entries))
