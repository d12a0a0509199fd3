"""CPU tests of the kernels' types-and-dims traits (cuda_src/traits.cuh AttnTypes): every instance built today is
accepted with the sizes Python launches with, and unequal QK / VO head dims are a new instantiation, not a new
kernel (compile only: no op runs them)."""
import os
import sys

import pytest

from kvattn import compiler, decode, kernels, prefill
from kvattn._errors import CompileError
from kvattn.variants import Variant

ARCH = "sm_90a"
ATTN_HEADERS = ("decode.cuh", "prefill.cuh", "prefill_sm90.cuh")


def test_attn_types_spells_q_kv_o_and_both_head_dims():
    assert kernels.attn_types(128, "bfloat16") == \
        "kvattn::AttnTypes<128, 128, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16>"
    assert kernels.attn_types(192, "float16", "float8_e4m3fn", 128) == \
        "kvattn::AttnTypes<192, 128, half, __nv_fp8_e4m3, half>"
    # a 16-bit cache of q's type is one instance whether kv_dtype is given or not
    assert decode.decode_spec(64, 1, Variant(), "float16", kv_dtype="float16") == \
        decode.decode_spec(64, 1, Variant(), "float16")


def test_traits_accept_every_instance_built_with_pythons_sizes():
    """One translation unit of every attention instance scripts/fill_cache.py builds (built-in variants): each
    kernel struct instantiated (its and AttnTypes' static_asserts) and its SMEM_BYTES / THREADS / ROWS checked
    against the values Python launches with."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import fill_cache
    specs = [s for s in fill_cache.specs() if s.header in ATTN_HEADERS and not s.prelude[1]]
    assert len(specs) > 500
    by_defines = {}   # one translation unit per set of defines (tile sizes depend on some)
    for s in specs:
        by_defines.setdefault(s.defines, {}).update(dict.fromkeys(s.checks))
    for defines, checks in by_defines.items():
        src = "".join(f"#define {k} {v}\n" for k, v in defines) + "".join(
            f'#include "{h}"\n' for h in ATTN_HEADERS) + "".join(
            f'static_assert(({e}) == {v}, "{e}");\n' for e, v in checks)
        compiler.compile_cubin(src, "traits_asserts.cu", [], [], ARCH)


@pytest.mark.parametrize("kv,variant", [
    ("bfloat16", Variant()), ("bfloat16", Variant(soft_cap=True, window=True)), ("bfloat16", Variant(sink=True)),
    ("float8_e4m3fn", Variant()), ("float8_e5m2", Variant(soft_cap=True))])
def test_decode_of_unequal_head_dims_compiles_without_spills(kv, variant):
    """DeepSeek's head dims (QK 192, VO 128) through the real spec builder: the SMEM_BYTES check holds and
    ptxas spills nothing. (Fused RoPE is not offered there: its thread layouts need D_QK / 8 to divide 32, and
    DeepSeek rotates only part of the dims.)"""
    spec = decode.decode_spec(192, 1, variant, "bfloat16", kv_dtype=kv, head_dim_vo=128)
    assert "AttnTypes<192, 128, " in spec.kernel
    compiled, _ = spec.compile(ARCH)
    (res,) = compiled.resources.values()
    assert res.spills == 0 and res.stack_frame == 0, res


@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("rows", sorted(prefill.CONFIGS))
def test_sm80_prefill_of_unequal_head_dims_compiles_without_spills(kv, rows):
    spec = prefill.prefill_spec(192, rows, Variant(), "bfloat16", kv, head_dim_vo=128)
    compiled, _ = spec.compile(ARCH)
    (res,) = compiled.resources.values()
    assert res.spills == 0 and res.stack_frame == 0, res


def test_fused_rope_rejects_head_dims_its_thread_layout_does_not_tile():
    spec = decode.decode_spec(192, 1, Variant(rope=1), "bfloat16", head_dim_vo=128)
    with pytest.raises(CompileError, match="tile a warp"):
        spec.compile(ARCH)
