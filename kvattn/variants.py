"""Attention variants: the hook struct a kernel is instantiated with (cuda_src/variant.cuh).

Each kernel takes one variant type; its hooks (logits transform, keep / mask, whether a tile may hold a masked
pair) are the identity unless the variant overrides them, so a variant that is off costs nothing. Built in now:
`kvattn::Builtin<SOFT_CAP, WINDOW, CUSTOM[, ALIBI]>`: logits soft cap, sliding window, (prefill) a bit-packed custom
mask, ALiBi (per-head slopes, a plan() argument). Causal is not a variant: it is a run-time flag of the prefill
kernel (it only decides which tiles take the masked path) and decode's query is always the last row.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re


def _b(x: bool) -> str:
    return str(bool(x)).lower()


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel variant: the built-ins (flags) or a user-written CUDA struct (name + source).

    User variants: `Variant.from_cuda(name, source)`, where source defines `struct <name> : kvattn::VariantBase`
    and overrides hooks of cuda_src/variant.cuh (`logits`, `keep` + `tile_may_mask`) and their traits
    (`kLogits`, `kKeep`). The source is compiled into the kernels by NVRTC (cached; a compile error shows the
    snippet's own numbered lines). Pass it to a wrapper's plan(variant=...)."""
    soft_cap: bool = False      # s = cap * tanh(s / cap) before masking
    window: bool = False        # keep kv index j >= kv - qo + r - window_left
    custom_mask: bool = False   # keep kv index j where the request's bit-packed mask bit (r, j) is set (prefill)
    alibi: bool = False         # s += slope[h] * (j - (kv - qo + r)), the slopes a plan() argument
    name: str = ""              # a user variant's struct name
    source: str = ""            # its CUDA source

    @classmethod
    def from_cuda(cls, name: str, source: str) -> "Variant":
        if not isinstance(name, str) or not _IDENT.fullmatch(name):
            raise ValueError(f"name: expected a C++ identifier (the struct's name), got {name!r}")
        if not isinstance(source, str) or not re.search(rf"\bstruct\s+{name}\b", source):
            raise ValueError(f"source: expected CUDA source defining `struct {name} : kvattn::VariantBase {{...}}`")
        return cls(name=name, source=source)

    @property
    def is_user(self) -> bool:
        return bool(self.name)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:12] if self.source else ""

    def decode_type(self) -> str:
        """The decode kernel's variant type."""
        if self.is_user:
            return self.name
        if self.custom_mask:
            raise ValueError("custom_mask: the decode kernel has no custom-mask variant")
        return f"kvattn::Builtin<{_b(self.soft_cap)}, {_b(self.window)}, false{', true' if self.alibi else ''}>"

    def prefill_type(self) -> str:
        """The prefill kernels' (sm80 and sm90) variant type."""
        if self.is_user:
            return self.name
        return (f"kvattn::Builtin<{_b(self.soft_cap)}, {_b(self.window)}, {_b(self.custom_mask)}"
                f"{', true' if self.alibi else ''}>")

    def prelude(self) -> tuple:
        """(file name, source) compiled after the kernel header: the user's struct, or nothing."""
        return (f"variant_{self.name}", self.source) if self.is_user else ("", "")


def choose(variant, soft_cap: bool, window: bool, custom_mask: bool, alibi: bool = False) -> Variant:
    """The plan's variant: a user variant (variant=...) or the built-ins the keyword arguments select; both at
    once is refused (combining them is not built yet)."""
    if variant is None:
        return Variant(soft_cap=soft_cap, window=window, custom_mask=custom_mask, alibi=alibi)
    if not isinstance(variant, Variant):
        raise TypeError(f"variant: expected a kvattn.Variant (Variant.from_cuda(...)), got {type(variant).__name__}")
    if variant.is_user and (soft_cap or window or custom_mask or alibi):
        raise ValueError("variant: a user variant cannot be combined with logits_soft_cap, window_left, "
                         "custom_mask or alibi_slopes yet; write them into the variant's hooks")
    return variant


def check_alibi_slopes(alibi_slopes, num_qo_heads: int):
    """float32 [num_qo_heads] (finite), or None; errors name the argument."""
    if alibi_slopes is None:
        return None
    import numpy as np
    a = np.asarray(alibi_slopes)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"alibi_slopes: expected a float array [num_qo_heads], got dtype {a.dtype}")
    if a.shape != (num_qo_heads,):
        raise ValueError(f"alibi_slopes: expected shape ({num_qo_heads},) (one slope per query head), got {a.shape}")
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise ValueError("alibi_slopes: must be finite")
    return a
