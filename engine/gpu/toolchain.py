"""What the build asks of NVIDIA's tools and of the PTX Triton writes: registers and local memory
from `cuobjdump -res-usage`, the entry's parameter list, the forward-compatible PTX. The parsers
are pure functions of text, tested on their own; only `find_tool`, `resource_usage` and
`ptx_assembles` run a program. None of it imports triton (it asks for triton's tools by path).
"""

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CUDA_BIN_DIRS = (Path("/usr/local/cuda/bin"), Path("/usr/local/cuda-13.0/bin"))


@dataclass(frozen=True)
class Usage:
    """One function's resources in a cubin, as cuobjdump reports them."""

    registers: int
    stack: int  # bytes of stack frame a thread: register spills land here
    local: int  # bytes of local memory a thread (spills, or arrays indexed at run time)
    shared: int  # static shared memory bytes (Triton's shared memory is dynamic: see the metadata)


def find_tool(name: str) -> Path:
    """Triton's bundled copy first (`triton/backends/nvidia/bin`), then PATH, then the CUDA toolkit."""
    candidates = []
    env = os.environ.get(f"TRITON_{name.upper().replace('-', '_')}_PATH")
    if env:
        candidates.append(Path(env))
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    candidates += [folder / name for folder in CUDA_BIN_DIRS]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"{name} not found (looked in {', '.join(map(str, candidates))})")


_FUNCTION = re.compile(r"^\s*Function\s+([^\s:]+)\s*:\s*$")
_FIELD = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")


def parse_res_usage(text: str) -> dict[str, Usage]:
    """`cuobjdump -res-usage` output -> {function: Usage}."""
    usages, function = {}, None
    for line in text.splitlines():
        match = _FUNCTION.match(line)
        if match:
            function = match.group(1)
            continue
        fields = dict(_FIELD.findall(line))
        if function and "REG" in fields:
            usages[function] = Usage(
                registers=int(fields["REG"]),
                stack=int(fields.get("STACK", 0)),
                local=int(fields.get("LOCAL", 0)),
                shared=int(fields.get("SHARED", 0)),
            )
            function = None
    return usages


def budget_problems(kernel: str, arch: str, usage: Usage, max_registers: int) -> list[str]:
    """Why this cubin breaks the budget: over `max_registers` registers a thread, or any local
    memory (register spills go to the stack frame in local memory)."""
    problems = []
    if usage.registers > max_registers:
        problems.append(
            f"{kernel} {arch}: {usage.registers} registers a thread, over the budget of {max_registers}"
        )
    if usage.stack or usage.local:
        problems.append(
            f"{kernel} {arch}: spills ({usage.stack} bytes of stack, {usage.local} of local memory a thread)"
        )
    return problems


def resource_usage(cubin: Path, entry: str, cuobjdump: Path | None = None) -> Usage:
    tool = cuobjdump or find_tool("cuobjdump")
    done = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    usages = parse_res_usage(done.stdout)
    if entry not in usages:
        raise ValueError(f"cuobjdump lists no function {entry} in {cubin}: {sorted(usages)}")
    return usages[entry]


_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.[a-z]+?(\d+)\b[^,\n]*?(?:\[(\d+)\])?\s*,?\s*$")


def ptx_entry_params(ptx: str, entry: str) -> list[int]:
    """The byte size of each parameter of `.entry <entry>(...)`, in order."""
    match = re.search(rf"\.entry\s+{re.escape(entry)}\s*\((.*?)\)", ptx, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"no .entry {entry} in the PTX")
    sizes = []
    for line in match.group(1).splitlines():
        found = _PARAM.search(line.strip())
        if found:
            sizes.append(int(found.group(1)) // 8 * int(found.group(2) or 1))
    return sizes


def ptx_header(ptx: str) -> tuple[str, str]:
    """(.version, .target) of a PTX module: ("8.8", "sm_90a")."""
    version = re.search(r"^\.version\s+(\S+)", ptx, flags=re.MULTILINE)
    target = re.search(r"^\.target\s+(\w+)", ptx, flags=re.MULTILINE)
    if not (version and target):
        raise ValueError("PTX without a .version or .target line")
    return version.group(1), target.group(1)


def portable_ptx(ptx: str) -> str:
    """The PTX retargeted from sm_XXa to sm_XX, which the driver may compile for later GPUs too
    (arch-specific PTX runs only on its own compute capability)."""
    return re.sub(r"^(\.target\s+sm_\d+)[a-z]\b", r"\1", ptx, flags=re.MULTILINE)


def ptx_assembles(ptx: str, target: str, ptxas: Path) -> str | None:
    """None if `ptxas` assembles the PTX for `target`, else its error text."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run(
            [str(ptxas), f"--gpu-name={target}", str(source), "-o", str(Path(folder) / "kernel.cubin")],
            capture_output=True,
            text=True,
        )
    return None if done.returncode == 0 else (done.stderr or done.stdout).strip()
