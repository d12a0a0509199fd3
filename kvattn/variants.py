"""Attention variants as compile-time switches: a variant that is off costs nothing (if constexpr / dead code).

Built-in now: logits soft cap, sliding window and (prefill) a bit-packed custom mask. The kernels take them as
template flags, in this order: decode ``cpp_flags()`` = SOFT_CAP, WINDOW; prefill ``prefill_flags()`` =
SOFT_CAP, WINDOW, CUSTOM_MASK. Causal is not a variant: it is a run-time flag of the prefill kernel (it only
decides which tiles take the masked path).
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

    def cpp_flags(self) -> str:
        """The decode kernel's variant template arguments: SOFT_CAP, WINDOW."""
        if self.custom_mask:
            raise ValueError("custom_mask: the decode kernel has no custom-mask variant")
        return f"{_b(self.soft_cap)}, {_b(self.window)}"

    def prefill_flags(self) -> str:
        """The prefill kernel's variant template arguments: SOFT_CAP, WINDOW, CUSTOM_MASK."""
        return f"{_b(self.soft_cap)}, {_b(self.window)}, {_b(self.custom_mask)}"
