"""Attention variants: the hook struct a kernel is instantiated with (cuda_src/variant.cuh).

Each kernel takes one variant type; its hooks (logits transform, keep / mask, whether a tile may hold a masked
pair, non-softmax weights, the output transform) are the identity unless the variant overrides them, so a variant
that is off costs nothing. Built in now: `kvattn::Builtin<SOFT_CAP, WINDOW, CUSTOM[, ALIBI[, SINK]]>`: logits soft
cap, sliding window, (prefill) a bit-packed custom mask, ALiBi (per-head slopes) and attention sinks (per-head
logits), the last two plan() arguments. Causal is not a variant: it is a run-time flag of the prefill
kernel (it only decides which tiles take the masked path) and decode's query is always the last row.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re


def _b(x: bool) -> str:
    return str(bool(x)).lower()


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


PARAM_KINDS = ("scalar", "per_head", "per_request")
PARAM_DTYPES = ("float32", "int32")


@dataclasses.dataclass(frozen=True)
class VariantParam:
    """One declared parameter of a user variant: a scalar, a per-query-head array [num_qo_heads] or a per-request
    array [batch], float32 or int32, given to plan(variant_params={name: value}). The kernels read it through
    the generated accessor `<Variant>Params::<name>(p)` (a value for scalars, a pointer for arrays)."""
    name: str
    kind: str = "scalar"
    dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.name, str) or not _IDENT.fullmatch(self.name):
            raise ValueError(f"params: a parameter name must be a C++ identifier, got {self.name!r}")
        if self.kind not in PARAM_KINDS:
            raise ValueError(f"params[{self.name!r}]: kind must be one of {PARAM_KINDS}, got {self.kind!r}")
        if self.dtype not in PARAM_DTYPES:
            raise ValueError(f"params[{self.name!r}]: dtype must be one of {PARAM_DTYPES}, got {self.dtype!r}")

    def accessor(self, i: int) -> str:
        ct = "float" if self.dtype == "float32" else "int"
        if self.kind == "scalar":
            fn = "param_f32" if self.dtype == "float32" else "param_i32"
            return (f"  template <class P> __device__ __forceinline__ static {ct} {self.name}(const P& p) "
                    f"{{ return kvattn::{fn}(p, {i}); }}")
        return (f"  template <class P> __device__ __forceinline__ static const {ct}* {self.name}(const P& p) "
                f"{{ return kvattn::param_ptr<{ct}>(p, {i}); }}")


def _as_params(params) -> tuple:
    if params is None:
        return ()
    if isinstance(params, dict):
        items = []
        for name, spec in params.items():
            kind, dtype = (spec, "float32") if isinstance(spec, str) else tuple(spec)
            items.append(VariantParam(name, kind, dtype))
    else:
        items = [p if isinstance(p, VariantParam) else VariantParam(*p) for p in params]
    names = [p.name for p in items]
    if len(set(names)) != len(names):
        raise ValueError(f"params: duplicate parameter names in {names}")
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class RoPE:
    """Fused rotary embedding of q and k inside the kernels (plan(rope=RoPE(...))): angle_i = pos / scale *
    theta^(-2 i / head_dim) over the whole head dim, NeoX halves (i, i + D/2) or, with interleave, GPT-J pairs
    (2i, 2i + 1), as kvattn.reference.apply_rope. Positions: key j of a request is at j + offset, its query row r
    at kv_len - qo_len + r + offset (decode: kv_len - 1 + offset); offsets: plan(rope_offsets=[batch]) or 0."""
    theta: float = 1e4
    scale: float = 1.0
    interleave: bool = False

    def __post_init__(self):
        import math
        for name in ("theta", "scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"rope.{name}: expected a finite number > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel variant: the built-ins (flags) or a user-written CUDA struct (name + source + parameters).

    User variants: `Variant.from_cuda(name, source, params=None)`, where source defines
    `struct <name> : kvattn::VariantBase` and overrides hooks of cuda_src/variant.cuh (`logits`,
    `row_init` + `logits_at`, `keep` + `tile_may_mask`, `prob`, `output`) and their traits (`kLogits`,
    `kPositional`, `kKeep`, `kSoftmax = false`, `kOutput`). params declares extra inputs ({name: kind} or
    {name: (kind, dtype)}, kinds "scalar" / "per_head" / "per_request", dtypes float32 / int32), read in the
    hooks as `<name>Params::<param>(p)` and given to plan(variant_params={...}). The source is compiled into
    the kernels by NVRTC (cached; a compile error shows the snippet's own numbered lines)."""
    soft_cap: bool = False      # s = cap * tanh(s / cap) before masking
    window: bool = False        # keep kv index j >= kv - qo + r - window_left
    custom_mask: bool = False   # keep kv index j where the request's bit-packed mask bit (r, j) is set (prefill)
    alibi: bool = False         # s += slope[h] * (j - (kv - qo + r)), the slopes a plan() argument
    sink: bool = False          # one logit per head added to the softmax denominator, a plan() argument
    rope: int = 0               # fused RoPE on q and k: 0 off, 1 NeoX halves, 2 GPT-J interleaved pairs
    name: str = ""              # a user variant's struct name
    source: str = ""            # its CUDA source
    params: tuple = ()          # its declared parameters (VariantParam)

    @classmethod
    def from_cuda(cls, name: str, source: str, params=None) -> "Variant":
        if not isinstance(name, str) or not _IDENT.fullmatch(name):
            raise ValueError(f"name: expected a C++ identifier (the struct's name), got {name!r}")
        if not isinstance(source, str) or not re.search(rf"\bstruct\s+{name}\b", source):
            raise ValueError(f"source: expected CUDA source defining `struct {name} : kvattn::VariantBase {{...}}`")
        return cls(name=name, source=source, params=_as_params(params))

    @property
    def is_user(self) -> bool:
        return bool(self.name)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:12] if self.source else ""

    def _builtin(self, custom: bool) -> str:
        args = [_b(self.soft_cap), _b(self.window), _b(custom)]
        if self.alibi or self.sink or self.rope:
            args.append(_b(self.alibi))
        if self.sink or self.rope:
            args.append(_b(self.sink))
        if self.rope:
            args.append(str(self.rope))
        return f"kvattn::Builtin<{', '.join(args)}>"

    def decode_type(self) -> str:
        """The decode kernel's variant type."""
        if self.is_user:
            return self.name
        if self.custom_mask:
            raise ValueError("custom_mask: the decode kernel has no custom-mask variant")
        return self._builtin(False)

    def prefill_type(self) -> str:
        """The prefill kernels' (sm80 and sm90) variant type."""
        return self.name if self.is_user else self._builtin(self.custom_mask)

    def merge_type(self) -> str | None:
        """The merge kernel's variant type (its output hook finishes merged rows), or None: the plain merge."""
        if self.is_user:
            return self.name
        return Variant(sink=True)._builtin(False) if self.sink else None

    def prelude(self) -> tuple:
        """(file name, source, generated accessors) compiled after the kernel header: the user's struct, or
        nothing."""
        if not self.is_user:
            return ("", "", "")
        gen = ""
        if self.params:
            body = "\n".join(p.accessor(i) for i, p in enumerate(self.params))
            gen = f"struct {self.name}Params {{\n{body}\n}};"
        return (f"variant_{self.name}", self.source, gen)

    # -- the plan's variant data (float32 words at p.variant_data) --------------------------------------
    def data(self, num_qo_heads: int, batch: int, cap_batch: int, sinks=None, slopes=None, values=None,
             rope=None, rope_offsets=None):
        """The float32 words of the plan's variant data, or None when the kernels read none. Built-ins: sinks
        [Hq], slopes [Hq], then RoPE's log2(theta), 1 / scale and int32 offsets [cap_batch]. User variants: one
        word per declared parameter (a scalar's value, an array's word offset), then each array (per-request
        arrays sized cap_batch, the graph-mode bound)."""
        import numpy as np
        if not self.is_user:
            parts = [a for a in (sinks if self.sink else None, slopes if self.alibi else None) if a is not None]
            if self.rope:
                offs = np.zeros(cap_batch, np.int32)
                if rope_offsets is not None:
                    offs[:batch] = rope_offsets
                parts += [np.array([np.log2(rope.theta), 1.0 / rope.scale], np.float32), offs.view(np.float32)]
            return np.concatenate(parts).astype(np.float32) if parts else None
        if not self.params:
            return None
        values = check_params(self, values, num_qo_heads, batch)
        words = [np.zeros(len(self.params), np.float32)]
        pos = len(self.params)
        for i, p in enumerate(self.params):
            v = values[p.name].reshape(-1)
            if p.kind == "scalar":
                words[0][i:i + 1] = v.view(np.float32)
                continue
            n = num_qo_heads if p.kind == "per_head" else cap_batch
            arr = np.zeros(n, np.float32)
            arr[:v.size] = v.view(np.float32)
            words[0][i:i + 1] = np.array([pos], np.int32).view(np.float32)
            words.append(arr)
            pos += n
        return np.concatenate(words)


def check_params(variant: Variant, values, num_qo_heads: int, batch: int) -> dict:
    """{name: numpy array of the declared dtype and shape} for plan(variant_params=...) (idempotent: checked
    values pass again); errors name the parameter."""
    import numpy as np
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise TypeError(f"variant_params: expected a dict {{name: value}}, got {type(values).__name__}")
    declared = {p.name for p in variant.params}
    unknown = sorted(set(values) - declared)
    if unknown:
        raise ValueError(f"variant_params: {unknown} not declared by variant {variant.name} "
                         f"(declared: {sorted(declared)})")
    out = {}
    for p in variant.params:
        key = f"variant_params[{p.name!r}]"
        if p.name not in values:
            raise ValueError(f"{key}: missing ({p.kind} {p.dtype}, declared by variant {variant.name})")
        a = np.asarray(values[p.name])
        if a.dtype.kind not in "fiub":
            raise TypeError(f"{key}: expected a number or a numeric array, got dtype {a.dtype}")
        want = () if p.kind == "scalar" else ((num_qo_heads,) if p.kind == "per_head" else (batch,))
        if a.shape != want:
            what = {"scalar": "a scalar", "per_head": "one value per query head",
                    "per_request": "one value per request"}[p.kind]
            raise ValueError(f"{key}: expected shape {want} ({what}), got {a.shape}")
        if p.dtype == "int32":
            if a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
                raise TypeError(f"{key}: expected integers (int32), got fractional values")
            if a.size and (a.min() < -2**31 or a.max() >= 2**31):
                raise ValueError(f"{key}: out of the int32 range")
            out[p.name] = a.astype(np.int32)   # (ascontiguousarray would make a scalar 1-d)
        else:
            f = a.astype(np.float32)
            if not np.isfinite(f).all():
                raise ValueError(f"{key}: must be finite (float32)")
            out[p.name] = f
    return out


def choose(variant, soft_cap: bool, window: bool, custom_mask: bool, alibi: bool = False, sink: bool = False,
           variant_params=None, rope: int = 0) -> Variant:
    """The plan's variant: a user variant (variant=...) or the built-ins the keyword arguments select; both at
    once is refused (combining them is not built yet)."""
    if variant is None:
        if variant_params is not None:
            raise ValueError("variant_params: given without a user variant (variant=kvattn.Variant.from_cuda(...))")
        return Variant(soft_cap=soft_cap, window=window, custom_mask=custom_mask, alibi=alibi, sink=sink, rope=rope)
    if not isinstance(variant, Variant):
        raise TypeError(f"variant: expected a kvattn.Variant (Variant.from_cuda(...)), got {type(variant).__name__}")
    if variant.is_user and (soft_cap or window or custom_mask or alibi or sink or rope):
        raise ValueError("variant: a user variant cannot be combined with logits_soft_cap, window_left, "
                         "custom_mask, alibi_slopes, sinks or rope yet; write them into the variant's hooks")
    if not variant.is_user and variant_params is not None:
        raise ValueError("variant_params: only a user variant declares parameters")
    return variant


def check_per_head(values, num_qo_heads: int, name: str, what: str):
    """float32 [num_qo_heads] (finite), or None; errors name the argument."""
    if values is None:
        return None
    import numpy as np
    a = np.asarray(values)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected a float array [num_qo_heads], got dtype {a.dtype}")
    if a.shape != (num_qo_heads,):
        raise ValueError(f"{name}: expected shape ({num_qo_heads},) (one {what} per query head), got {a.shape}")
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: must be finite")
    return a


def check_rope(rope, rope_offsets, batch: int, max_position: int):
    """(RoPE or None, int32 offsets [batch] or None); errors name the argument. max_position: the largest
    position before offsets (positions stay below 2^24, exact in float32)."""
    import numpy as np
    if rope is None:
        if rope_offsets is not None:
            raise ValueError("rope_offsets: given without rope (plan(rope=kvattn.RoPE(...)))")
        return None, None
    if not isinstance(rope, RoPE):
        raise TypeError(f"rope: expected a kvattn.RoPE(theta=..., scale=..., interleave=...), got {type(rope).__name__}")
    offs = None
    if rope_offsets is not None:
        a = np.asarray(rope_offsets)
        if a.dtype.kind not in "iu":
            raise TypeError(f"rope_offsets: expected an integer array [batch], got dtype {a.dtype}")
        if a.shape != (batch,):
            raise ValueError(f"rope_offsets: expected shape ({batch},) (one offset per request), got {a.shape}")
        if a.size and a.min() < 0:
            raise ValueError(f"rope_offsets: must be >= 0, got {int(a.min())}")
        offs = a.astype(np.int64)
    top = max_position + (int(offs.max()) if offs is not None and offs.size else 0)
    if top >= 1 << 24:
        raise ValueError(f"rope_offsets: positions reach {top}; fused RoPE needs positions < 2^24 (exact in float32)")
    return rope, (offs.astype(np.int32) if offs is not None else None)


def plan_variant(variant, num_qo_heads: int, batch: int, soft_cap: bool, window: bool, custom_mask: bool,
                 alibi_slopes, sinks, variant_params, rope=None, rope_offsets=None, max_position: int = 0):
    """(Variant, checked values for Variant.data) from a plan()'s arguments, before any GPU work; errors name the
    argument."""
    slopes = check_per_head(alibi_slopes, num_qo_heads, "alibi_slopes", "slope")
    sinks = check_per_head(sinks, num_qo_heads, "sinks", "sink logit")
    rope, offs = check_rope(rope, rope_offsets, batch, max_position)
    v = choose(variant, soft_cap, window, custom_mask, slopes is not None, sinks is not None, variant_params,
               0 if rope is None else (2 if rope.interleave else 1))
    values = check_params(v, variant_params, num_qo_heads, batch) if v.params else None
    return v, dict(sinks=sinks, slopes=slopes, values=values, rope=rope, rope_offsets=offs)
