"""Compiling the dry run's simulated-GPU shim (titan/estimate/simulated_cuda.cpp) for the installed torch: once per
torch version, compiler and source, into Titan's cache folder, in about a second. The compiler is the one
torch.compile uses on a CPU: $CXX, else c++."""

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from titan.config.errors import ConfigError
from titan.data.cache import default_cache_dir

SOURCE = Path(__file__).with_name("simulated_cuda.cpp")


def compile_command(compiler: str, output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    return [compiler, "-shared", "-fPIC", "-std=c++17", "-O1", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", f"-I{torch_dir / 'include'}",
            str(SOURCE), "-o", str(output), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{torch_dir / 'lib'}"]


def build_cuda_shim() -> Path:
    """The compiled shim's path, compiling it first when the cache has none for this torch and compiler."""
    compiler = os.environ.get("CXX", "c++")
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {compiler}".encode()).hexdigest()[:16]
    target = default_cache_dir() / "simulated_cuda" / f"simulated_cuda-{key}.so"
    if target.is_file():
        return target
    if shutil.which(compiler) is None:
        raise ConfigError(f"The dry run simulates its GPU on fake CUDA tensors, which needs a C++ compiler to build "
                          f"{SOURCE.name} for this torch, and {compiler!r} was not found. Install one (gcc or clang, "
                          f"as torch.compile needs on a CPU) or name it in $CXX.")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        built = Path(folder) / target.name
        result = subprocess.run(compile_command(compiler, built), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ConfigError(f"Compiling the dry run's simulated GPU ({SOURCE}) with {compiler!r} failed:\n"
                              f"{result.stderr[-3000:]}\nSet $CXX to a C++17 compiler torch's headers build with.")
        os.replace(built, target)  # whole, even when another process builds the same file at once
    return target
