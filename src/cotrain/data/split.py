"""The held-out split: which side of train/validation a document lands on."""

from __future__ import annotations

import hashlib


def document_split(document: str, valid_fraction: float) -> str:
    """The split of a document, "validation" or "train", from a hash of its text: the same document
    always lands on the same side, whatever else is in the corpus."""
    bucket = int.from_bytes(hashlib.sha256(document.encode("utf-8")).digest()[:8], "big") % 1000
    return "validation" if bucket < round(valid_fraction * 1000) else "train"
