"""The ahead-of-time kernels' manifest: what `engine.gpu.build` writes beside the cubins and what
`engine.gpu.launcher` reads. Plain JSON and pure Python (no torch, no triton), so the build, the
launcher and the tests share one reading of it.

    {"format": 1, "triton_version": "3.8.0", "targets": [80, 86, 89, 90, 120],
     "kernels": {"<name>": {
         "function": "engine.gpu.smoke:scaled_add_kernel", "source_hash": "<sha256>",
         "entry": "<metadata.name>", "num_warps": 4, "num_stages": 2, "exact_fp": true,
         "constexprs": {...}, "max_registers": 128,
         "params": [{"name": "x_ptr", "type": "*fp32", "aligned": true}, ...,
                    {"name": "global_scratch", "type": "scratch"},
                    {"name": "profile_scratch", "type": "scratch"}],
         "cubins": {"sm_90": {"file": "<name>.sm_90.cubin", "sha256": ..., "target": "sm_90a",
                              "ptxas": "12.9", "shared": 2048, "registers": 30, "stack": 0,
                              "local": 0}, ...},
         "ptx": [{"file": "<name>.sm_120.ptx", "sha256": ..., "arch": 120, "target": "sm_120",
                  "version": "9.3", "shared": 2048}]}}}

`params` lists every kernel parameter in launch order, the scratch pointers Triton appends last
included (the launcher passes them as null; the build refuses kernels that need scratch memory).
A target ending in "a" (sm_90a, sm_120a) runs only on exactly that compute capability.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1
MANIFEST_NAME = "manifest.json"
CUBIN_DIR = Path(__file__).resolve().parent / "cubins"
SCRATCH = "scratch"


class UnsupportedArch(RuntimeError):
    """No cubin or PTX in the manifest runs on this device's compute capability."""


@dataclass(frozen=True)
class Image:
    """The file to load for one device: a cubin, or PTX for the driver to compile."""

    path: Path
    kind: str  # "cubin" or "ptx"
    arch: int  # what it was built for: 90 for sm_90 / sm_90a
    shared: int  # dynamic shared memory bytes to launch with


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(directory: Path = CUBIN_DIR) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no kernel manifest at {path}: run `python -m engine.gpu.build`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: manifest format {manifest.get('format')!r}, this engine reads {FORMAT}")
    return manifest


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def arch_number(arch_name: str) -> int:
    """'sm_90a' -> 90, 'sm_120' -> 120."""
    return int(arch_name.removeprefix("sm_").rstrip("abcdefghijklmnopqrstuvwxyz"))


def is_arch_specific(target: str) -> bool:
    """sm_90a / sm_120a code runs only on that exact compute capability."""
    return target[-1].isalpha()


def select_image(name: str, entry: dict, capability: int, directory: Path = CUBIN_DIR) -> Image:
    """The image for a device of compute capability `capability` (major*10 + minor): its own cubin;
    else the nearest lower cubin of the same major that is not arch-specific; else PTX built for a
    capability at or below it (the driver compiles it). Raises UnsupportedArch naming what exists."""
    directory = Path(directory)
    cubins = entry.get("cubins", {})
    exact = cubins.get(f"sm_{capability}")
    if exact is not None:
        return Image(directory / exact["file"], "cubin", capability, exact["shared"])
    same_major = [
        (arch_number(key), build)
        for key, build in cubins.items()
        if arch_number(key) // 10 == capability // 10
        and arch_number(key) < capability
        and not is_arch_specific(build["target"])
    ]
    if same_major:
        arch, build = max(same_major, key=lambda item: item[0])
        return Image(directory / build["file"], "cubin", arch, build["shared"])
    ptx = [p for p in entry.get("ptx", []) if p["arch"] <= capability and not is_arch_specific(p["target"])]
    if ptx:
        best = max(ptx, key=lambda p: p["arch"])
        return Image(directory / best["file"], "ptx", best["arch"], best["shared"])
    built = sorted(cubins, key=arch_number)
    forward = [f"PTX for sm_{p['arch']}+" for p in entry.get("ptx", [])]
    raise UnsupportedArch(
        f"kernel {name}: nothing runs on this GPU (sm_{capability}); built for "
        f"{', '.join(built + forward) or 'nothing'}. Add the target to engine/gpu/build.py and rebuild."
    )
