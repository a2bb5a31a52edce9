"""Radix prefix cache: a tree over token ids that maps cached prefixes to KV-cache slot ids.

Pure Python and model-free. The engine matches a prompt against the tree on admission (``match_prefix``),
locks the matched node while the request uses those slots, hands computed slots to the tree with ``insert``,
and calls ``evict`` when the slot pool runs short. See :class:`RadixTree` for the invariants.
"""

from radixserve.radix.node import ChildKey, MatchResult, TreeNode
from radixserve.radix.tree import RadixTree

__all__ = ["ChildKey", "MatchResult", "RadixTree", "TreeNode"]
