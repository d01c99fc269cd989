"""Rewrites a kernel file of csrc/cuda (a .cu) for the host emulator (see cuda_runtime.h here).

The only CUDA syntax plain C++ lacks is the launch. `kernel<T...><<<grid, block, smem,
stream>>>(a, b);` becomes `emu_launch(grid, block, smem, stream, [a0 = (a), a1 = (b)] {
kernel<T...>(a0, a1); });`: the arguments are evaluated at launch, as CUDA does, and the body
runs later on the stream. Everything else compiles as written: the emulated kernels are the
shipped source."""
import re
import sys

LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)


def split_args(args: str) -> list:
    """Top-level comma split (commas inside (), [] or <> stay)."""
    parts, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def launch(m: re.Match) -> str:
    args = split_args(m.group(3))
    captures = ", ".join(f"a{i} = ({a})" for i, a in enumerate(args))
    names = ", ".join(f"a{i}" for i in range(len(args)))
    return f"emu_launch({m.group(2)}, [{captures}] {{ {m.group(1)}({names}); }});"


def rewrite(text: str) -> str:
    """The text with its launches rewritten. A file may launch nothing (kernels.cu, the table); a
    launch syntax the pattern missed is an error, not a C++ compiler's puzzle."""
    out = LAUNCH.sub(launch, text)
    if "<<<" in out:
        sys.exit("host_kernels.py: a kernel launch the pattern does not match is left in the input; it is stale")
    return out


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    with open(dst, "w") as f:
        f.write(f'#line 1 "{src}"\n' + rewrite(text))
