"""Whether int8 mode can keep its promise on this CPU, and with which weights
(KP_EMBEDDER_PRECISION; docs/decisions/int8-mode.md). onnxruntime's MLAS kernels, chosen by
the CPU (onnxruntime/core/mlas/lib/platform.cpp), sum u8 x s8 products in 32 bits with VNNI
or AMX: exact. Without them, on AVX2 or AVX-512, `vpmaddubsw` adds pairs of products in
saturating 16 bits (255 x 127 x 2 is cut to 32,767: scores moved by up to 0.021), while the
u8 x u8 kernel sums in 32 bits: the weights are then shifted into uint8 (w + 128, zero point
128: the same products), as `session.x64quantprecision` does, but only at the EXTENDED level,
not this service's BASIC. Any other CPU is unchecked: int8 mode declines and serves float32.
The flags are Linux's (/proc/cpuinfo), set from the same CPUID bits MLAS reads.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from app.core.states import Precision

#: The type the int8 MatMuls' weights are given: int8 as shipped, or shifted into uint8.
Int8Weights = Literal["int8", "uint8"]

#: Any one of these and onnxruntime's u8 x s8 products are summed in 32 bits.
EXACT_U8S8_FLAGS: Final = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
#: What the u8 x u8 kernel needs (its AVX2 and AVX-512 versions both widen to 16 bits).
EXACT_U8U8_FLAG: Final = "avx2"
#: The flags that decide, as bench/ reports them.
RELEVANT_FLAGS: Final = EXACT_U8S8_FLAGS | {EXACT_U8U8_FLAG, "avx512f", "fma"}
_X86_64: Final = frozenset({"x86_64", "amd64"})


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    machine: str  # platform.machine(), lower case
    flags: frozenset[str]

    @classmethod
    def of_this_machine(cls) -> CpuFeatures:
        """The first processor's x86 flags; none when unreadable (then int8 mode declines)."""
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        flags = (line.partition(":")[2] for line in text.splitlines() if line.startswith("flags"))
        return cls(platform.machine().lower(), frozenset(next(flags, "").split()))


@dataclass(frozen=True, slots=True)
class Int8Support:
    """int8 mode on one CPU: the weights that make its products exact, or None to decline."""

    weights: Int8Weights | None
    reason: str

    @property
    def precision(self) -> Precision:
        """What the embedder runs: int8, or float32 when int8 mode declines."""
        return "float32" if self.weights is None else "int8"


def int8_support(cpu: CpuFeatures | None = None) -> Int8Support:
    """The one place int8 mode is allowed or declined; `cpu` defaults to this machine's."""
    cpu = cpu or CpuFeatures.of_this_machine()
    if cpu.machine not in _X86_64:
        return _declined(f"this CPU is {cpu.machine or 'unknown'}, not x86-64")
    exact = sorted(cpu.flags & EXACT_U8S8_FLAGS)
    if exact:
        return Int8Support("int8", f"u8 x s8 products are exact on this CPU ({', '.join(exact)})")
    if EXACT_U8U8_FLAG in cpu.flags:
        return Int8Support(
            "uint8",
            "this CPU has no VNNI, so u8 x s8 products would saturate in 16 bits: the weights "
            "are shifted into uint8 and u8 x u8 products are exact",
        )
    return _declined("this x86-64 CPU has neither VNNI nor AVX2")


def _declined(why: str) -> Int8Support:
    return Int8Support(
        None,
        f"KP_EMBEDDER_PRECISION=int8 declined: {why}, and int8 products are checked exact only "
        "on x86-64 with VNNI or AVX2; serving float32 (the reference's vectors)",
    )
