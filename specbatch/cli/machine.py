"""What a measurement ran on, recorded beside every result: CPU model and instruction set, cores,
threads, torch and transformers versions, and the GPU where one is used."""
from __future__ import annotations

import os
import platform
from pathlib import Path

# The instruction-set extensions the CPU kernels choose between (fast.compute.kernels pads on AVX-512).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_info() -> dict:
    """Model name and the ISA_FLAGS present, from /proc/cpuinfo (Linux; elsewhere the platform's name)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return dict(model=model, flags=[f for f in ISA_FLAGS if f in flags])


def describe_machine(device: str = "cpu") -> dict:
    """A JSON-ready description of this machine, with a one-line `summary` for tables."""
    import torch
    import transformers
    cpu = cpu_info()
    capability = torch.backends.cpu.get_cpu_capability()
    info = dict(cpu_model=cpu["model"], cpu_flags=cpu["flags"], torch_cpu_capability=capability,
                cores=os.cpu_count(), threads=torch.get_num_threads(), platform=platform.platform(),
                python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                device=str(device), gpu=None)
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    matrix = [f for f in cpu["flags"] if f in ("avx512_bf16", "amx_bf16", "amx_tile")]  # what bfloat16 runs on
    isa = f"{capability}; {', '.join(matrix)}" if matrix else capability
    where = info["gpu"] or f"{cpu['model']} ({isa}), {info['cores']} cores, {info['threads']} threads"
    info["summary"] = f"{where}, torch {torch.__version__}, transformers {transformers.__version__}"
    return info
