"""Draft sources behind one interface (base.py): a drafter model (model.py), n-gram lookup (ngram.py), the
target's own MTP head (mtp.py), and lookup first with the head where it finds nothing (ngram_mtp.py)."""

from .base import Draft, Drafter
from .model import ModelDrafter
from .mtp import MtpDrafter
from .ngram import NgramDrafter
from .ngram_mtp import SPEC as NGRAM_MTP
from .ngram_mtp import NgramMtpDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "MtpDrafter", "NGRAM_MTP", "NgramDrafter", "NgramMtpDrafter"]
