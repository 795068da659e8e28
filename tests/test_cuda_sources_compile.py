"""Every CUDA source the project compiles at run time, compiled here by NVRTC for the GPUs it
targets (sm_80: A100; sm_90: H100, H200) on a machine without one, so that a compile error fails
CI instead of a GPU run. The sources come from the modules that own them (`all_sources()`), and a
scan of the source tree holds that no other module builds a kernel from CUDA source.

NVRTC is PyPI's (the `test` extra: nvidia-cuda-nvrtc-cu12 through cuda-bindings' `nvrtc`, which
needs no driver and no GPU), the CUDA 12 that the `gpu` extra's cupy-cuda12x runs. The options are
those CuPy 14 gives NVRTC for a `cupy.RawKernel(source, name)` built with no options:
`--std=c++14` (CuPy's default standard; CuPy 13's was c++11, compiled too, for the sources that
include CUDA's headers, where the standard matters), `-ftz=true` (CuPy's compiler adds it), the
CUDA headers' folder (CuPy passes its CUDA's include folder; here the cudart wheel's, which holds
the cuda_bf16.h and cuda_fp16.h the LayerNorm kernels include) and `-arch=sm_XX`, a cubin for
that architecture as CuPy builds for the device it runs on (so ptxas runs too, not only the
front end). CuPy's own and CCCL's include folders are left out: no source here includes their
headers. Each compile also asks NVRTC for the kernel's name (a name expression), so a kernel
that CuPy would not find under the name it is asked for fails here too.

Not compiled: the fused chains (autograd/fusion.py), whose CUDA code cupy.fuse writes only when
it is called on device arrays (docs/gpu.md).
"""
import io
import os
import re
import tokenize

import pytest

from helpers import ROOT
from npmegatron.autograd import bf16_bits, llama_kernels, sixteen_bit_kernels, row_kernels
from npmegatron.tensor_parallel import _cross_entropy_gpu

#: the GPUs the project runs on: A100 (sm_80), H100 and H200 (sm_90)
ARCHS = ("80", "90")

#: the modules whose CUDA sources CuPy compiles at run time, each with its all_sources()
SOURCE_MODULES = (row_kernels, bf16_bits, sixteen_bit_kernels, llama_kernels, _cross_entropy_gpu)

#: the calls that compile CUDA at run time; outside SOURCE_MODULES only the exceptions below may use them
KERNEL_MAKERS = {"RawKernel", "RawModule", "ElementwiseKernel", "ReductionKernel", "compile_with_cache",
                 "compile_using_nvrtc", "fuse"}

#: (file, name): why the site is not compiled here
NOT_COMPILED_HERE = {("autograd/fusion.py", "fuse"): "cupy.fuse writes its kernel only when called on device arrays"}

#: the folders whose modules run in a training job or a script
SOURCE_FOLDERS = ("autograd", "comm", "npmegatron", "scripts")

SOURCES = [(name, source) for module in SOURCE_MODULES for name, source in module.all_sources()]

#: the quick run's cases: on sm_90, the bit kernels and the row kernels' float32 variants that the
#: float32, --bf16 and --fp16 runs take; the whole suite compiles every source for every ARCHS
QUICK = [f"{name}-sm_90" for name, _ in SOURCES
         if name.startswith("bf16_") or re.search(r"_float(_kept_(bf16|fp16)(_weight_\2)?)?$", name)]


@pytest.fixture(scope="module")
def nvrtc():
    """cuda-bindings' NVRTC with PyPI's libnvrtc and the cudart wheel's headers (the test extra)."""
    module = pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC from PyPI: pip install -e '.[test]'")
    runtime = pytest.importorskip("nvidia.cuda_runtime", reason="CUDA's headers: pip install -e '.[test]'")
    try:
        module.nvrtcVersion()
    except RuntimeError as error:       # cuda-bindings without libnvrtc (nvidia-cuda-nvrtc-cu12)
        pytest.skip(f"no libnvrtc: {error}")
    return module, os.path.join(list(runtime.__path__)[0], "include")


def compile_for(nvrtc, name, source, arch, standard="c++14"):
    """The cubin of kernel `name` in `source` for sm_`arch`, as CuPy's RawKernel would compile it;
    an AssertionError naming the kernel, with NVRTC's log, when it does not compile."""
    lib, include = nvrtc
    options = [f"--std={standard}", "-ftz=true", f"-I{include}", f"-arch=sm_{arch}"]
    err, program = lib.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    assert err == lib.nvrtcResult.NVRTC_SUCCESS, f"kernel {name}: nvrtcCreateProgram failed ({err.name})"
    try:
        lib.nvrtcAddNameExpression(program, name.encode())
        (err,) = lib.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        if err != lib.nvrtcResult.NVRTC_SUCCESS:
            _, size = lib.nvrtcGetProgramLogSize(program)
            log = b" " * size
            lib.nvrtcGetProgramLog(program, log)
            raise AssertionError(f"kernel {name} does not compile for sm_{arch} ({err.name}, options "
                                 f"{' '.join(options)}):\n{log.rstrip(b' ').decode(errors='replace')}")
        _, lowered = lib.nvrtcGetLoweredName(program, name.encode())
        assert lowered == name.encode(), (f"kernel {name}: CuPy looks it up by that name, but it is "
                                          f"{lowered!r} in the module: declare it extern \"C\" __global__")
        _, size = lib.nvrtcGetCUBINSize(program)
        cubin = b" " * size
        lib.nvrtcGetCUBIN(program, cubin)
        return cubin
    finally:
        lib.nvrtcDestroyProgram(program)


@pytest.mark.quick_variants(*QUICK)
@pytest.mark.parametrize("arch", ARCHS, ids=lambda arch: f"sm_{arch}")
@pytest.mark.parametrize("name,source", SOURCES, ids=[name for name, _ in SOURCES])
def test_each_runtime_cuda_source_compiles(nvrtc, name, source, arch):
    cubin = compile_for(nvrtc, name, source, arch)
    assert cubin.startswith(b"\x7fELF") and name.encode() in cubin


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=lambda arch: f"sm_{arch}")
@pytest.mark.parametrize("name,source", [(n, s) for n, s in SOURCES if "#include" in s],
                         ids=[n for n, s in SOURCES if "#include" in s])
def test_sources_with_cuda_headers_compile_as_c_plus_plus_11(nvrtc, name, source, arch):
    """CuPy 13 compiles with --std=c++11 (the gpu extra allows 13 and 14)."""
    compile_for(nvrtc, name, source, arch, standard="c++11")


def test_a_compile_error_fails_with_the_kernel_name_and_the_log(nvrtc):
    broken = 'extern "C" __global__ void broken_kernel_for_the_test(float* x) { x[0] = undefined_value; }'
    with pytest.raises(AssertionError, match="broken_kernel_for_the_test does not compile for sm_90") as caught:
        compile_for(nvrtc, "broken_kernel_for_the_test", broken, "90")
    assert 'identifier "undefined_value" is undefined' in str(caught.value)


def test_a_kernel_missing_under_its_name_fails_with_that_name(nvrtc):
    source = 'extern "C" __global__ void renamed_kernel(float* x) { x[0] = 1.0f; }'
    with pytest.raises(AssertionError, match="kernel asked_for_kernel does not compile"):
        compile_for(nvrtc, "asked_for_kernel", source, "80")


def test_a_kernel_without_extern_c_fails_with_its_name(nvrtc):
    source = '__global__ void mangled_kernel(float* x) { x[0] = 1.0f; }'
    with pytest.raises(AssertionError, match='kernel mangled_kernel: CuPy looks it up by that name'):
        compile_for(nvrtc, "mangled_kernel", source, "80")


def _tokens(path):
    with open(path, "rb") as f:
        return list(tokenize.tokenize(io.BytesIO(f.read()).readline))


def _source_files():
    for folder in SOURCE_FOLDERS:
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for file in sorted(files):
                if file.endswith(".py"):
                    path = os.path.join(directory, file)
                    yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def test_every_runtime_cuda_source_is_enumerated():
    """No module but SOURCE_MODULES names a kernel-making call (a call, an import or an alias alike)
    or holds CUDA source text (`__global__`), fused chains aside; and each SOURCE_MODULES
    kernel's name in its CUDA text is that of at least one enumerated source."""
    owners = {os.path.relpath(os.path.realpath(module.__file__), os.path.realpath(ROOT)).replace(os.sep, "/")
              for module in SOURCE_MODULES}
    strays, kernel_names = [], {}
    for relative, path in _source_files():
        for token in _tokens(path):
            if token.type == tokenize.NAME and token.string in KERNEL_MAKERS:
                if relative not in owners and (relative, token.string) not in NOT_COMPILED_HERE:
                    strays.append(f"{relative}:{token.start[0]} ({token.string})")
            elif token.type == tokenize.STRING and "__global__" in token.string:
                if relative not in owners:
                    strays.append(f"{relative}:{token.start[0]} (CUDA source)")
                for kernel in re.findall(r"__global__\s+void\s+(\w+)", token.string):
                    kernel_names.setdefault(relative, set()).add(kernel)
    assert not strays, ("CUDA compiled at run time that tests/test_cuda_sources_compile.py does not "
                        f"compile: {', '.join(strays)}; give its module an all_sources() and add the "
                        "module to SOURCE_MODULES")
    enumerated = [name for name, _ in SOURCES]
    for relative in owners:
        assert kernel_names.get(relative), f"{relative}: no __global__ kernel found in its source strings"
        for kernel in kernel_names[relative]:
            assert any(name.startswith(kernel) for name in enumerated), \
                f"{relative}: kernel {kernel} is not among its all_sources()"
    assert len(set(enumerated)) == len(enumerated), "two enumerated sources share a kernel name"
