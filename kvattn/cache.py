"""In-process memo + on-disk cubin cache.

Key: sha256 of kvattn's own CUDA sources (every file of cuda_src, by name and bytes), the generated
translation unit, options, name expressions, NVRTC version, header versions read from the headers
themselves (CUDART_VERSION, CCCL_VERSION), arch and SCHEMA. No absolute path enters the key, so a cache
filled on one machine hits on another. Entries are written atomically (temp file + rename) with a
checksum; a corrupt or truncated entry is a miss and is rebuilt.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import threading

from . import compiler

SCHEMA = 1
_MAGIC = b"KVATTN-CUBIN\n"
_memo: dict = {}
_memo_lock = threading.Lock()


def cache_dir() -> str:
    return os.environ.get("KVATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvattn")


@functools.lru_cache(maxsize=None)
def sources_digest() -> str:
    h = hashlib.sha256()
    root = compiler.source_dir()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isfile(path) and name.endswith((".cuh", ".cu", ".h")):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def header_versions() -> str:
    """CUDART_VERSION and CCCL_VERSION as the headers define them (content, not paths)."""
    found = {}
    for d in compiler.include_dirs():
        for rel, macro in (("cuda_runtime_api.h", "CUDART_VERSION"), ("cuda/std/__cccl/version.h", "CCCL_VERSION")):
            p = os.path.join(d, rel)
            if macro not in found and os.path.exists(p):
                with open(p, errors="replace") as f:
                    m = re.search(rf"#define\s+{macro}\s+(\d+)", f.read())
                if m:
                    found[macro] = m.group(1)
    return ",".join(f"{k}={v}" for k, v in sorted(found.items()))


def key(source: str, options, name_expressions, arch: str) -> str:
    payload = json.dumps({
        "schema": SCHEMA, "sources": sources_digest(), "tu": source, "options": list(options),
        "names": list(name_expressions), "nvrtc": list(compiler.nvrtc_version()),
        "headers": header_versions(), "arch": arch,
    }, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _encode(c: compiler.Compiled) -> bytes:
    meta = json.dumps({
        "lowered": c.lowered, "log": c.log, "seconds": c.seconds,
        "resources": {k: list(vars(r).values()) for k, r in c.resources.items()},
    }).encode()
    body = len(meta).to_bytes(8, "little") + meta + c.cubin
    return _MAGIC + hashlib.sha256(body).digest() + body


def _decode(blob: bytes):
    if not blob.startswith(_MAGIC):
        return None
    blob = blob[len(_MAGIC):]
    digest, body = blob[:32], blob[32:]
    if len(digest) != 32 or hashlib.sha256(body).digest() != digest:
        return None
    n = int.from_bytes(body[:8], "little")
    meta = json.loads(body[8:8 + n])
    res = {k: compiler.Resources(*v) for k, v in meta["resources"].items()}
    parsed = compiler.parse_ptxas_report(meta["log"])   # the current parser's reading (it learns new reports)
    if parsed.keys() >= res.keys():
        res = parsed
    return compiler.Compiled(body[8 + n:], meta["lowered"], res, meta["log"], meta["seconds"])


def load(k: str):
    path = os.path.join(cache_dir(), k[:2], k + ".cubin")
    try:
        with open(path, "rb") as f:
            return _decode(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(k: str, c: compiler.Compiled):
    """Atomic write: a reader sees the old entry, no entry, or the whole new one."""
    d = os.path.join(cache_dir(), k[:2])
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(c))
        os.replace(tmp, os.path.join(d, k + ".cubin"))
    except OSError:
        pass  # a read-only or full cache folder only costs recompiles


def get_or_compile(source: str, name: str, options, name_expressions, arch: str, files=None):
    """(Compiled, where) with where in {'memo', 'disk', 'compiled'}. files: {name: text} of #line-named parts of
    source, for compile errors (see compiler.compile_cubin)."""
    k = key(source, options, name_expressions, arch)
    with _memo_lock:
        if k in _memo:
            return _memo[k], "memo"
    c = load(k)
    where = "disk"
    if c is None:
        c = compiler.compile_cubin(source, name, options, name_expressions, arch, files)
        store(k, c)
        where = "compiled"
        _log_compile(name, c.seconds)
    with _memo_lock:
        _memo.setdefault(k, c)
    return _memo[k], where


def _log_compile(name: str, seconds: float) -> None:
    """KVATTN_COMPILE_LOG=path: each cache miss appends "<seconds> <name>" there (the GPU scripts set it, so a slow
    run on a bare machine says which kernels its packed cache lacked; pytest would swallow stderr)."""
    path = os.environ.get("KVATTN_COMPILE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{seconds:.1f} {name}\n")


def clear_memo():
    with _memo_lock:
        _memo.clear()
