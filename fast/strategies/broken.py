"""Deliberately broken variants, for the correctness table of `specbatch bench` only.

They reproduce two mistakes found in published batch implementations, on top of the EQSPEC
engine, so that their exact-match collapse can be shown next to the correct strategies:

- `bsp-like`: rejected drafts stay in the target cache. The tokens are realigned, but the cache
  keeps every verify slot, so the masks and positions (computed from lengths) point the queries at
  rejected drafts instead of the row's content.
- `dsd-like`: repad without unpad, and the bonus token taken from the draft. Each row's committed
  tokens are appended after the old width and the rest is right-padded; nothing is moved, so the
  layout the masks assume (right-aligned content) is not where the data is.

Never use them for anything else: only `specbatch.api.generate_variant` runs them (bench, tests).
"""
from __future__ import annotations

import numpy as np
import torch

from .eqspec import Eqspec, RectBatch


class BspLikeBatch(RectBatch):
    def _update(self, extended, keep, n, accepted, proposals):
        stale = {id(layer): (layer.keys, layer.values) for layer in self.target_cache.layers}
        super()._update(extended, keep, n, accepted, proposals)
        if not keep.all():
            return
        for layer in self.target_cache.layers:  # put the un-cropped verify slots back (rejected drafts kept)
            keys, values = stale[id(layer)]
            width = layer.keys.shape[-2]
            layer.keys, layer.values = keys[..., -width:, :], values[..., -width:, :]


class DsdLikeBatch(RectBatch):
    def _update(self, extended, keep, n, accepted, proposals):
        k = proposals.model_steps
        full = accepted == k
        if k and full.any():  # the bonus token comes from the draft's last proposal instead of the target
            rows = torch.as_tensor(np.nonzero(full)[0], device=extended.device)
            extended[rows, self.width + k] = extended[rows, self.width + k - 1]
        width = self.width + int(n[keep].max()) if keep.any() else self.width
        column = torch.arange(extended.shape[1], device=extended.device)[None, :]
        n_t = torch.as_tensor(n, device=extended.device)[:, None]
        tokens = extended.masked_fill(column >= self.width + n_t, self.settings.pad_id)[:, :width]  # right pads
        super()._update(extended, keep, n, accepted, proposals)  # lengths, caches and bookkeeping as usual...
        rows = torch.as_tensor(np.nonzero(keep)[0], device=extended.device)
        self.tokens = tokens[rows][:, -self.width:]  # ...but the token layout is never unpadded


class BspLike(Eqspec):
    batch_class = BspLikeBatch


class DsdLike(Eqspec):
    batch_class = DsdLikeBatch
