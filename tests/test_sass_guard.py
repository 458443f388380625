"""Machine-code guard over the built CUDA extension (runs where it was compiled, no GPU needed).

ptxas (CUDA 13.0) compiled a clamp `max(0, min(2, x))` followed by `== 2` / `== 1` branches into one `VIMNMX.RELU`
with a predicate output and branched on that predicate as if it meant "the result is 2"; warp groups whose x was
above 2 skipped their wgmmas (docs/decisions.md, the TMA activation copy). Main's kernels contain no integer
min / max with a predicate output; this keeps it so, so that a new kernel or toolchain that emits one is looked at
before it runs."""

import re

import pytest

from kbit_dev import sass

_EXT = sass.extension()


@pytest.mark.skipif(not _EXT, reason="the CUDA extension is not built here")
def test_no_integer_min_max_with_a_predicate_output():
    tool = sass.cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton) to read the extension's machine code")
    kernels = sass.functions(sass.disassemble(_EXT, tool))
    assert len(kernels) > 100, f"cuobjdump read {len(kernels)} kernels from {_EXT}"
    offending = [f"{name}: {instr[:120]}" for name, instrs in kernels.items() for instr in instrs
                 if re.match(r"I?VIMNMX\S*\s+R\w+,\s*!?P\d", instr)]
    assert not offending, "integer min / max with a predicate output:\n" + "\n".join(offending[:10])


# Two kernels as cuobjdump prints them (an anonymous-namespace one, with another build's file hash below).
_LISTING = """
	code for sm_90a
		Function : _ZN4kbit40_GLOBAL__N__1c896e04_8_wgmma_cu_31d9d88612wgmma_kernelI6__halfLi5EEEvv
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                          /* 0x00000a00ff017b82 */
                                                                                                   /* 0x000fe20000000800 */
        /*0010*/               @P0 EXIT ;                                                        /* 0x000000000000094d */
        /*0020*/                   F2FP.BF16.F32.PACK_AB R4, R5, R4 ;                              /* 0x0000000405047223 */
        /*0030*/              @!P1 SHFL.IDX PT, R6, R7, R8, 0x1f ;                               /* 0x00001f0807067589 */
		Function : _ZN4kbit10mma_detail10mma_kernelI13__nv_bfloat16Li5ELi1ELi4ELb1EEEvNS0_9MmaParamsIT_EE
        /*0000*/                   SHFL.IDX PT, R2, R3, R4, 0x1f ;                                 /* 0x00001f0403027589 */
        /*0010*/                   PRMT R2, R2, 0x7610, R5 ;                                       /* 0x0000761002027816 */
        /*0020*/                   VIMNMX.RELU R0, P2, P2, R0, 0x2 ;                               /* 0x0000000200007848 */
"""


def test_the_listing_parses_into_kernels_and_opcodes():
    kernels = sass.functions(_LISTING)
    assert len(kernels) == 2
    anon, mma = kernels
    assert kernels[anon] == ["LDC R1, c[0x0][0x28]", "EXIT", "F2FP.BF16.F32.PACK_AB R4, R5, R4",
                             "SHFL.IDX PT, R6, R7, R8, 0x1f"]
    assert sass.mix(kernels[anon]) == {"LDC": 1, "EXIT": 1, "F2FP": 1, "SHFL": 1}
    assert sass.mix(kernels[mma]) == {"SHFL": 1, "PRMT": 1, "VIMNMX": 1}
    assert [i for i in kernels[mma] if re.match(r"I?VIMNMX\S*\s+R\w+,\s*!?P\d", i)] == ["VIMNMX.RELU R0, P2, P2, R0, 0x2"]


def test_stable_names_pair_two_builds_and_keep_kernels_apart():
    a = "_ZN4kbit40_GLOBAL__N__1c896e04_8_wgmma_cu_31d9d88612wgmma_kernelI6__halfLi5EEEvv"
    b = "_ZN4kbit40_GLOBAL__N__e059d315_8_wgmma_cu_31d9d88612wgmma_kernelI6__halfLi5EEEvv"
    assert sass.stable_name(a) == sass.stable_name(b) == "_ZN4kbit(anon)12wgmma_kernelI6__halfLi5EEEvv"
    assert sass.stable_name(a) != sass.stable_name(a.replace("Li5E", "Li4E"))
    plain = "_ZN4kbit10mma_detail10mma_kernelI13__nv_bfloat16Li5ELi1ELi4ELb1EEEvNS0_9MmaParamsIT_EE"
    assert sass.stable_name(plain) == plain
