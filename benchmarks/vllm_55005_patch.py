"""A scratch copy of an installed vLLM with the CPU `expand_kernel` shim of vllm-project/vllm issue
55005 mended, to confirm the cause of the sampled checker's rejection of vLLM's CPU speculative
sampling: the verdict must turn when only this changes.

    VENV/bin/python benchmarks/vllm_55005_patch.py --out SCRATCH
    PYTHONPATH=SCRATCH VENV/bin/vllm serve ...     # the mended copy shadows the installed package

The shim (vllm/utils/cpu_triton_utils.py, `_expand_kernel_impl`) hands the int64-only C++ kernel
`output.to(torch.int64)`, a new tensor when `output` is float32 or int32, so the caller's buffer
(per-token temperature, top-k, top-p of draft positions) is never written; its float inputs are
also truncated to integers. The mended shim below writes the caller's buffer in its own dtype:
each request's value (with replace_from mapped to replace_to) repeated over its tokens, which is
what the Triton kernel `expand_kernel` does on a GPU. The installed vLLM is not modified.
"""
import argparse
import shutil
from pathlib import Path

MENDED = '''
def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    # mended (vllm-project/vllm issue 55005): write the caller's buffer, in its dtype
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = input_val[: counts.numel()]
    values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    output[: int(ends[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a new folder: the mended copy of the vllm package goes inside")
    a = ap.parse_args()
    import vllm
    source = Path(vllm.__file__).parent
    dest = Path(a.out) / "vllm"
    if dest.exists():
        raise SystemExit(f"{dest} exists")
    shutil.copytree(source, dest, symlinks=True)
    shim = dest / "utils" / "cpu_triton_utils.py"
    text = shim.read_text()
    start = text.index("def _expand_kernel_impl(")
    end = text.index("\ndef ", start + 1)
    shim.write_text(text[:start] + MENDED.strip() + "\n\n" + text[end:])
    print(f"mended copy of {source} in {dest} (PYTHONPATH={a.out})")


if __name__ == "__main__":
    main()
