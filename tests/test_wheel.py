"""The built wheel ships cuda_src inside the package, and an installed kvattn compiles from it."""
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_ships_cuda_sources_and_compiles_from_them(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), ROOT],
                   check=True, capture_output=True, timeout=600)
    (whl,) = wheels.glob("kvattn-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    shipped = {os.path.basename(n) for n in names if n.startswith("kvattn/cuda_src/")}
    assert {"common.cuh", "merge.cuh", "decode.cuh", "mma.cuh"} <= shipped
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(whl)],
                   check=True, capture_output=True, timeout=600)
    code = ("import kvattn, kvattn.compiler as c, kvattn.merge as m; "
            "print(c.source_dir()); print(m.merge_spec('float16', 'float16').compile('sm_90a')[1])")
    env = {**os.environ, "PYTHONPATH": str(site), "KVATTN_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), timeout=600).stdout.split()
    assert out[0] == str(site / "kvattn" / "cuda_src")
    assert out[1] == "compiled"
