"""The KV cache's blocks, as vLLM's block manager keeps them: which block of the pool holds which
sequence's positions, which full blocks hold a known prefix, and which are free.

The pool (batching.paged) has `num_blocks` blocks of BLOCK positions per layer; block 0 is the null
block, never handed out (a block table padded to a batch's longest reads it: finite zeros, masked).
A sequence's block table lists its blocks in position order; blocks are taken as its tokens arrive
(`grow`) and given back when it ends or is preempted (`release`).

**Prefixes shared by block.** A block whose BLOCK positions are all written is registered under a
key: the SHA-256 of its parent's key and its tokens, so a key names the whole prefix up to its last
token (vLLM's hashed blocks; a 64-bit hash could collide and hand a sequence another's keys, a
256-bit digest does not in practice). A new prompt walks its full blocks' keys and maps every block
found (`share`): its table starts with them and their reference counts go up; nothing is copied.
Only full blocks are shared and a sequence writes only past its cached prefix (at least the
prompt's last token is computed: its logits give the first token), so a shared block is never
written to: no copy-on-write is needed.

**Free blocks, least recently used first.** A block whose count reaches 0 joins the free queue at its
end and keeps its key: a later prompt may still map it (a prefix hit on a finished sequence's
blocks). `grow` takes a block never used if any is left, else from the queue's front, dropping
the key of a block it takes (eviction). A
sequence's blocks are given back last block first, so under pressure a prefix's tail goes before
its head (vLLM's order); a block with no key goes to the front (nothing to keep).

Host only: the scheduler (rank 0) owns it; the plan carries the tables every rank's runner reads.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

BLOCK = 16  # positions per block (vLLM's default block size)
NULL = 0    # the block padding reads


def blocks_for(positions: int, block_size: int = BLOCK) -> int:
    """The blocks `positions` positions fill."""
    return -(-positions // block_size)


def pool_blocks(sequences: int, length: int, block_size: int = BLOCK) -> int:
    """The blocks `sequences` sequences of `length` positions fill at most, the null block included."""
    return 1 + sequences * blocks_for(length, block_size)


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: its parent's key (b"" for a sequence's first) and its tokens."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = BLOCK):
        if num_blocks < 2:
            raise ValueError(f"a KV pool of {num_blocks} blocks holds nothing (block 0 is the null block)")
        self.num_blocks, self.block_size = num_blocks, block_size
        # (host memory grows with the blocks ever used, not the pool: blocks from `fresh` on were never used)
        self.fresh = 1
        self.ref: dict[int, int] = {}
        self.key: dict[int, bytes] = {}     # a full block's key, while it keeps it
        self.cached: dict[bytes, int] = {}  # key -> the block that holds it
        self.free: OrderedDict[int, None] = OrderedDict()  # given back, least recently used first
        self.evicted = 0  # keyed blocks taken for other tokens (a prefix forgotten)

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def free_count(self) -> int:
        return len(self.free) + self.num_blocks - self.fresh

    def blocks_for(self, positions: int) -> int:
        return blocks_for(positions, self.block_size)

    def grow(self, table: list[int], positions: int, final: int = 0) -> bool:
        """Blocks onto `table` until it holds `positions` positions -> False (and nothing taken) when
        too few are free. `final`: the positions the sequence will reach (its prompt and max_tokens).

        Where it costs nothing, a table's blocks are consecutive (its keys one slice of the pool: on
        CPU a decode attends over that view, batching.paged, where scattered blocks must be gathered
        first): a table takes the block after its last when that one is free, and a run started from
        the never-used blocks sets the rest of its `final` blocks aside at the free queue's front, so
        its own growth finds them next to it; the other sequences take never-used blocks first, and
        those set aside only when none is left."""
        need = self.blocks_for(positions) - len(table)
        if need <= 0:
            return True
        if need > self.free_count():
            return False
        for _ in range(need):
            after = table[-1] + 1 if table else -1
            if after in self.free and after not in self.key:  # (set aside for it, or given back unkeyed)
                del self.free[after]
                b = after
            elif self.fresh < self.num_blocks:
                b, self.fresh = self.fresh, self.fresh + 1
                if after != b:  # a new run: the rest of its final blocks set aside next to it
                    aside = max(0, min(self.blocks_for(final) - len(table) - 1, self.num_blocks - self.fresh))
                    for a in range(self.fresh + aside - 1, self.fresh - 1, -1):
                        self.free[a] = None
                        self.free.move_to_end(a, last=False)
                    self.fresh += aside
            else:
                b, _ = self.free.popitem(last=False)
                if b in self.key:  # evicted: its prefix is forgotten
                    del self.cached[self.key.pop(b)]
                    self.evicted += 1
            self.ref[b] = 1
            table.append(b)
        return True

    def release(self, table: list[int]) -> None:
        """A sequence's blocks given back (it ended or was preempted), last block first."""
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if b not in self.key:
                    self.free.move_to_end(b, last=False)
        table.clear()

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The blocks holding the longest cached prefix of `tokens`, whole blocks, at most `limit`
        positions (taken nothing yet: `share` takes them)."""
        found, parent, B = [], b"", self.block_size
        for start in range(0, limit // B * B, B):
            parent = block_key(parent, tokens[start:start + B])
            b = self.cached.get(parent)
            if b is None:
                break
            found.append(b)
        return found

    def share(self, table: list[int], blocks: list[int]) -> None:
        """Map cached blocks (from `match`) as the start of an empty table."""
        assert not table
        for b in blocks:
            if self.ref.get(b, 0) == 0:
                del self.free[b]
            self.ref[b] = self.ref.get(b, 0) + 1
            table.append(b)

    def register(self, table: list[int], keys: list[bytes], tokens: list[int], written: int) -> None:
        """Key the blocks of `table` that `written` positions fill (`tokens`: the sequence's tokens
        from position 0), continuing `keys` (the keys of its blocks keyed so far). A block whose
        prefix another block holds already stays unkeyed (the first holder is what `match` finds)."""
        B = self.block_size
        for i in range(len(keys), min(written // B, len(table))):
            key = block_key(keys[-1] if keys else b"", tokens[i * B:(i + 1) * B])
            keys.append(key)
            b = table[i]
            if b not in self.key and key not in self.cached:
                self.key[b] = key
                self.cached[key] = b

    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.usable - self.free_count()
