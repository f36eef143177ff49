"""Verify a draft chain and, in the same target pass, one-token alternatives at each of its positions.

At the first rejected position the target's own token (its correction) is often the draft's second or third
choice. A leaf holding that choice, scored in the same pass, gives the target's next token after the
correction for free: one more token on such steps. On a CPU a pass is about as slow for 17 positions as for 1
(the weights are read once either way), so the leaves cost little.

Layout of the pass over a cache holding `past` positions, for a chain d_0..d_{n-1} with up to m alternatives
each (the drafter leaves out runner-ups too unlikely to pay for their position):

    input:    [last] d_0 .. d_{n-1} | a_{0,0} .. a_{0,m-1} | a_{1,0} .. | ... | a_{n-1,m-1}
    position:  P     P+1 .. P+n     | P+1 (each)           | P+2        | ... | P+n

Chain tokens attend causally; leaf a_{j,r} stands where d_j stands: it attends the cache, [last], d_0..d_{j-1}
and itself. Nothing here decides what is accepted (`Sequence.judge` does, by the usual rule): a leaf is used
only when the accepted correction equals it, so the output is the target's, greedy or sampled.
"""

from __future__ import annotations

import torch


class TreeLayout:
    def __init__(self, last: torch.Tensor, chain: torch.Tensor, alternatives: torch.Tensor | None):
        """last [1, 1], chain [1, n], alternatives [1, n, m] (-1: no leaf there; None: a plain chain)."""
        self.n = chain.shape[1]
        if alternatives is None or not self.n:  # a plain chain (most steps: few small ops, each dear on a CPU)
            self.leaves, self._index = [], {}
            self.tokens = torch.cat([last, chain], dim=1) if self.n else last  # [1, W]
            return
        alternatives = alternatives[0, : self.n]
        self.leaves = [(j, r) for j, r in (alternatives >= 0).nonzero().tolist()]  # (position, rank), in input order
        self._index = {leaf: 1 + self.n + i for i, leaf in enumerate(self.leaves)}
        leaf_tokens = torch.tensor([[int(alternatives[j, r]) for j, r in self.leaves]], dtype=torch.long)
        self.tokens = torch.cat([last, chain, leaf_tokens.view(1, -1)], dim=1)  # [1, W]

    @property
    def width(self) -> int:
        return 1 + self.n + len(self.leaves)

    def leaf_index(self, position: int, rank: int) -> int:
        """Where the leaf of rank `rank` at chain position `position` sits in the pass's input."""
        return self._index[(position, rank)]

    @property
    def offsets(self) -> torch.Tensor:
        """[W]: each input's position after [last]'s (a leaf stands in its chain token's slot)."""
        return torch.tensor([*range(1 + self.n), *(1 + j for j, _ in self.leaves)], dtype=torch.long)

    @property
    def visibility(self) -> torch.Tensor:
        """[W, W] bool: which of the pass's inputs each input attends (all of them attend the whole cache)."""
        W, slot = self.width, self.offsets
        query, key = torch.arange(W)[:, None], torch.arange(1 + self.n)[None, :]
        sees_chain = (key < slot[:, None]) | (key == query)  # the chain slots before one's own, and oneself
        sees_leaves = torch.eye(W, dtype=torch.bool)[:, 1 + self.n :]  # a leaf sees no other leaf
        return torch.cat([sees_chain, sees_leaves], dim=1)

    def kept_inputs(self, accepted: int, leaf: tuple[int, int] | None) -> list[int]:
        """The inputs whose K/V the cache keeps after the pass, in order: [last], the accepted draft tokens and,
        when a leaf held the target's correction, that leaf (standing in the slot after them)."""
        return list(range(1 + accepted)) + ([self.leaf_index(*leaf)] if leaf is not None else [])

    def split_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, dict[tuple[int, int], torch.Tensor] | None]:
        """[1, W, V] -> the chain's [1, n+1, V] and each leaf's [1, V] by (position, rank) (None: no leaves)."""
        chain = logits[:, : 1 + self.n]
        if not self.leaves:
            return chain, None
        return chain, {leaf: logits[:, self._index[leaf]] for leaf in self.leaves}


def pack(trees: list[TreeLayout]) -> tuple[torch.Tensor, list[int], torch.Tensor | None, torch.Tensor | None]:
    """Rows' layouts -> one pass's inputs: tokens [B, W] (padded with each row's [last]), widths, offsets [B, W]
    and visibility [B, W, W] (both None when every row is a plain chain: positions 0..W-1 and causal attention)."""
    widths = [tree.width for tree in trees]
    leaves = any(tree.leaves for tree in trees)
    if len(trees) == 1 and not leaves:  # one plain chain (most steps on one request): its tokens as they are
        return trees[0].tokens, widths, None, None
    B, W = len(trees), max(widths)
    tokens = torch.zeros(B, W, dtype=torch.long)
    offsets = torch.arange(W).repeat(B, 1) if leaves else None
    visibility = torch.zeros(B, W, W, dtype=torch.bool) if leaves else None
    for i, tree in enumerate(trees):
        n = tree.width
        tokens[i, :n] = tree.tokens[0]
        if n < W:
            tokens[i, n:] = tokens[i, 0]  # padding: any token, never read
        if tree.leaves:  # a chain's offsets are 0..n-1 already
            offsets[i, :n] = tree.offsets
        if visibility is not None:
            visibility[i, :n, :n] = tree.visibility
    return tokens, widths, offsets, visibility
