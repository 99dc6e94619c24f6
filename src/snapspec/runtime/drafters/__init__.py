"""Draft sources behind one interface (base.py): a drafter model (model.py), n-gram lookup (ngram.py) and the
target's own MTP head (mtp.py)."""

from .base import Draft, Drafter
from .model import ModelDrafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "MtpDrafter", "NgramDrafter"]
