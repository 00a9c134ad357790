"""Overlap with backward: the engine (:mod:`.engine`: hooks, the bucket plan, the lane) and the buckets
(:mod:`.buckets`: the plan every rank shares, one closing backward's progress)."""

from .engine import OverlapEngine

__all__ = ["OverlapEngine"]
