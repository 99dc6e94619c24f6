"""The old import path of n-gram drafting (now drafters/ngram.py), kept so that scripts written against it run."""

from .drafters.ngram import LookupChooser, NgramDrafter, NgramIndex, check_range

__all__ = ["LookupChooser", "NgramDrafter", "NgramIndex", "check_range"]
