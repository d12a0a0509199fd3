"""KernelSpec -> compiled, loaded Kernel; launches with one packed parameter struct.

A KernelSpec names a header of cuda_src, a kernel name expression (template arguments included) and
-D defines. Its cubin comes from the cache (memo, disk) or NVRTC. Every spec a kvattn op may build
registers itself in `REGISTRY` so `python -m kvattn compile` can build the documented default set.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct
import threading

import numpy as np

from . import _driver, _dtypes, cache, device as _device
from ._errors import CudaError
from .stream import as_stream

BASE_OPTIONS = ("-lineinfo", "--ptxas-options=--warn-on-spills")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    header: str                      # file in cuda_src, e.g. "merge.cuh"
    kernel: str                      # name expression, e.g. "kvattn::merge_states_kernel<float, 128>"
    defines: tuple = ()              # ((name, value), ...)
    options: tuple = ()              # extra NVRTC options
    prelude: tuple = ("", "", "")    # (file name, source, generated code) compiled after the header: a user
                                     # variant's struct and its parameter accessors
    checks: tuple = ()               # ((C++ constant expression, the value Python uses), ...): static_asserts, so
                                     # that a size Python relies on (shared memory, threads) cannot drift

    def uri(self) -> str:
        d = ",".join(f"{k}={v}" for k, v in self.defines)
        p = f"+{self.prelude[0]}" if self.prelude[1] else ""
        return f"{self.header}:{self.kernel}" + (f"[{d}]" if d else "") + p

    def source(self) -> str:
        lines = [f"#define {k} {v}" for k, v in self.defines]
        lines.append(f'#include "{self.header}"')
        if self.prelude[1]:   # the snippet's errors point at its own lines
            if self.prelude[2]:
                lines += [f'#line 1 "{self.prelude[0]}_params"', self.prelude[2]]
            lines += [f'#line 1 "{self.prelude[0]}"', self.prelude[1]]
        for expr, value in self.checks:
            lines.append(f'static_assert(({expr}) == {value}, "{expr} differs from the {value} kvattn (Python) '
                         f'launches with");')
        return "\n".join(lines) + "\n"

    def all_options(self) -> tuple:
        return BASE_OPTIONS + tuple(self.options)

    def compile(self, arch: str):
        """(Compiled, where): build or fetch the cubin for arch without touching the GPU."""
        files = ({self.prelude[0]: self.prelude[1], f"{self.prelude[0]}_params": self.prelude[2]}
                 if self.prelude[1] else None)
        return cache.get_or_compile(self.source(), self.uri(), self.all_options(), [self.kernel], arch, files)


def attn_types(head_dim: int, dtype: str, kv_dtype: str | None = None, head_dim_vo: int | None = None) -> str:
    """The element types and head dims an attention kernel is built with (cuda_src/traits.cuh,
    `AttnTypes<D_QK, D_VO, Q, KV, O>`): queries of dtype, a cache of kv_dtype (None: dtype), the output of q's
    dtype; head_dim is Q / K's, head_dim_vo V / O's (None: head_dim)."""
    q = _dtypes.to_ctype(dtype)
    return (f"kvattn::AttnTypes<{head_dim}, {head_dim_vo or head_dim}, {q}, {_dtypes.to_ctype(kv_dtype or dtype)}, "
            f"{q}>")


REGISTRY: dict[str, list] = {}   # op name -> [KernelSpec] of its documented default instantiations


def register(op: str, specs):
    REGISTRY.setdefault(op, []).extend(specs)


@functools.lru_cache(maxsize=None)
def _run_packer(dtype: np.dtype, names: tuple):
    """(pack_into of one struct.Struct over these adjacent fields, the first's byte offset): ParamBuffer.setter's,
    built once per struct layout (every plan() asks for the same few)."""
    fields = dtype.fields
    for a, b in zip(names, names[1:]):
        if fields[b][1] != fields[a][1] + fields[a][0].itemsize:
            raise ValueError(f"setter: {names} are not adjacent fields of the struct (each must start where "
                             f"the previous one ends)")
    st = struct.Struct("<" + "".join(_FORMATS[f"{fields[n][0].kind}{fields[n][0].itemsize}"][1] for n in names))
    return st.pack_into, fields[names[0]][1]


class ParamBuffer:
    """A packed parameter struct (layout of a numpy structured dtype mirroring a C struct) in a ctypes buffer,
    with its prebuilt void** for cuLaunchKernel. set() packs fields with precompiled struct.Struct objects
    (a numpy record field assignment costs ~1 us; this ~0.2 us), which keeps run() host time low."""

    __slots__ = ("dtype", "raw", "argv", "argv_addr", "_packers")

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.raw = (ctypes.c_char * dtype.itemsize)()
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.raw))
        self.argv_addr = ctypes.addressof(self.argv)
        self._packers = _packers(dtype)

    @property
    def array(self) -> np.ndarray:
        """A numpy view (one record) of the packed bytes."""
        return np.frombuffer(self.raw, self.dtype)

    def __setitem__(self, name, value):
        st, off = self._packers[name]
        st.pack_into(self.raw, off, value)

    def __getitem__(self, name):
        st, off = self._packers[name]
        return st.unpack_from(self.raw, off)[0]

    def set(self, **fields):
        packers, raw = self._packers, self.raw
        for k, v in fields.items():
            st, off = packers[k]
            st.pack_into(raw, off, v)
        return self

    def set_bytes(self, offset: int, data: bytes):
        """Copy raw bytes (e.g. tensor maps) into the struct at a byte offset."""
        if offset < 0 or offset + len(data) > self.dtype.itemsize:
            raise ValueError(f"set_bytes: {len(data)} bytes at {offset} overrun the {self.dtype.itemsize}-byte struct")
        ctypes.memmove(ctypes.addressof(self.raw) + offset, data, len(data))

    def setter(self, *names):
        """A function f(*values) that packs these fields, adjacent in the struct, with one pack_into (run()'s hot
        path sets its pointers and strides this way)."""
        pack, off = _run_packer(self.dtype, names)
        raw = self.raw

        def set_fields(*values):
            pack(raw, off, *values)
        return set_fields


class ParamPack:
    """Several parameter structs as one kernel's consecutive arguments (the mixed launch: the prefill part's, the
    decode part's and its own), each still written through its own ParamBuffer (so its op's run() binds it)."""

    __slots__ = ("parts", "argv", "argv_addr")

    def __init__(self, *parts: ParamBuffer):
        self.parts = parts
        self.argv = (ctypes.c_void_p * len(parts))(*[ctypes.addressof(p.raw) for p in parts])
        self.argv_addr = ctypes.addressof(self.argv)


NEG_INF_BITS = 0xFF800000   # float32 -inf: an empty state's lse


class Memset32:
    """A plan step beside its Launches: `height` rows of `width` 32-bit values set to `value`, rows `pitch` bytes
    apart, from device address dst (cuMemsetD2D32Async; capturable). launch(stream handle) issues it."""

    __slots__ = ("dst", "pitch", "value", "width", "height")

    def __init__(self, dst: int, pitch: int, value: int, width: int, height: int):
        self.dst, self.pitch, self.value, self.width, self.height = dst, pitch, value, width, height

    def launch(self, stream_handle):
        if self.width and self.height:
            _driver.call("cuMemsetD2D32Async", self.dst, self.pitch, self.value, self.width, self.height,
                         stream_handle)


_FORMATS = {"u8": "<Q", "i8": "<q", "i4": "<i", "u4": "<I", "f4": "<f", "f8": "<d"}


@functools.lru_cache(maxsize=None)
def _packers(dtype: np.dtype) -> dict:
    out = {}
    for name, (ft, off) in dtype.fields.items():
        if ft.kind != "V":   # raw byte fields (tensor maps) are written with set_bytes
            out[name] = (struct.Struct(_FORMATS[f"{ft.kind}{ft.itemsize}"]), off)
    return out


class Kernel:
    """A loaded kernel function."""

    def __init__(self, spec: KernelSpec, compiled):
        drv = _driver.driver()
        self.spec = spec
        self.name = compiled.lowered[spec.kernel]
        self.resources = compiled.resources.get(self.name)
        major, minor = _driver.current_device().compute_capability
        self.sm = 10 * major + minor   # the loading device's compute capability, e.g. 90
        self.module = _driver.call("cuModuleLoadData", compiled.cubin)
        self.function = _driver.call("cuModuleGetFunction", self.module, self.name.encode())
        self._max_dynamic_smem = 48 * 1024
        self._launch = drv.cuLaunchKernel
        self._attr_smem = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._attr_carveout = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT

    def _allow_smem(self, nbytes: int):
        """Raise the dynamic shared memory limit (above 48 KB) and prefer the largest shared-memory carveout,
        so as many CTAs as the shared memory allows are resident."""
        if nbytes > self._max_dynamic_smem:
            _driver.call("cuFuncSetAttribute", self.function, self._attr_smem, nbytes)
            _driver.call("cuFuncSetAttribute", self.function, self._attr_carveout, 100)
            self._max_dynamic_smem = nbytes

    def launch(self, grid, block, shared_bytes: int, params, stream=None):
        """Launch with grid/block (3-tuples or ints), dynamic shared memory bytes, a ParamBuffer (or a
        numpy structured array holding one struct) and a stream (see stream.as_stream)."""
        if shared_bytes > self._max_dynamic_smem:
            self._allow_smem(shared_bytes)
        if isinstance(params, ParamBuffer):
            argv_addr, keep = params.argv_addr, None
        else:
            keep = (ctypes.c_void_p * 1)(params.ctypes.data)  # a numpy structured array (slower path)
            argv_addr = ctypes.addressof(keep)
        gx, gy, gz = grid if isinstance(grid, tuple) else (grid, 1, 1)
        bx, by, bz = block if isinstance(block, tuple) else (block, 1, 1)
        handle = stream.handle if stream is not None and hasattr(stream, "handle") else as_stream(stream).handle
        err, = self._launch(self.function, gx, gy, gz, bx, by, bz, shared_bytes, handle, argv_addr, 0)
        if err:
            _launch_error(err, self, (self.function, gx, gy, gz, bx, by, bz, shared_bytes))


class Launch:
    """One kernel launch bound to its grid, block, shared memory and parameter struct; `launch(stream)` is the
    whole host cost of issuing it (one driver call).

    programmatic: launch it with programmatic stream serialization (sm_90+, else a plain launch): it may start
    before the previous kernel on the stream ends, so the kernel must call wait_for_predecessor_grid()
    (common.cuh) before reading that kernel's output; the previous kernel lets it start early with
    allow_dependent_launch(). This hides the launch gap between two kernels (the split-KV merge after decode)."""

    __slots__ = ("kernel", "params", "_fn", "_args", "_argv", "_config")

    def __init__(self, kernel: "Kernel", grid, block, shared_bytes: int, params: ParamBuffer,
                 programmatic: bool = False):
        if shared_bytes > kernel._max_dynamic_smem:
            kernel._allow_smem(shared_bytes)   # now, not during a graph capture
        gx, gy, gz = grid if isinstance(grid, tuple) else (grid, 1, 1)
        bx, by, bz = block if isinstance(block, tuple) else (block, 1, 1)
        self.kernel, self.params = kernel, params
        self._fn = kernel._launch
        self._args = (kernel.function, gx, gy, gz, bx, by, bz, shared_bytes)
        self._argv = params.argv_addr
        self._config = _programmatic_config(self._args) if programmatic and kernel.sm >= 90 else None
        if self._config is not None:
            self._fn = _driver.driver().cuLaunchKernelEx

    def launch(self, stream_handle):
        if self._config is not None:
            self._config.hStream = stream_handle
            err, = self._fn(self._config, self._args[0], self._argv, 0)
        else:
            err, = self._fn(*self._args, stream_handle, self._argv, 0)
        if err:
            _launch_error(err, self.kernel, self._args)


def _programmatic_config(args):
    """A CUlaunchConfig for (function, grid, block, shared bytes) with programmatic stream serialization."""
    drv = _driver.driver()
    cfg = drv.CUlaunchConfig()
    (_, cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ,
     cfg.sharedMemBytes) = args
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


def _launch_error(err, kernel, args):
    detail = f"{kernel.spec.uri()} grid={args[1:4]} block={args[4:7]} smem={args[7]}"
    if "CAPTURE" in getattr(err, "name", ""):
        detail += ("; a graph capture is in progress: run() must be given the capturing stream (stream=...), "
                   "and the legacy default stream cannot be used during a capture")
    raise CudaError("cuLaunchKernel", err, detail)


_loaded: dict = {}
_lock = threading.Lock()


def get_kernel(spec: KernelSpec) -> Kernel:
    """The loaded Kernel for spec on the current context's device (compiled or fetched from the cache on first
    use, loaded once per process and device). Inside an op's plan() / run() (opcore.on_device) that device is the
    op's, known without asking the driver."""
    ordinal = getattr(_device.active, "ordinal", None)
    if ordinal is None:
        ordinal = _driver.current_device().ordinal
    k = _loaded.get((spec, ordinal))
    if k is not None:
        return k
    dev = _driver.current_device()
    key = (spec, dev.ordinal)
    with _lock:
        k = _loaded.get(key)
        if k is None:
            compiled, _ = spec.compile(dev.arch)
            k = _loaded[key] = Kernel(spec, compiled)
    return k


def memo_spec(build):
    """Memoise a KernelSpec builder on its arguments (plan() asks for the same few specs on every call); calls
    with an unhashable argument (a list in a tuning dict) build the spec afresh."""
    memo: dict = {}

    @functools.wraps(build)
    def cached(*args, **kwargs):
        try:
            key = (args, tuple(kwargs.items()))
            spec = memo.get(key)
        except TypeError:
            return build(*args, **kwargs)
        if spec is None:
            if len(memo) > 1024:
                memo.clear()
            spec = memo[key] = build(*args, **kwargs)
        return spec
    return cached


def size_assert(struct: str, dtype: np.dtype) -> str:
    """A C++ static_assert that `struct` has the numpy dtype's size (NVRTC has no offsetof: offsets are
    checked on the GPU by layout_probe)."""
    return f"static_assert(sizeof({struct}) == {dtype.itemsize}, \"{struct}: size differs from Python\");\n"


def layout_probe(struct: str, dtype: np.dtype) -> str:
    """Source of `kvattn_layout_probe(long long* out)`, which writes sizeof(struct) and each field's offset
    (in the numpy dtype's field order) so a GPU test can compare them with the dtype."""
    body = [f"  out[0] = sizeof({struct});", f"  const {struct}* s = reinterpret_cast<const {struct}*>(out + 64);"]
    for i, name in enumerate(dtype.names, 1):
        body.append(f"  out[{i}] = reinterpret_cast<const char*>(&s->{name}) - reinterpret_cast<const char*>(s);")
    return 'extern "C" __global__ void kvattn_layout_probe(long long* out) {\n' + "\n".join(body) + "\n}\n"
