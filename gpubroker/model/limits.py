"""Limits on what one request may ask for, shared by the API's validation
and the broker's admission (pure constants)."""

from __future__ import annotations

#: largest share one request may ask for, GiB (above any GPU made so far)
MAX_SHARE_GIB = 1024.0
#: smallest share, GiB: below it no framework cap or MPS limit is meaningful
MIN_SHARE_GIB = 0.25
