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
        alternatives = alternatives[0, : self.n] if alternatives is not None and self.n else torch.empty(0, 0, dtype=torch.long)
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

    def model_inputs(self, past: int, dtype: torch.dtype) -> dict:
        """position_ids and a 4D additive attention mask for a pass over a cache of `past` positions ({} for a
        plain chain: the model's own causal mask is the same)."""
        if not self.leaves:
            return {}
        allowed = torch.cat([torch.ones(self.width, past, dtype=torch.bool), self.visibility], dim=1)
        return dict(position_ids=(past + self.offsets)[None, :], attention_mask=additive_mask(allowed[None, None], dtype))

    def split_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, dict[tuple[int, int], torch.Tensor] | None]:
        """[1, W, V] -> the chain's [1, n+1, V] and each leaf's [1, V] by (position, rank) (None: no leaves)."""
        chain = logits[:, : 1 + self.n]
        if not self.leaves:
            return chain, None
        return chain, {leaf: logits[:, self._index[leaf]] for leaf in self.leaves}


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool [B, 1, Q, K] mask -> the additive float mask attention takes (0 where allowed)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


@torch.inference_mode()
def keep_leaf(cache, past: int, layout: TreeLayout, position: int, rank: int, row: int | None = None) -> None:
    """Move an accepted leaf's K/V into the chain slot it stood for (the caller then crops the cache after
    it); `row`: of a batched cache, only that row. K/V carry their rotary position, which is that slot's."""
    src, dst = past + layout.leaf_index(position, rank), past + 1 + position
    rows = slice(None) if row is None else row
    for layer in cache.layers:
        for kv in (layer.keys, layer.values):
            kv[rows, :, dst] = kv[rows, :, src]
