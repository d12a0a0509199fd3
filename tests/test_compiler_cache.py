"""CPU tests of the NVRTC compiler, the on-disk cache and the kernel registry (no GPU needed)."""
import multiprocessing as mp
import os

import numpy as np
import pytest

from kvattn import cache, compiler, kernels, merge
from kvattn._errors import CompileError

ARCH = "sm_90a"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVATTN_CACHE_DIR", str(tmp_path))
    cache.clear_memo()
    yield tmp_path
    cache.clear_memo()


def test_compile_error_has_log_options_and_source_lines():
    src = "__global__ void k(float* x) {\n  x[0] = 1.0f;\n  this_is_not_declared(x);\n}\n"
    with pytest.raises(CompileError) as e:
        compiler.compile_cubin(src, "bad.cu", [], [], ARCH)
    msg = str(e.value)
    assert "this_is_not_declared" in e.value.log
    assert "-arch=sm_90a" in e.value.options
    assert ">    3 |   this_is_not_declared(x);" in e.value.source_excerpt
    assert "NVRTC failed to compile bad.cu" in msg


def test_ptxas_report_is_parsed_per_kernel():
    src = ("template <int N> __global__ void k(float* x) { __shared__ float s[N]; s[threadIdx.x] = x[threadIdx.x];"
           " __syncthreads(); x[threadIdx.x] = s[N - 1 - threadIdx.x]; }\n")
    c = compiler.compile_cubin(src, "t.cu", [], ["k<64>", "k<128>"], ARCH)
    assert c.cubin[:4] == b"\x7fELF"
    r64, r128 = c.resources[c.lowered["k<64>"]], c.resources[c.lowered["k<128>"]]
    assert (r64.static_smem, r128.static_smem) == (256, 512)
    assert r64.registers > 0 and r64.spills == 0


def test_serialized_wgmma_is_reported_per_kernel():
    """ptxas's C7515 names the function whose wgmmas it serialised (the log of run 33a's XQK build, shortened):
    that kernel's Resources say so, the other kernel's do not."""
    log = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z1av\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 168 registers\n"
           "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'\n"
           "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline "
           "stage in the function '_Z1bv'\n"
           "ptxas info    : Function properties for _Z1bv\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 168 registers\n")
    res = compiler.parse_ptxas_report(log)
    assert not res["_Z1av"].wgmma_serialized
    assert res["_Z1bv"].wgmma_serialized and res["_Z1bv"].registers == 168


def test_spill_is_reported():
    # A large register array indexed at run time goes to local memory: a stack frame the compile step flags.
    src = ("__global__ void k(float* x, int i) { float a[256]; for (int j = 0; j < 256; ++j) a[j] = x[j];"
           " x[0] = a[i]; }\n")
    c = compiler.compile_cubin(src, "s.cu", [], ["k"], ARCH)
    assert c.resources[c.lowered["k"]].stack_frame > 0


def test_cache_key_has_no_absolute_paths_and_is_stable():
    spec = merge.merge_spec("bfloat16", "bfloat16")
    k1 = cache.key(spec.source(), spec.all_options(), [spec.kernel], ARCH)
    k2 = cache.key(spec.source(), spec.all_options(), [spec.kernel], ARCH)
    assert k1 == k2
    assert k1 != cache.key(spec.source(), spec.all_options(), [spec.kernel], "sm_90")
    assert os.sep + "work" not in spec.source() and compiler.source_dir() not in " ".join(spec.all_options())


def test_disk_cache_hit_and_corrupt_entry_is_a_miss(cache_dir):
    spec = merge.merge_spec("float16", "float16")
    c1, where1 = spec.compile(ARCH)
    assert where1 == "compiled"
    cache.clear_memo()
    c2, where2 = spec.compile(ARCH)
    assert where2 == "disk" and c2.cubin == c1.cubin and c2.resources == c1.resources
    # Corrupt every entry: a miss, then a rebuild that writes a good entry again.
    for root, _, files in os.walk(cache_dir):
        for f in files:
            p = os.path.join(root, f)
            data = bytearray(open(p, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(p, "wb").write(bytes(data))
    cache.clear_memo()
    c3, where3 = spec.compile(ARCH)
    assert where3 == "compiled" and c3.cubin[:4] == b"\x7fELF"  # NVRTC output is not byte-reproducible
    cache.clear_memo()
    assert spec.compile(ARCH)[1] == "disk"


def _compile_in_child(args):
    path, in_dtype = args
    os.environ["KVATTN_CACHE_DIR"] = path
    cache.clear_memo()
    c, _ = merge.merge_spec(in_dtype, in_dtype).compile(ARCH)
    return len(c.cubin)


def test_compile_log_names_each_miss_and_no_hit(cache_dir, tmp_path, monkeypatch):
    log = tmp_path / "compiles.log"
    monkeypatch.setenv("KVATTN_COMPILE_LOG", str(log))
    spec = merge.merge_spec("float16", "float16")
    spec.compile(ARCH)
    cache.clear_memo()
    assert spec.compile(ARCH)[1] == "disk"
    lines = log.read_text().splitlines()
    assert len(lines) == 1
    seconds, name = lines[0].split(" ", 1)
    assert name == spec.uri() and float(seconds) >= 0


def test_two_processes_compiling_the_same_kernel_both_succeed(cache_dir):
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        sizes = pool.map(_compile_in_child, [(str(cache_dir), "float32")] * 2)
    assert sizes[0] == sizes[1] > 0
    entries = [f for _, _, fs in os.walk(cache_dir) for f in fs]
    assert len(entries) == 1 and entries[0].endswith(".cubin")


def test_param_struct_size_matches_c_struct():
    src = '#include "merge.cuh"\n' + kernels.size_assert("kvattn::MergeParams", merge.MERGE_PARAMS)
    compiler.compile_cubin(src, "asserts.cu", [], [], ARCH)
    bad = np.dtype([(n, merge.MERGE_PARAMS.fields[n][0]) for n in merge.MERGE_PARAMS.names][1:], align=True)
    with pytest.raises(CompileError, match="size differs"):
        compiler.compile_cubin('#include "merge.cuh"\n' + kernels.size_assert("kvattn::MergeParams", bad),
                               "asserts_bad.cu", [], [], ARCH)
    probe = '#include "merge.cuh"\n' + kernels.layout_probe("kvattn::MergeParams", merge.MERGE_PARAMS)
    compiler.compile_cubin(probe, "probe.cu", [], ["kvattn_layout_probe"], ARCH)


def test_every_registered_kernel_compiles_without_spills(cache_dir):
    from kvattn import ops  # noqa: F401
    for op, specs in kernels.REGISTRY.items():
        for spec in specs:
            c, _ = spec.compile(ARCH)
            for name, r in c.resources.items():
                assert r.spills == 0 and r.stack_frame == 0 and not r.wgmma_serialized, f"{spec.uri()}: {r}"


def test_a_size_python_relies_on_is_checked_by_the_compiler():
    """decode / prefill specs carry static_asserts of the kernel's SMEM_BYTES, THREADS (and ROWS) against the
    values Python launches with: a drifted value fails to compile, naming the constant."""
    import dataclasses
    from kvattn import decode, prefill
    from kvattn.variants import Variant
    spec = decode.decode_spec(64, 1, Variant(), "bfloat16")
    assert [e.split("::")[-1] for e, _ in spec.checks] == ["SMEM_BYTES", "THREADS"]
    assert dict(prefill.sm90_spec(128, Variant(), "bfloat16").checks)[
        "kvattn::PrefillSm90<kvattn::AttnTypes<128, 128, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16>, "
        "kvattn::Builtin<false, false, false>>::SMEM_BYTES"] == \
        prefill.sm90_smem_bytes(128)
    (expr, value), threads = spec.checks
    bad = dataclasses.replace(spec, checks=((expr, value + 16), threads))
    with pytest.raises(CompileError) as e:
        bad.compile("sm_90a")
    assert f"SMEM_BYTES differs from the {value + 16} kvattn (Python) launches with" in str(e.value)


def test_fill_cache_entry_path_is_where_compile_stores_the_spec(cache_dir):
    """scripts/pack_cache.sh packs exactly fill_cache.py's entry paths: each must be the file a compile wrote."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "fill_cache.py")
    mod = importlib.util.spec_from_file_location("fill_cache", path)
    fill_cache = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(fill_cache)
    spec = merge.merge_spec("float16", "float16")
    spec.compile(ARCH)
    written = [os.path.relpath(os.path.join(r, f), cache_dir) for r, _, fs in os.walk(cache_dir) for f in fs]
    assert written == [fill_cache.entry_path(spec, ARCH)]
