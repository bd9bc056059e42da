"""Ahead-of-time kernels: compile the registered Triton kernels to cubins, check their registers.

Where the cubins live and how they are rebuilt
----------------------------------------------
`engine/gpu/cubins/` holds, for each kernel in `engine/gpu/registry.py`, a cubin for each of
TARGETS (`<kernel>.sm_XX.cubin`), the PTX of PTX_TARGETS retargeted from sm_XXa to sm_XX so that a
newer GPU's driver can compile it (`<kernel>.sm_XX.ptx`), and `manifest.json` (described in
`engine/gpu/manifest.py`). They are committed, ship in the wheel (pyproject's package data) and
the bundle (packaging/moe-chat.spec), and run through the CUDA driver (`engine/gpu/launcher.py`):
the user's machine needs neither triton nor a compiler.

    python -m engine.gpu.build            # rebuild them all (triton, no GPU; about a minute)
    python -m engine.gpu.build --check    # the committed files match the sources (what CI runs)

Rebuild, with the Triton version the manifest names (TRITON_VERSION: 3.8 appends two scratch
pointers to every kernel's parameters, another version may not), whenever a registered kernel,
a function it calls, a constexpr global it reads or its registry entry changes. The check uses
Triton's own key of the function, which counts the line it starts on: moving a kernel inside its
file asks for a rebuild too (the bytes come out the same: the build leaves out line info, so they
depend on neither the checkout's path nor its lines). The build writes nothing when a cubin uses
more registers than its budget (128 a thread unless its entry says otherwise), any local memory
(spills), or scratch memory (the launcher passes the scratch pointers as null).
"""

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from engine.gpu import manifest as mf
from engine.gpu import toolchain
from engine.gpu.registry import REGISTRY, KernelSpec

TRITON_VERSION = "3.8.0"  # the version the committed cubins are built with
TARGETS = (80, 86, 89, 90, 120)  # A100; RTX 30xx; RTX 40xx, L4; H100, H200; RTX 50xx
PTX_TARGETS = (120,)  # PTX kept for GPUs newer than every cubin
DEFAULT_MAX_REGISTERS = 128
SCRATCH_PARAMS = ("global_scratch", "profile_scratch")  # what Triton 3.8 appends, in order
SCALAR_SIZES = {"i32": 4, "u32": 4, "i64": 8, "u64": 8, "fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}


class BuildError(RuntimeError):
    def __init__(self, message: str, kernels: dict | None = None) -> None:
        super().__init__(message)
        self.kernels = kernels or {}  # the manifest entries compiled before the failure


def resolve(spec: KernelSpec):
    module, _, name = spec.function.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if list(spec.signature) != list(fn.arg_names):
        raise BuildError(f"{spec.name}: signature {list(spec.signature)} != arguments {fn.arg_names}")
    missing = [a for a, t in spec.signature.items() if t == "constexpr" and a not in spec.constexprs]
    if missing:
        raise BuildError(f"{spec.name}: constexprs without a value: {missing}")
    return fn


def source_hash(spec: KernelSpec, fn=None) -> str:
    """Triton's own key of the function (its source, the jit functions it calls, the constexpr
    globals it reads, its first line) with the entry's compile settings."""
    fn = fn if fn is not None else resolve(spec)
    settings = {k: v for k, v in spec.__dict__.items() if k not in ("name", "max_registers")}
    text = json.dumps({"fn": fn.cache_key, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def launch_params(spec: KernelSpec) -> list[dict]:
    """The kernel's parameters in launch order, without the scratch pointers (constexprs are no
    parameters)."""
    params = []
    for arg, kind in spec.signature.items():
        if kind == "constexpr":
            continue
        if not kind.startswith("*") and kind not in SCALAR_SIZES:
            raise BuildError(f"{spec.name}: {arg} has type {kind}, which the launcher cannot pass")
        params.append({"name": arg, "type": kind, "aligned": arg in spec.aligned})
    return params


def compile_for(spec: KernelSpec, fn, capability: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index = list(spec.signature).index
    attrs = {(index(arg),): [["tt.divisibility", 16]] for arg in spec.aligned}
    source = ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs), attrs=attrs)
    options = {
        "num_warps": spec.num_warps,
        "num_stages": spec.num_stages,
        "enable_fp_fusion": not spec.exact_fp,
    }
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def with_scratch(spec: KernelSpec, params: list[dict], sizes: list[int], arch: str) -> list[dict]:
    """`params` and the scratch pointers Triton appended, checked against the PTX's own list."""
    extra = len(sizes) - len(params)
    if not 0 <= extra <= len(SCRATCH_PARAMS) or any(size != 8 for size in sizes[len(params) :]):
        raise BuildError(
            f"{spec.name} {arch}: PTX parameters {sizes} do not match {params} + scratch pointers"
        )
    for param, size in zip(params, sizes, strict=False):
        expected = 8 if param["type"].startswith("*") else SCALAR_SIZES[param["type"]]
        if size != expected:
            raise BuildError(
                f"{spec.name} {arch}: {param['name']} is {size} bytes in the PTX, not {expected}"
            )
    return params + [{"name": name, "type": mf.SCRATCH} for name in SCRATCH_PARAMS[:extra]]


def check_metadata(spec: KernelSpec, meta, arch: str) -> None:
    """The launcher passes the scratch pointers as null and launches one CTA a block, plainly."""
    unsupported = {
        "global scratch memory": meta.global_scratch_size,
        "profile scratch memory": meta.profile_scratch_size,
        "clusters": meta.num_ctas != 1,
        "a cooperative grid": meta.launch_cooperative_grid,
        "programmatic dependent launch": meta.launch_pdl,
    }
    needs = [what for what, value in unsupported.items() if value]
    if needs:
        raise BuildError(f"{spec.name} {arch}: needs {', '.join(needs)}, which the launcher does not provide")


def build_kernel(spec: KernelSpec, stage: Path, budget: int, targets=TARGETS) -> tuple[dict, list[str]]:
    """Compile one kernel for every target into `stage`: its manifest entry and budget problems."""
    fn = resolve(spec)
    entry = {
        "function": spec.function,
        "source_hash": source_hash(spec, fn),
        "num_warps": spec.num_warps,
        "num_stages": spec.num_stages,
        "exact_fp": spec.exact_fp,
        "constexprs": dict(spec.constexprs),
        "max_registers": spec.max_registers or budget,
        "cubins": {},
        "ptx": [],
    }
    problems = []
    for capability in targets:
        arch = f"sm_{capability}"
        compiled = compile_for(spec, fn, capability)
        meta, ptx = compiled.metadata, compiled.asm["ptx"]
        check_metadata(spec, meta, arch)
        params = with_scratch(spec, launch_params(spec), toolchain.ptx_entry_params(ptx, meta.name), arch)
        if entry.setdefault("params", params) != params or entry.setdefault("entry", meta.name) != meta.name:
            raise BuildError(f"{spec.name} {arch}: parameters or entry name differ between targets")
        cubin = stage / f"{spec.name}.{arch}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = toolchain.resource_usage(cubin, meta.name)
        problems += toolchain.budget_problems(spec.name, arch, usage, entry["max_registers"])
        entry["cubins"][arch] = {
            "file": cubin.name,
            "sha256": mf.file_sha256(cubin),
            "target": toolchain.ptx_header(ptx)[1],
            "ptxas": ptxas_version(capability),
            "shared": meta.shared,
            **{key: getattr(usage, key) for key in ("registers", "stack", "local")},
        }
        if capability in PTX_TARGETS:
            entry["ptx"] += keep_ptx(spec, ptx, capability, meta.shared, stage)
    return entry, problems


def ptxas_for(capability: int) -> Path:
    return toolchain.find_tool("ptxas-blackwell" if capability >= 100 else "ptxas")


def ptxas_version(capability: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(capability).version


def keep_ptx(spec: KernelSpec, ptx: str, capability: int, shared: int, stage: Path) -> list[dict]:
    """The target's PTX, retargeted to the portable sm_XX when ptxas still assembles it."""
    portable = toolchain.portable_ptx(ptx)
    version, target = toolchain.ptx_header(portable)
    error = toolchain.ptx_assembles(portable, target, ptxas_for(capability))
    if error:
        sys.stderr.write(
            f"warning: {spec.name}: no portable PTX for {target} (arch-specific code): {error}\n"
        )
        return []
    path = stage / f"{spec.name}.sm_{capability}.ptx"
    path.write_text(portable)
    return [
        {"file": path.name, "sha256": mf.file_sha256(path), "arch": capability, "target": target}
        | {"version": version, "shared": shared}
    ]


def build(registry=REGISTRY, out: Path = mf.CUBIN_DIR, budget=DEFAULT_MAX_REGISTERS, targets=TARGETS) -> dict:
    """Compile every kernel; on success replace `out`'s cubins and manifest, else raise BuildError
    and leave `out` as it was."""
    import triton

    out = Path(out)
    with tempfile.TemporaryDirectory() as folder, reproducible():
        stage, kernels, problems = Path(folder), {}, []
        for spec in registry:
            kernels[spec.name], found = build_kernel(spec, stage, budget, targets)
            problems += found
        if problems:
            message = "over the register budget or spilling; nothing written:\n  " + "\n  ".join(problems)
            raise BuildError(message, kernels)
        manifest = {"format": mf.FORMAT, "triton_version": triton.__version__, "targets": list(targets)}
        manifest["kernels"] = kernels
        out.mkdir(parents=True, exist_ok=True)
        for old in listed_files(out):
            old.unlink(missing_ok=True)
        for path in stage.iterdir():
            shutil.copy2(path, out / path.name)
        mf.write_manifest(out, manifest)
    return manifest


@contextlib.contextmanager
def reproducible():
    """No line info in the cubins and PTX: the same bytes from any checkout, no build paths inside."""
    from triton import knobs

    with knobs.compilation.scope():
        os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
        yield


def listed_files(directory: Path) -> list[Path]:
    try:
        kernels = mf.read_manifest(directory)["kernels"]
    except (FileNotFoundError, ValueError):
        return []
    return [
        directory / item["file"]
        for entry in kernels.values()
        for item in [*entry.get("cubins", {}).values(), *entry.get("ptx", [])]
    ]


def check(registry=REGISTRY, directory: Path = mf.CUBIN_DIR) -> list[str]:
    """What keeps the cubins in `directory` from matching the sources; empty when they match."""
    import triton

    try:
        manifest = mf.read_manifest(directory)
    except (FileNotFoundError, ValueError) as error:
        return [str(error)]
    problems = []
    if manifest["triton_version"] != triton.__version__:
        problems.append(f"built with triton {manifest['triton_version']}, installed {triton.__version__}")
    if manifest["targets"] != list(TARGETS):
        problems.append(f"built for {manifest['targets']}, TARGETS is {list(TARGETS)}")
    kernels = manifest["kernels"]
    problems += [
        f"{name}: in the manifest, not in the registry"
        for name in kernels.keys() - {s.name for s in registry}
    ]
    for spec in registry:
        entry = kernels.get(spec.name)
        if entry is None:
            problems.append(f"{spec.name}: registered, never built")
        else:
            problems += check_entry(spec, entry, Path(directory))
    return problems


def check_entry(spec: KernelSpec, entry: dict, directory: Path) -> list[str]:
    problems = []
    if entry["source_hash"] != source_hash(spec):
        problems.append(f"{spec.name}: its source or settings changed since the build")
    problems += [f"{spec.name}: no cubin for sm_{cc}" for cc in TARGETS if f"sm_{cc}" not in entry["cubins"]]
    for item in [*entry["cubins"].values(), *entry["ptx"]]:
        path = directory / item["file"]
        if not path.is_file():
            problems.append(f"{spec.name}: {item['file']} is missing")
        elif mf.file_sha256(path) != item["sha256"]:
            problems.append(f"{spec.name}: {item['file']} is not the file the build wrote")
    return problems


def summary(manifest: dict) -> str:
    lines = [f"{'kernel':<28} {'arch':<7} {'target':<8} {'regs':>4} {'shared':>7} {'stack':>5} {'local':>5}"]
    for name, entry in sorted(manifest["kernels"].items()):
        for arch, b in sorted(entry["cubins"].items(), key=lambda item: mf.arch_number(item[0])):
            lines.append(
                f"{name:<28} {arch:<7} {b['target']:<8} {b['registers']:>4} {b['shared']:>7} "
                f"{b['stack']:>5} {b['local']:>5}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.gpu.build", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=mf.CUBIN_DIR, help="the cubins' folder (default: %(default)s)"
    )
    parser.add_argument(
        "--check", action="store_true", help="check the built cubins match the sources; build nothing"
    )
    parser.add_argument("--max-registers", type=int, default=DEFAULT_MAX_REGISTERS, help="registers a thread")
    args = parser.parse_args(argv)
    try:
        import triton
    except ImportError:
        sys.stderr.write(f"engine.gpu.build needs triton: pip install triton=={TRITON_VERSION}\n")
        return 2
    if not args.check and triton.__version__ != TRITON_VERSION:
        sys.stderr.write(
            f"the cubins are built with triton {TRITON_VERSION}, not {triton.__version__}: install it, or "
            "move TRITON_VERSION once the launcher is checked against the new version's parameters\n"
        )
        return 2
    if args.check:
        problems = check(directory=args.out)
        sys.stdout.write("".join(f"{p}\n" for p in problems) or f"{args.out}: the cubins match the sources\n")
        return 1 if problems else 0
    try:
        manifest = build(out=args.out, budget=args.max_registers)
    except BuildError as error:
        sys.stderr.write(summary({"kernels": error.kernels}) + f"{error}\n")
        return 1
    sys.stdout.write(summary(manifest) + f"wrote {args.out / mf.MANIFEST_NAME}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
