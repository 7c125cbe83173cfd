"""Both x86 builds of the fused CPU kernels, checked on whichever kind of machine CI has.

`-march=native` compiles the kernels' 64-byte vectors to AVX-512 on an AVX-512 machine (Intel
Sapphire Rapids) and to pairs of AVX2 registers elsewhere (AMD Zen 3), and MKL and ATen pick
their code by CPU too. So one CI machine would prove only its own path: here the AVX2 build
runs the kernel and greedy checks under `TANDEM_CPU_ISA=avx2` on any machine, and the AVX-512
build is compiled (not run) on any machine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tandem.ops import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
AVX2_ENV = {
    "TANDEM_CPU_ISA": "avx2",  # the fused kernels: -march=x86-64-v3 (AVX2, FMA), no AVX-512
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's GEMMs
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's own kernels (transformers' side)
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
# What runs again under the AVX2 build: every check of a fused kernel against its reference
# (the quantized linear layers' and the int8 KV cache's too), the model's logits and greedy
# tokens against transformers'.
AVX2_CHECKS = [
    f"tests/test_kernels.py::{name}"
    for name in (
        "test_elementwise_kernels_match_portable_ops",
        "test_sampling_noise_kernel_is_the_portable_hash_bit_for_bit",
        "test_argmax_kernel_is_torch_argmax",
        "test_sampler_kernel_draws_the_reference_samplers_tokens",
        "test_paged_decode_attention_reads_the_cache_in_place",
        "test_paged_decode_attention_on_long_contexts",
        "test_store_kv_writes_each_tokens_row_into_its_slot",
        "test_short_chunks_after_a_cached_context_attend_as_decodes",
        "test_a_short_chunk_after_a_cached_prefix_gives_its_decodes_logits",
        "test_a_verifications_rows_are_each_the_decode_of_its_position",
        "test_fast_path_logits_stay_close_to_transformers",
        "test_fast_path_greedy_tokens_match_transformers",
        "test_gemm_equals_a_float64_linear",
        "test_gemm_rows_do_not_depend_on_their_step",
    )
] + [
    "tests/test_quantized.py::test_the_kernel_is_the_dequantized_product",
    "tests/test_quantized.py::test_rows_looked_up_in_the_blocks_are_the_dequantized_rows",
    "tests/test_quantized.py::test_float_activations_keep_float_precision_at_every_magnitude",
    "tests/test_quantized.py::test_int8_activations_kernel_is_the_integer_reference",
    "tests/test_quantized.py::test_gguf_blocks_in_a_wider_layout_are_gguf_s_own_weights",
    "tests/test_quantized.py::test_layers_fused_from_parts_in_several_formats_are_the_dequantized_model",
    "tests/test_quantized.py::test_codes_meet_float_activations_on_amx_tiles_where_the_cpu_has_them",
]
AVX2_CHECKS += [  # Gemma 3's one-call forward: its norms, GeGLU, each layer's window and rope
    "tests/test_gemma3.py::test_logits_equal_transformers_eager_and_fast_path",
]
AVX2_CHECKS += [
    f"tests/test_kv_int8.py::{name}"
    for name in (
        "test_store_kv_writes_kv_quants_codes_and_scales_bit_for_bit",
        "test_the_fused_forward_reads_int8_caches_as_the_portable_attention",
    )
]
AVX2_CHECKS += [
    f"tests/test_lora_kernel.py::{name}"
    for name in (
        "test_lora_add_is_the_reference",
        "test_a_rows_delta_does_not_depend_on_its_step",
        "test_the_forwards_lora_is_the_merged_adapters_forward",
    )
]
# Runs pytest after saying which code PyTorch dispatches to, so the settings are seen to hold.
RUN_PYTEST = (
    "import sys, pytest, torch; print('ATen:', torch.backends.cpu.get_cpu_capability()); "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


AVX2_TEST = "test_the_avx2_build_passes_the_kernel_and_greedy_checks"


@pytest.fixture(scope="module", autouse=True)
def avx2_checks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """AVX2_CHECKS run under AVX2_ENV in a pytest of their own, started as the module starts so
    that they run beside its other tests (the AVX2 test, last, waits for them): the process and
    the files its stdout and stderr go to; None where that test is not selected."""
    if not any(item.name == AVX2_TEST for item in request.session.items):
        yield None
        return
    folder = tmp_path_factory.mktemp("avx2")
    env = {**os.environ, **AVX2_ENV}
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable, "-c", RUN_PYTEST, "-q", "-p", "no:cacheprovider",
                f"--basetemp={folder / 'tmp'}", *AVX2_CHECKS,
            ],
            cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True,
        )  # fmt: skip
    try:
        yield process, folder / "stdout", folder / "stderr"
    finally:
        if process.poll() is None:  # the test failed or timed out before it was done
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    "setting,cpu,flag",
    [
        (None, "avx2 fma avx512f", "-march=native"),
        ("native", "avx2 fma", "-march=native"),
        ("avx2", "avx2 fma avx512f", "-march=x86-64-v3"),
        ("avx2", "avx2 fma", "-march=native"),  # native already is the AVX2 build: one build
    ],
)
def test_the_isa_setting_picks_the_flags_and_the_build(monkeypatch, setting, cpu, flag) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: f"flags\t\t: fpu sse2 {cpu}")
    monkeypatch.delenv("TANDEM_CPU_ISA", raising=False)
    native = cpu_kernels.build_name()
    if setting is not None:
        monkeypatch.setenv("TANDEM_CPU_ISA", setting)
    assert cpu_kernels.cflags() == ["-O3", flag, "-fopenmp"]
    assert (cpu_kernels.build_name() == native) == (flag == "-march=native")


def test_a_wrong_isa_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="expected one of native, avx2"):
        cpu_kernels.cflags()
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx2")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags\t\t: fpu sse2 avx")
    with pytest.raises(ValueError, match="no AVX2"):
        cpu_kernels.cflags()


# A float32 GEMM of seeded operands through the build the environment picks, saved to argv[1].
SEEDED_GEMM = (
    "import sys, torch; from tandem.ops import cpu_kernels; from tandem.ops.linear import linear, "
    "pack_panels; assert cpu_kernels.load().available; g = torch.Generator().manual_seed(0); "
    "x, w, b = (torch.randn(*s, generator=g) for s in ((70, 576), (1000, 576), (1000,))); "
    "torch.save(linear(x, w, b, pack_panels(w)), sys.argv[1])"
)


def test_the_avx2_and_native_builds_multiply_to_the_same_bits(tmp_path) -> None:
    """The float32 GEMM sums every output in input order in one lane, whatever the vector
    width: on an AVX-512 machine the AVX2 build gives the native build's bits (on an AVX2
    machine the two are one build)."""
    runs = {}
    for isa in ("avx2", "native"):  # side by side
        env = {**os.environ, "TANDEM_CPU_ISA": isa}
        runs[isa] = subprocess.Popen([sys.executable, "-c", SEEDED_GEMM, str(tmp_path / f"{isa}.pt")],
                                     cwd=ROOT, env=env)  # fmt: skip
    outputs = {}
    for isa, run in runs.items():
        assert run.wait(timeout=600) == 0, isa
        outputs[isa] = torch.load(tmp_path / f"{isa}.pt")
    assert torch.equal(outputs["avx2"], outputs["native"])


def compile_to_assembly(source: Path, march: str) -> str:
    """`source` compiled with the build's flags for `march`, as assembly text: compiled once,
    then kept under the Tandem cache folder by a hash of everything the compile reads (every
    source and header, the command line, the compiler's version and torch's)."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    compiler = os.environ.get("CXX", "c++")
    command = [
        compiler, "-std=c++20", "-fPIC", "-O3", f"-march={march}", "-fopenmp", "-Wno-psabi",
        "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, "-S", str(source),
    ]  # fmt: skip
    key = hashlib.sha256()
    for file in cpu_kernels.FILES:
        key.update(file.name.encode() + b"\0" + file.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
    # The source by name: its bytes are hashed above, and a checkout elsewhere reads the same.
    parts = [source.name if part == str(source) else part for part in command]
    for part in (*parts, version.stdout, torch.__version__):
        key.update(part.encode() + b"\0")
    assembly = (
        cpu_kernels.cache_root() / "assembly" / f"{source.stem}-{march}-{key.hexdigest()[:16]}.s"
    )
    if assembly.is_file():
        return assembly.read_text()
    assembly.parent.mkdir(parents=True, exist_ok=True)
    staging = assembly.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    result = subprocess.run(
        [*command, "-o", str(staging)], capture_output=True, text=True, timeout=600
    )  # fmt: skip
    assert result.returncode == 0, source.name + ": " + result.stderr[-4000:]
    os.replace(staging, assembly)
    return assembly.read_text()


# What the compile-only tests read: every source for Sapphire Rapids, the quantized layers for
# Skylake-SP.
ASSEMBLIES = [(source, "sapphirerapids") for source in cpu_kernels.SOURCES] + [
    (cpu_kernels.CSRC / "quantized_linear.cpp", "skylake-avx512")
]


@pytest.fixture(scope="module")
def assemblies() -> dict[tuple[str, str], Future]:
    """ASSEMBLIES compiled side by side (each takes some tens of seconds: one after another they
    would leave a core idle), or read from the cache, by (source name, march)."""
    with ThreadPoolExecutor(max_workers=len(ASSEMBLIES)) as pool:
        yield {
            (source.name, march): pool.submit(compile_to_assembly, source, march)
            for source, march in ASSEMBLIES
        }


def test_the_avx512_build_compiles(assemblies) -> None:
    """Compile only (to assembly, with the build's flags but for Sapphire Rapids): it cannot run
    on a machine without AVX-512, but it proves there that the AVX-512 build compiles, that the
    kernels' vectors become 512-bit code, and that int8 activations' products use VNNI. On an
    AVX-512 machine the native build proves more; with AMX, that its tiles run (test_quantized.py)."""
    for source in cpu_kernels.SOURCES:
        code = assemblies[source.name, "sapphirerapids"].result()
        assert "zmm" in code, source.name
        if source.stem == "quantized_linear":  # and digit products on AMX tiles (4-, 8-bit)
            assert "vpdpbusd" in code
            tile_ops = ("ldtilecfg", "tileloadd", "tdpbsud", "tdpbssd", "tilestored")
            assert all(op in code for op in tile_ops)


def test_the_avx512_build_without_vnni_compiles(assemblies) -> None:
    """AVX-512 without VNNI (Skylake-SP, Cascade Lake's predecessors): int8 activations' products
    take maddubs on 512-bit vectors."""
    code = assemblies["quantized_linear.cpp", "skylake-avx512"].result()
    assert "zmm" in code and "vpmaddubsw" in code and "vpdpbusd" not in code
    assert "tdpbsud" not in code and "tdpbssd" not in code


def test_the_avx2_build_passes_the_kernel_and_greedy_checks(monkeypatch, avx2_checks) -> None:
    """On an AVX-512 machine this builds and runs the AVX2 code, and MKL's and ATen's AVX2 code,
    against the references and transformers (its own build: some tens of seconds, cached after
    that); on an AVX2 machine it is the native build, already built, rerun with the settings.
    Either way the library that ran has no AVX-512 (zmm) instruction."""
    process, stdout, stderr = avx2_checks
    returncode = process.wait(timeout=600)
    out, err = stdout.read_text(), stderr.read_text()
    assert returncode == 0, out[-6000:] + err[-2000:]
    assert "ATen: AVX2" in out
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx2")
    name = cpu_kernels.build_name()
    library = cpu_kernels.cache_root() / "kernels" / name / f"{name}.so"
    code = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "ymm" in code and "zmm" not in code
