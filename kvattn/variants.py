"""Attention variants as compile-time switches: a variant that is off costs nothing (if constexpr / dead code).

Built-in now: logits soft cap and sliding window. The kernels take them as template flags, in this order.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Variant:
    soft_cap: bool = False   # s = cap * tanh(s / cap) before masking
    window: bool = False     # keep kv index j >= kv - qo + r - window_left

    def cpp_flags(self) -> str:
        """The kernels' variant template arguments: SOFT_CAP, WINDOW."""
        return f"{str(self.soft_cap).lower()}, {str(self.window).lower()}"
