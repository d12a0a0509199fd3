"""User variants without a GPU: validation, compilation into every kernel (no spills), compile errors that show
the snippet's own lines, and the graph-mode bake of the variant."""
import numpy as np
import pytest

import kvattn
from kvattn import decode, prefill, variants
from kvattn.merge import merge_spec
from kvattn.variants import Variant, VariantParam
from _user_variants import EVEN_KEYS, HALF_LOGITS, HEAD_SCALE, SIGMOID

ARCH = "sm_90a"


def assert_no_spills(specs):
    """Every spec compiles for ARCH with no spills and no stack frame."""
    for spec in specs:
        compiled, _ = spec.compile(ARCH)
        for name, r in compiled.resources.items():
            assert r.spills == 0 and r.stack_frame == 0, (spec.uri(), r)


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


@pytest.mark.parametrize("v", [HALF_LOGITS, EVEN_KEYS, SIGMOID, HEAD_SCALE],
                         ids=["half_logits", "even_keys", "sigmoid", "head_scale"])
def test_user_variants_compile_into_every_kernel_without_spills(v):
    specs = [decode.decode_spec(128, 1, v, "bfloat16"), decode.decode_spec(64, 1, v, "float16"),
             prefill.sm90_spec(128, v, "bfloat16")] + [prefill.prefill_spec(128, r, v, "bfloat16") for r in (128, 64, 16)]
    specs.append(merge_spec("float32", "bfloat16", v))   # the output hook of split rows
    assert_no_spills(specs)


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
    assert_no_spills(specs)


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


def test_sinks_compile_into_every_kernel_without_spills():
    v = Variant(sink=True)
    assert v.decode_type() == "kvattn::Builtin<false, false, false, false, true>"
    assert Variant(alibi=True).merge_type() is None and v.merge_type() is not None
    for vv in (v, Variant(alibi=True, sink=True, window=True, soft_cap=True)):
        specs = [decode.decode_spec(d, 1, vv, "bfloat16") for d in (64, 128, 256)]
        specs += [prefill.sm90_spec(d, vv, "bfloat16") for d in (64, 128)]
        specs += [prefill.prefill_spec(128, r, vv, "bfloat16") for r in (128, 64, 16)]
        specs.append(merge_spec("float32", "bfloat16", vv))
        assert_no_spills(specs)


def test_sinks_and_variant_params_are_validated_before_any_gpu_call():
    w = kvattn.BatchDecodeWithPagedKVCache(num_sms=132)
    p = kvattn.BatchPrefillWithRaggedKVCache(num_sms=132)
    pt = kvattn.PageTable.from_kv_lens([30, 5], 16, rng=0)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(8,\) \(one sink logit per query head\)"):
        w.plan(pt, 8, 2, 128, sinks=np.ones(4))
    with pytest.raises(ValueError, match="sinks: must be finite"):
        p.plan([0, 3], [0, 9], 8, 2, 128, sinks=np.full(8, np.inf))
    with pytest.raises(ValueError, match="cannot be combined with .* sinks"):
        w.plan(pt, 8, 2, 128, sinks=np.ones(8), variant=HALF_LOGITS)
    with pytest.raises(ValueError, match="variant_params: given without a user variant"):
        w.plan(pt, 8, 2, 128, variant_params={"bias": 1.0})
    with pytest.raises(ValueError, match=r"variant_params\['bias'\]: missing \(scalar float32"):
        w.plan(pt, 8, 2, 128, variant=SIGMOID)
    with pytest.raises(ValueError, match=r"variant_params: \['scale'\] not declared by variant SigmoidAttention"):
        w.plan(pt, 8, 2, 128, variant=SIGMOID, variant_params={"bias": 0.0, "scale": 2.0})
    with pytest.raises(ValueError, match=r"variant_params\['bias'\]: expected shape \(\) \(a scalar\), got \(2,\)"):
        p.plan([0, 3], [0, 9], 8, 2, 128, variant=SIGMOID, variant_params={"bias": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"variant_params\['head_scale'\]: expected shape \(8,\) \(one value per "
                                         r"query head\)"):
        w.plan(pt, 8, 2, 128, variant=HEAD_SCALE, variant_params={"head_scale": np.ones(2)})
    with pytest.raises(ValueError, match=r"variant_params\['head_scale'\]: must be finite"):
        w.plan(pt, 8, 2, 128, variant=HEAD_SCALE, variant_params={"head_scale": np.full(8, np.nan)})
    with pytest.raises(TypeError, match=r"variant_params\['bias'\]: expected a number"):
        w.plan(pt, 8, 2, 128, variant=SIGMOID, variant_params={"bias": "x"})
    with pytest.raises(TypeError, match="variant_params: expected a dict"):
        w.plan(pt, 8, 2, 128, variant=SIGMOID, variant_params=[1.0])


def test_variant_param_declarations_are_validated():
    with pytest.raises(ValueError, match="kind must be one of"):
        Variant.from_cuda("Foo", "struct Foo : kvattn::VariantBase {};", params={"a": "per_token"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        Variant.from_cuda("Foo", "struct Foo : kvattn::VariantBase {};", params={"a": ("scalar", "float64")})
    with pytest.raises(ValueError, match="a parameter name must be a C.. identifier"):
        Variant.from_cuda("Foo", "struct Foo : kvattn::VariantBase {};", params={"a b": "scalar"})
    with pytest.raises(ValueError, match="duplicate parameter names"):
        Variant.from_cuda("Foo", "struct Foo : kvattn::VariantBase {};",
                          params=[VariantParam("a"), VariantParam("a", "per_head")])


def test_variant_data_layout():
    """Built-ins: sinks then slopes. User variants: one word per parameter (a scalar's value, an array's word
    offset), then the arrays; per-request arrays sized by the graph-mode bound."""
    v = Variant(alibi=True, sink=True)
    d = v.data(3, 2, 2, sinks=np.array([1, 2, 3], np.float32), slopes=np.array([4, 5, 6], np.float32))
    assert d.tolist() == [1, 2, 3, 4, 5, 6]
    assert Variant().data(3, 2, 2) is None and HALF_LOGITS.data(3, 2, 2) is None
    u = Variant.from_cuda("Foo", "struct Foo : kvattn::VariantBase {};",
                          params={"b": "scalar", "h": "per_head", "r": ("per_request", "int32"), "n": ("scalar", "int32")})
    d = u.data(3, 2, 5, values={"b": 0.5, "h": [1, 2, 3], "r": [7, 8], "n": 9})
    ints = d.view(np.int32)
    assert d[0] == 0.5 and ints[1] == 4 and ints[2] == 7 and ints[3] == 9
    assert d[4:7].tolist() == [1, 2, 3] and ints[7:12].tolist() == [7, 8, 0, 0, 0]
    with pytest.raises(TypeError, match=r"variant_params\['r'\]: expected integers"):
        u.data(3, 2, 5, values={"b": 0.5, "h": [1, 2, 3], "r": [7.5, 8], "n": 9})
    # plan()'s path: plan_variant checks the values, then data() packs them (and checks them again)
    v2, vals = variants.plan_variant(u, 3, 2, False, False, False, None, None,
                                     {"b": 0.5, "h": [1, 2, 3], "r": [7, 8], "n": 9})
    assert v2 is u and np.array_equal(u.data(3, 2, 5, **vals), d)
    gen = u.prelude()[2]
    assert "struct FooParams" in gen and "static const int* r(const P& p)" in gen and "static float b(" in gen


def test_a_parameter_accessor_compiles_and_errors_point_at_the_snippet():
    bad = Variant.from_cuda("UsesParam", "struct UsesParam : kvattn::VariantBase {\n  static constexpr bool kLogits = true;\n"
                            "  template <class P> __device__ static float logits(const P& p, float x) {\n"
                            "    return x * UsesParamParams::scale(p) * missing;\n  }\n};\n", params={"scale": "scalar"})
    with pytest.raises(kvattn.CompileError) as e:
        decode.decode_spec(128, 1, bad, "bfloat16").compile(ARCH)
    msg = str(e.value)
    assert "variant_UsesParam(4): error" in msg and "missing" in msg and "UsesParamParams::scale" in msg


def test_graph_mode_lets_variant_data_change_but_not_the_variant():
    w = kvattn.BatchDecodeWithPagedKVCache(use_cuda_graph=True, max_batch_size=4, max_num_pages=64, num_sms=132)
    pt = kvattn.PageTable.from_kv_lens([30, 5], 16, rng=0)
    try:
        w.plan(pt, 8, 2, 128, sinks=np.ones(8))
    except kvattn.CudaUnavailableError:
        w._baked = w._pending_bake
    with pytest.raises(ValueError, match="in graph mode variant is baked"):
        w.plan(pt, 8, 2, 128)
    try:   # new sink values are plan data, not baked
        w.plan(pt, 8, 2, 128, sinks=np.zeros(8))
    except kvattn.CudaUnavailableError:
        pass


def test_rope_compiles_into_every_kernel_without_spills():
    assert Variant(rope=2).decode_type() == "kvattn::Builtin<false, false, false, false, false, 2>"
    for v in (Variant(rope=1), Variant(rope=2), Variant(rope=1, sink=True, alibi=True, window=True)):
        specs = [decode.decode_spec(d, 1, v, "bfloat16") for d in (64, 128, 256)]
        specs += [prefill.prefill_spec(128, r, v, "bfloat16") for r in (64, 16)] + [prefill.prefill_spec(256, 64, v, "bfloat16")]
        specs += [prefill.sm90_spec(d, v, "bfloat16") for d in (64, 128)]
        assert_no_spills(specs)


def test_rope_arguments_are_validated_before_any_gpu_call():
    w = kvattn.BatchDecodeWithPagedKVCache(num_sms=132)
    pt = kvattn.PageTable.from_kv_lens([30, 5], 16, rng=0)
    with pytest.raises(ValueError, match=r"rope.theta: expected a finite number > 0"):
        kvattn.RoPE(theta=-1.0)
    with pytest.raises(ValueError, match=r"rope.scale: expected a finite number > 0"):
        kvattn.RoPE(scale=float("nan"))
    with pytest.raises(TypeError, match="rope: expected a kvattn.RoPE"):
        w.plan(pt, 8, 2, 128, rope=1e4)
    with pytest.raises(ValueError, match="rope_offsets: given without rope"):
        w.plan(pt, 8, 2, 128, rope_offsets=[0, 1])
    with pytest.raises(ValueError, match=r"rope_offsets: expected shape \(2,\) \(one offset per request\)"):
        w.plan(pt, 8, 2, 128, rope=kvattn.RoPE(), rope_offsets=[0, 1, 2])
    with pytest.raises(TypeError, match="rope_offsets: expected an integer array"):
        w.plan(pt, 8, 2, 128, rope=kvattn.RoPE(), rope_offsets=[0.5, 1])
    with pytest.raises(ValueError, match="rope_offsets: must be >= 0"):
        w.plan(pt, 8, 2, 128, rope=kvattn.RoPE(), rope_offsets=[-1, 1])
    with pytest.raises(ValueError, match="positions < 2.24"):
        w.plan(pt, 8, 2, 128, rope=kvattn.RoPE(), rope_offsets=[1 << 24, 1])
    with pytest.raises(ValueError, match="cannot be combined with .* rope"):
        w.plan(pt, 8, 2, 128, rope=kvattn.RoPE(), variant=HALF_LOGITS)


def test_rope_data_layout():
    v = Variant(rope=1, sink=True)
    d = v.data(2, 2, 3, sinks=np.array([1, 2], np.float32), rope=kvattn.RoPE(theta=1e4, scale=4.0),
               rope_offsets=np.array([5, 7], np.int32))
    assert d[:2].tolist() == [1, 2] and np.isclose(d[2], np.log2(1e4)) and d[3] == 0.25
    assert d[4:].view(np.int32).tolist() == [5, 7, 0]
