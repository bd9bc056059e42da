"""What a model check found: `ModelCheck`, the result `engine.model.check.check_model_folder`
gives (and the GUI unpickles from its checking child), and the float types it counts."""

from __future__ import annotations

from dataclasses import dataclass

FLOAT_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class ModelCheck:
    """What a model folder holds, and every reason it cannot be loaded (none: it can)."""

    path: str
    problems: tuple[str, ...]
    model_type: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    num_tensors: int = 0
    num_params: int = 0
    weight_bytes: int = 0
    weight_files: tuple[str, ...] = ()
    name: str | None = None  # a GGUF's own name for itself: `general.name` and its quant type
    # what the loader will hold (engine.model.fit_estimate): the routed experts as stored, the rest
    # as BF16 (a GGUF's quantized token embedding stays in its blocks), and whether the experts are
    # floats the loader may convert to int8/int4 where they do not fit
    expert_bytes: int = 0
    resident_bytes: int = 0
    float_experts: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: what the folder is, or its first problem."""
        if not self.ok:
            return self.problems[0]
        experts = f", {self.num_experts} experts, top-{self.top_k}" if self.num_experts else ""
        count = self.num_params
        params = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
        return f"{self.model_type}{experts}, {params} parameters in {len(self.weight_files)} file(s)"
