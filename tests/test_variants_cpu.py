"""User variants without a GPU: validation, compilation into every kernel (no spills), compile errors that show
the snippet's own lines, and the graph-mode bake of the variant."""
import pytest

import kvattn
from kvattn import decode, prefill, variants
from kvattn.variants import Variant
from _user_variants import EVEN_KEYS, HALF_LOGITS

ARCH = "sm_90a"


def test_from_cuda_validates_name_and_source():
    with pytest.raises(ValueError, match="name: expected a C.. identifier"):
        Variant.from_cuda("not a name", "struct x {};")
    with pytest.raises(ValueError, match="source: expected CUDA source defining `struct Foo"):
        Variant.from_cuda("Foo", "struct Bar : kvattn::VariantBase {};")
    v = Variant.from_cuda("Foo", "struct Foo : kvattn::VariantBase {};")
    assert v.is_user and v.decode_type() == "Foo" and v.prefill_type() == "Foo" and v.prelude()[0] == "variant_Foo"


def test_choose_refuses_a_user_variant_with_builtin_keywords():
    assert variants.choose(None, True, False, False) == Variant(soft_cap=True)
    assert variants.choose(HALF_LOGITS, False, False, False) is HALF_LOGITS
    with pytest.raises(ValueError, match="cannot be combined with logits_soft_cap"):
        variants.choose(HALF_LOGITS, False, True, False)
    with pytest.raises(TypeError, match="variant: expected a kvattn.Variant"):
        variants.choose("HalfLogits", False, False, False)


@pytest.mark.parametrize("v", [HALF_LOGITS, EVEN_KEYS], ids=["half_logits", "even_keys"])
def test_user_variants_compile_into_every_kernel_without_spills(v):
    specs = [decode.decode_spec(128, 1, v, "bfloat16"), decode.decode_spec(64, 1, v, "float16"),
             prefill.sm90_spec(128, v, "bfloat16")] + [prefill.prefill_spec(128, r, v, "bfloat16") for r in (128, 64, 16)]
    for spec in specs:
        compiled, _ = spec.compile(ARCH)
        for name, r in compiled.resources.items():
            assert r.spills == 0 and r.stack_frame == 0, (spec.uri(), r)


def test_compile_error_shows_the_snippets_own_lines():
    bad = Variant.from_cuda("Broken", "struct Broken : kvattn::VariantBase {\n  static constexpr bool kLogits = true;\n"
                                      "  template <class P> __device__ static float logits(const P&, float x) {\n"
                                      "    return x * not_declared;\n  }\n};\n")
    with pytest.raises(kvattn.CompileError) as e:
        decode.decode_spec(128, 1, bad, "bfloat16").compile(ARCH)
    msg = str(e.value)
    assert "variant_Broken(4): error" in msg and ">    4 |     return x * not_declared;" in msg


def test_graph_mode_bakes_the_variant():
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=4, max_num_pages=64, num_sms=132)
    pt = kvattn.PageTable.from_kv_lens([30, 5], 16, rng=0)
    try:
        w.plan(pt, 8, 2, 128, variant=HALF_LOGITS)
    except kvattn.CudaUnavailableError:
        w._baked = w._pending_bake
    with pytest.raises(ValueError, match="in graph mode variant is baked"):
        w.plan(pt, 8, 2, 128, variant=EVEN_KEYS)


def test_alibi_compiles_into_every_kernel_without_spills():
    v = Variant(alibi=True)
    assert v.decode_type() == "kvattn::Builtin<false, false, false, true>"
    specs = [decode.decode_spec(d, 1, v, "bfloat16") for d in (64, 128, 256)]
    specs += [prefill.sm90_spec(d, v, "bfloat16") for d in (64, 128)]
    specs += [prefill.prefill_spec(128, r, v, "bfloat16") for r in (128, 64, 16)] + [prefill.prefill_spec(256, 64, v, "bfloat16")]
    for spec in specs:
        compiled, _ = spec.compile(ARCH)
        for name, r in compiled.resources.items():
            assert r.spills == 0 and r.stack_frame == 0, (spec.uri(), r)


def test_alibi_slopes_are_validated_before_any_gpu_call():
    import numpy as np
    w = kvattn.BatchDecodeWithPagedKVCache(num_sms=132)
    pt = kvattn.PageTable.from_kv_lens([30, 5], 16, rng=0)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(8,\)"):
        w.plan(pt, 8, 2, 128, alibi_slopes=np.ones(4))
    with pytest.raises(TypeError, match="alibi_slopes: expected a float array"):
        w.plan(pt, 8, 2, 128, alibi_slopes=np.array(["a"] * 8))
    with pytest.raises(ValueError, match="alibi_slopes: must be finite"):
        w.plan(pt, 8, 2, 128, alibi_slopes=np.full(8, np.nan))
    with pytest.raises(ValueError, match="cannot be combined with .* alibi_slopes"):
        w.plan(pt, 8, 2, 128, alibi_slopes=np.ones(8), variant=HALF_LOGITS)
