"""Remote-code derivatives (Kimi-K2 → deepseek_v3) load through their base family, running no code."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine.config import OffloadConfig
from engine.errors import InvalidConfigError, UnsupportedArchitectureError
from engine.loader import load_model
from engine.model.check import check_model_folder, config_problems, unsupported_architecture_message
from engine.model.derived_config import base_model_type
from engine.model.folder import load_tokenizer, read_config
from engine.tiny.models import build_tiny_model, save_tiny_model
from tests.engine.exactness import assert_matches_reference

# A repository's remote code: running it would leave a file behind and fail the load.
TRAP = (
    "import pathlib\n"
    "pathlib.Path(__file__).with_name('RAN').write_text('ran')\n"
    "raise SystemExit('remote code ran')\n"
)
AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}


def _as_remote_code(folder, model_type: str, architectures: list[str]) -> None:
    """Rewrite a saved folder's config as a remote-code derivative's (Kimi-K2's shape)."""
    path = folder / "config.json"
    raw = json.loads(path.read_text()) | {
        "model_type": model_type,
        "architectures": architectures,
        "auto_map": AUTO_MAP,
    }
    path.write_text(json.dumps(raw))
    for module in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (folder / module).write_text(TRAP)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(transformers' deepseek_v3 reference, a folder of the same weights published as kimi_k2)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = build_tiny_model("deepseek_v3").eval()
    folder = save_tiny_model(reference, tmp_path_factory.mktemp("kimi_k2"))
    _as_remote_code(folder, "kimi_k2", ["DeepseekV3ForCausalLM"])
    return reference, folder


def test_a_kimi_k2_folder_reads_as_deepseek_v3_without_running_its_code(kimi):
    reference, folder = kimi
    config = read_config(folder)
    assert config.model_type == "deepseek_v3" and not getattr(config, "auto_map", None)
    assert config.n_routed_experts == reference.config.n_routed_experts
    model = load_model(folder, OffloadConfig(device="cpu", dtype="float32"))
    try:
        assert_matches_reference(model, reference, list(range(3, 15)), new_tokens=8)
    finally:
        model.close()
    assert not (folder / "RAN").exists()


def test_the_model_check_passes_a_derivative_it_loads(kimi, tmp_path):
    """The picker's check (no transformers import) agrees with the loader: Kimi-K2 is fine."""
    _, folder = kimi
    assert check_model_folder(folder).problems == ()
    raw = json.loads((folder / "config.json").read_text())
    assert config_problems(raw | {"architectures": ["SomethingNewForCausalLM"]}) == [
        unsupported_architecture_message("kimi_k2")
    ]


def test_remote_code_of_no_supported_family_is_refused_by_name(kimi, tmp_path):
    _, folder = kimi
    raw = json.loads((folder / "config.json").read_text())
    assert base_model_type(raw) == "deepseek_v3"
    assert base_model_type(raw | {"architectures": ["SomethingNewForCausalLM"]}) is None
    assert base_model_type({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}) is None
    (tmp_path / "config.json").write_text(json.dumps(raw | {"architectures": ["SomethingNewForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match="'kimi_k2' is not supported"):
        read_config(tmp_path)


def test_a_remote_code_tokenizer_is_named_never_run(kimi, tmp_path, caplog):
    _, folder = kimi
    settings = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    (tmp_path / "tokenization_kimi.py").write_text(TRAP)
    with caplog.at_level(logging.WARNING):
        assert load_tokenizer(tmp_path) is None  # only tiktoken.model: token ids still work
    assert "remote code (tokenization_kimi.TikTokenTokenizer)" in caplog.text
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(InvalidConfigError, match=r"remote code .* does not run a repository's code"):
        load_tokenizer(tmp_path)
    assert not (tmp_path / "RAN").exists()
