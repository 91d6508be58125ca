"""CPU facts (``k3client.cpu``) from both kinds of x86 host, and the vLLM plugin's kernel choice
(``k3client.runtime.dispatch``) for each: an AMD EPYC with AVX-512 and no AMX, an Intel Xeon
with AMX.  The flag lines are real ``/proc/cpuinfo`` ones, shortened."""

import pytest

from k3client import cpu

torch = pytest.importorskip("torch")
dispatch = pytest.importorskip("k3client.runtime.dispatch")

EPYC = ("flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
        "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl pni pclmulqdq ssse3 "
        "fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy avx2 "
        "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt "
        "xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr wbnoinvd arat avx512vbmi umip pku ospke vaes "
        "vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm")
XEON = ("flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
        "sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni pclmulqdq "
        "ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm "
        "avx2 avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl "
        "xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke waitpkg "
        "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq rdpid cldemote "
        "movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 "
        "flush_l1d arch_capabilities")
OLD = "flags\t\t: fpu vme de pse tsc msr pae sse sse2 ht avx avx2 fma f16c"      # AVX2 only


def test_flags_give_each_kind_of_cpu():
    epyc, xeon, old = cpu.from_flags(EPYC), cpu.from_flags(XEON), cpu.from_flags(OLD)
    assert (epyc.avx512, epyc.avx512_bf16, epyc.amx_tile, epyc.amx, epyc.amx_int8) == (True, True, False, False, False)
    assert (xeon.avx512, xeon.avx512_bf16, xeon.amx_tile, xeon.amx, xeon.amx_int8) == (True, True, True, True, True)
    assert not old.avx512 and not old.amx
    assert epyc.describe() == "AVX-512 (bf16), no AMX"
    assert xeon.describe() == "AVX-512 (bf16), AMX (bf16, int8)"
    assert old.describe() == "no AVX-512, no AMX"


def test_a_whole_cpuinfo_a_bare_line_and_a_set_agree():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n" + XEON + "\n"
    bare = XEON.split(":", 1)[1]
    assert cpu.from_flags(text) == cpu.from_flags(bare) == cpu.from_flags(set(bare.split())) == cpu.from_flags(XEON)
    # the tile-multiply kinds count only with the tiles themselves
    assert not cpu.from_flags("amx_bf16 amx_int8 avx512f").amx
    # an Arm cpuinfo has "Features", no x86 flags
    assert cpu.from_flags("processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve\n") == cpu.CpuFacts()


def test_facts_here_are_torchs_answers():
    f = cpu.facts()
    assert f.source == "torch"
    assert f.amx_tile == torch.cpu._is_amx_tile_supported()
    assert f.avx512 == torch.cpu._is_avx512_supported()
    assert f.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert cpu.facts() is f                       # read once per process


@pytest.mark.parametrize("rowmm", [True, False])
def test_float32_engines_choose_alike_on_both_cpus(rowmm):
    """AMX has no float32 multiply: rowmm (exact on bf16 views) or torch as the caller left it, either CPU."""
    for flags in (EPYC, XEON):
        k = dispatch.kernels(cpu.from_flags(flags), "cpu", torch.float32, rowmm, True)
        assert k == dispatch.Kernels(rowmm_rows=dispatch.NATIVE_MAX_ROWS if rowmm else 0, onednn_rows=None)
    assert dispatch.kernels(cpu.from_flags(EPYC), "cpu", torch.float32, True, False) == dispatch.Kernels()


def test_bf16_uses_amx_through_onednn_only_where_the_cpu_has_it():
    epyc, xeon = cpu.from_flags(EPYC), cpu.from_flags(XEON)
    on_epyc = dispatch.kernels(epyc, "cpu", torch.bfloat16, True, True)
    assert on_epyc == dispatch.Kernels(rowmm_rows=dispatch.NATIVE_MAX_ROWS, onednn_rows=dispatch.NATIVE_ROWS)
    assert on_epyc.describe() == "rowmm up to 16 rows, then torch with oneDNN off up to 2 rows, on above"
    # no rowmm (no compiler, "native": false, or views it cannot read): ATen for few rows, oneDNN above
    assert dispatch.kernels(epyc, "cpu", torch.bfloat16, False, True) == dispatch.Kernels(0, dispatch.NATIVE_ROWS)
    assert dispatch.kernels(epyc, "cpu", torch.bfloat16, True, False) == dispatch.Kernels(0, dispatch.NATIVE_ROWS)
    for rowmm, rowmajor in ((True, True), (False, True), (True, False)):
        on_xeon = dispatch.kernels(xeon, "cpu", torch.bfloat16, rowmm, rowmajor)
        assert on_xeon == dispatch.Kernels(rowmm_rows=0, onednn_rows=0)       # every run: oneDNN, on the tiles
    assert on_xeon.describe() == "torch with oneDNN"


def test_fp16_and_gpu_engines():
    for flags in (EPYC, XEON):
        f = cpu.from_flags(flags)
        # rowmm reads bf16: an fp16 engine (fp16 casts of the weights in plain vLLM) keeps torch
        assert dispatch.kernels(f, "cpu", torch.float16, True, True) == dispatch.Kernels(0, dispatch.NATIVE_ROWS)
        for dtype in (torch.bfloat16, torch.float32):
            assert dispatch.kernels(f, "cuda", dtype, True, True) == dispatch.Kernels()
