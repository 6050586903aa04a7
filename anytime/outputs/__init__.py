"""The per-step outputs cache: every step's logits on a split, computed once."""

from anytime.outputs.cache import SPLITS, OutputCache, cache_path, collect, load_cache

__all__ = ["SPLITS", "OutputCache", "cache_path", "collect", "load_cache"]
