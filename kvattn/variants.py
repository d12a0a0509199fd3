"""Attention variants: the hook struct a kernel is instantiated with (cuda_src/variant.cuh).

Each kernel takes one variant type; its hooks (logits transform, keep / mask, whether a tile may hold a masked
pair) are the identity unless the variant overrides them, so a variant that is off costs nothing. Built in now:
`kvattn::Builtin<SOFT_CAP, WINDOW, CUSTOM>`: logits soft cap, sliding window and (prefill) a bit-packed custom
mask. Causal is not a variant: it is a run-time flag of the prefill kernel (it only decides which tiles take the
masked path) and decode's query is always the last row.
"""
from __future__ import annotations

import dataclasses


def _b(x: bool) -> str:
    return str(bool(x)).lower()


@dataclasses.dataclass(frozen=True)
class Variant:
    soft_cap: bool = False      # s = cap * tanh(s / cap) before masking
    window: bool = False        # keep kv index j >= kv - qo + r - window_left
    custom_mask: bool = False   # keep kv index j where the request's bit-packed mask bit (r, j) is set (prefill)

    def decode_type(self) -> str:
        """The decode kernel's variant type."""
        if self.custom_mask:
            raise ValueError("custom_mask: the decode kernel has no custom-mask variant")
        return f"kvattn::Builtin<{_b(self.soft_cap)}, {_b(self.window)}, false>"

    def prefill_type(self) -> str:
        """The prefill kernels' (sm80 and sm90) variant type."""
        return f"kvattn::Builtin<{_b(self.soft_cap)}, {_b(self.window)}, {_b(self.custom_mask)}>"
