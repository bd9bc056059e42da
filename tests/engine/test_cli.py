"""`python -m engine`: the command-line contract, run as a user runs it (a subprocess).

`generate --json` prints exactly one JSON object (text, generated token ids, stats, model);
`--prompt` goes through the chat template when the tokenizer has one, else it is raw text; bad
input exits non-zero with the error on stderr and nothing on stdout. Each run is mostly a few
seconds of interpreter and torch start-up, so the slow runs start together when the module sets
up, one per CPU, and each test waits for the ones it checks.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.config import OffloadConfig
from engine.generation import GenerationConfig, generate_text
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.sampling import SamplingConfig
from engine.tiny.gguf_writer import write_tiny_gguf
from engine.tiny.models import TINY_ARCHITECTURES, make_tiny_model, tiny_config

PROMPT = "Hello, who are you?"
MAX_NEW = 8
STATS_KEYS = {"tpot_ms", "tokens_per_s", "hit_rate", "h2d_bytes", "misses", "hits", "simulated_link"}


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        assert self.returncode == 0, self.stderr
        assert len(self.stdout.splitlines()) == 1, f"expected one JSON line, got:\n{self.stdout}"
        return json.loads(self.stdout)


def run_cli(*args: str | int | Path) -> Run:
    # Bytes, decoded here: generated text may hold "\r", which text mode would turn into "\n".
    proc = subprocess.run(
        [sys.executable, "-m", "engine", *map(str, args)],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        check=False,
    )
    return Run(proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8"))


def generate_args(model: Path, *extra: str | int) -> list[str | int | Path]:
    return ["generate", "--model", model, "--prompt", PROMPT, "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cli") / "chat")


@pytest.fixture(scope="module")
def raw_model(chat_model, tmp_path_factory) -> Path:
    """The same model whose tokenizer has no chat template."""
    folder = Path(shutil.copytree(chat_model, tmp_path_factory.mktemp("cli") / "raw"))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings.pop("chat_template", None)
    tokenizer_config.write_text(json.dumps(settings))
    assert AutoTokenizer.from_pretrained(folder).chat_template is None
    return folder


@pytest.fixture(scope="module")
def llama_folder(chat_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "llama"
    folder.mkdir()
    config = json.loads((chat_model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    return folder


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("cli") / "gguf")


@pytest.fixture(scope="module")
def runs(chat_model, raw_model, llama_folder, gguf_file, tmp_path_factory):
    """name -> the `Future` of a slow CLI run, all started at once."""
    # the reference runs decode one token at a time, as every run did before speculation and
    # prefetch became the default (`auto`): they say so with --spec none --prefetch none
    plain = ("--spec", "none", "--prefetch", "none")
    greedy = generate_args(chat_model, "--greedy", "--json", "--max-new-tokens", MAX_NEW, *plain)
    seeded = generate_args(
        chat_model,
        *("--json", "--seed", "7", "--temperature", "1.0", "--max-new-tokens", MAX_NEW, *plain),
        *("--expert-budget", "4", "--policy", "mrs", "--sim-link-gbps", "5"),
    )
    commands = {
        "greedy": greedy,
        "greedy again": greedy,
        "seeded": seeded,
        "seeded again": seeded,
        "plain": generate_args(chat_model, "--greedy", "--max-new-tokens", MAX_NEW, *plain),
        "default": generate_args(chat_model, "--greedy", "--json", "--max-new-tokens", MAX_NEW),
        "default over a link": generate_args(
            chat_model, "--greedy", "--json", "--max-new-tokens", MAX_NEW, "--expert-budget", "4"
        ),
        "raw": generate_args(raw_model, "--greedy", "--json", "--max-new-tokens", 2),
        "missing folder": generate_args(tmp_path_factory.mktemp("cli") / "nowhere"),
        "unsupported architecture": generate_args(llama_folder),
        "make-tiny": ["make-tiny", tmp_path_factory.mktemp("cli") / "made", "--arch", "mixtral"],
        "speculative": generate_args(
            chat_model,
            *("--greedy", "--json", "--max-new-tokens", MAX_NEW, "--expert-budget", "4"),
            *("--spec", "self", "--top-r", "1", "--draft-len", "3", "--prefetch", "spmoe", "--cutoff", "0"),
        ),
        "bad cutoff": generate_args(chat_model, "--spec", "self", "--prefetch", "spmoe", "--cutoff", "9"),
        "gguf": generate_args(gguf_file, "--greedy", "--json", "--max-new-tokens", 4),
        "gguf exact": generate_args(
            gguf_file, *("--greedy", "--json", "--max-new-tokens", 4, "--kernels", "exact")
        ),
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        yield {name: pool.submit(run_cli, *args) for name, args in commands.items()}


def result(runs: dict[str, Future], name: str) -> Run:
    return runs[name].result()


@pytest.fixture(scope="module")
def greedy(runs) -> dict:
    return result(runs, "greedy").json()


def test_json_output(greedy):
    assert isinstance(greedy["text"], str)
    ids = greedy["token_ids"]
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    if greedy["finish_reason"] in ("eos", "stop"):
        assert 1 <= len(ids) <= MAX_NEW
    else:
        assert greedy["finish_reason"] == "length" and len(ids) == MAX_NEW
    stats = greedy["stats"]
    assert stats.keys() >= STATS_KEYS
    # on the CPU with no --sim-link the experts are used in place: nothing crosses a link
    assert stats["simulated_link"] is False and stats["h2d_bytes"] == 0 and stats["misses"] == 0
    assert stats["generated_tokens"] == len(ids)
    assert stats["hits"] + stats["misses"] > 0
    assert stats["hit_rate"] == pytest.approx(stats["hits"] / (stats["hits"] + stats["misses"]))
    assert greedy["model"]["model_type"] == "qwen3_moe" and greedy["model"]["device"] == "cpu"


def test_a_gguf_runs_on_llama_cpps_kernels_with_no_options_where_they_run(runs):
    """`--kernels auto` (the default) is ggml for a GGUF on the CPU where its library runs here;
    the stats and the model say which kernels computed it."""
    default, exact = result(runs, "gguf").json(), result(runs, "gguf exact").json()
    want = "ggml" if ggml_library.installed()[0] else "exact"
    assert default["stats"]["kernels"] == default["model"]["kernels"] == want
    assert exact["stats"]["kernels"] == exact["model"]["kernels"] == "exact"
    assert json.loads(result(runs, "greedy").stdout)["stats"]["kernels"] == "exact"  # not a GGUF


def test_greedy_is_reproducible(runs, greedy):
    again = result(runs, "greedy again").json()
    assert again["token_ids"] == greedy["token_ids"]
    assert again["text"] == greedy["text"]


def test_prompt_goes_through_the_chat_template(chat_model, greedy):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert greedy["stats"]["prompt_tokens"] == len(templated)
    assert len(templated) > len(tokenizer(PROMPT).input_ids)


def test_prompt_is_raw_text_without_a_chat_template(runs, raw_model):
    raw = result(runs, "raw").json()
    tokenizer = AutoTokenizer.from_pretrained(raw_model)
    assert raw["stats"]["prompt_tokens"] == len(tokenizer(PROMPT).input_ids)


def test_seeded_sampling_with_a_small_cache(runs):
    """--seed reproduces a sampled reply; a 4-expert MRS cache on a simulated link misses and copies."""
    first, second = result(runs, "seeded").json(), result(runs, "seeded again").json()
    assert first["token_ids"] == second["token_ids"]
    assert first["model"]["cache_slots"] == 4
    stats = first["stats"]
    assert stats["simulated_link"] is True
    assert stats["misses"] > 0
    assert stats["h2d_bytes"] == stats["misses"] * first["model"]["expert_nbytes"]


def test_plain_output_streams_the_text_then_a_summary(runs, greedy):
    run = result(runs, "plain")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(greedy["text"])
    summary = run.stdout[len(greedy["text"]) :]
    pattern = (
        rf"\n\[{greedy['finish_reason']}; {len(greedy['token_ids'])} tokens, [\d.]+ tok/s, "
        r"hit rate 100%, spec none, prefetch none, CPU, no link\]\n"
    )
    assert re.fullmatch(pattern, summary), summary


# Options are checked before torch is imported, so those runs are quick and need not start early.
QUICK_BAD_OPTIONS = {
    "bad budget": ["--expert-budget", "lots"],
    "bad policy": ["--policy", "fifo"],
    "bad link": ["--sim-link-gbps", "-1"],
    "bad --sim-link": ["--sim-link", "fast"],
    "links disagree": ["--sim-link", "4", "--sim-link-gbps", "8"],
}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing folder", r"error: Model folder not found: .*nowhere\. Check the path"),
        ("unsupported architecture", r"error: Architecture 'llama' is not supported.*qwen3_moe"),
        ("bad budget", r"error: Cannot read expert budget 'lots'"),
        ("bad policy", r"argument --policy: invalid choice: 'fifo'"),
        ("bad link", r"error: --sim-link-gbps must be a positive bandwidth in GB/s, got -1\.0"),
        (
            "bad --sim-link",
            r"argument --sim-link: give a bandwidth in GB/s \(16\) or 'calibrated', not 'fast'",
        ),
        ("links disagree", r"error: --sim-link 4 and --sim-link-gbps 8 disagree: give one\."),
    ],
)
def test_bad_input_exits_non_zero_with_the_message_on_stderr(case, message, runs, chat_model):
    if case in QUICK_BAD_OPTIONS:
        run = run_cli(*generate_args(chat_model, *QUICK_BAD_OPTIONS[case]))
    else:
        run = result(runs, case)
    assert run.returncode != 0
    assert re.search(message, run.stderr, flags=re.DOTALL), run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""


def test_make_tiny_writes_a_loadable_folder(runs):
    run = result(runs, "make-tiny")
    assert run.returncode == 0, run.stderr
    folder = Path(run.stdout.strip())
    assert folder.name == "made" and (folder / "config.json").is_file()
    model = load_model(folder, OffloadConfig(device="cpu"))
    try:
        assert model.arch.model_type == "mixtral"
        config = GenerationConfig(max_new_tokens=2, sampling=SamplingConfig(greedy=True))
        assert len(generate_text(model, PROMPT, config).token_ids) >= 1
    finally:
        model.close()


def test_make_tiny_offers_every_tiny_architecture():
    # The CLI lists SUPPORTED_MODEL_TYPES (a light import) as the choices of make-tiny --arch: every
    # one has a tiny config (hand-tuned for TINY_ARCHITECTURES, shrunk generically for the rest).
    assert set(TINY_ARCHITECTURES) <= set(SUPPORTED_MODEL_TYPES)
    assert all(tiny_config(model_type).model_type == model_type for model_type in SUPPORTED_MODEL_TYPES)


def test_speculative_options_give_the_same_text_and_report_speculation(runs, greedy):
    spec = result(runs, "speculative").json()
    assert spec["token_ids"] == greedy["token_ids"]  # greedy speculation is lossless
    stats = spec["stats"]
    assert stats["spec"] == "self" and stats["prefetch"].startswith("spmoe (cutoff 0 of 2")
    assert stats["accept_len"] >= 1 and stats["lossless"] is True
    for key in ("prefetch_precision", "prefetch_recall", "hit_rate_verify"):
        assert key in stats


def test_with_no_options_it_speculates_and_prefetches_where_experts_cross_a_link(runs, greedy):
    """The default (`auto`): a model without a draft model whose experts are copied into a cache
    drafts with itself (self) and prefetches with SP-MoE; with every expert used in place on the CPU
    (the default budget there) nothing would be saved, so it decodes plainly. The replies are the
    plain greedy one."""
    linked = result(runs, "default over a link")
    assert linked.returncode == 0, linked.stderr
    reply = linked.json()
    assert reply["token_ids"] == greedy["token_ids"]
    stats = reply["stats"]
    assert stats["spec"] == "self" and stats["prefetch"].startswith("spmoe")
    assert stats["accept_len"] >= 1
    in_place = result(runs, "default")
    assert in_place.returncode == 0, in_place.stderr
    reply = in_place.json()
    assert reply["token_ids"] == greedy["token_ids"]
    assert reply["stats"]["spec"] == "none" and reply["stats"]["prefetch"] == "none"


def test_out_of_range_cutoff_is_a_clear_error(runs):
    bad = result(runs, "bad cutoff")
    assert bad.returncode == 2 and "--cutoff must be from -1" in bad.stderr and bad.stdout == ""


def test_tune_reads_sim_link_as_the_bench_does(monkeypatch):
    """`tune --sim-link 16` and `calibrated` mean what they mean to `python -m engine.bench`: the
    same parser, the same GB/s in the offload config, the same calibration asked for."""
    import engine.cli as cli
    from engine.bench.main import build_parser
    from engine.options import offload_config, wants_calibrated_link

    parsed = []
    monkeypatch.setattr(cli, "run_tune", lambda args: parsed.append(args) or 0)
    for link in ("16", "calibrated"):
        assert cli.main(["tune", "--sim-link", link]) == 0
        bench = build_parser().parse_args(["--sim-link", link])
        tune = parsed[-1]
        assert tune.sim_link == bench.sim_link
        assert offload_config(tune).sim_link_gbps == offload_config(bench).sim_link_gbps
        assert wants_calibrated_link(tune) == wants_calibrated_link(bench) == (link == "calibrated")
    assert offload_config(parsed[0]).sim_link_gbps == 16.0


def test_tune_prints_each_point_by_drafter_with_its_prediction_the_choice_and_why():
    from types import SimpleNamespace

    from engine.cli import tune_summary
    from engine.tune.types import CurvePoint, TuneChoice

    measured = (
        CurvePoint(-1, 0, 36.0, "", 35.0, 37.5, 2),
        CurvePoint(1, 4, 25.0, "draft", 24.0, 26.0, 4),
        CurvePoint(1, 4, 24.0, "draft", 23.0, 25.0, 2, policy="mrs"),
        CurvePoint(1, 4, 31.0, "self", 30.0, 33.0, 2),
    )
    curve = (CurvePoint(-1, 0, 40.0), CurvePoint(1, 4, 22.5, "draft"), CurvePoint(1, 4, 28.0, "self"))
    sure = "Sure: 19% faster than the runner-up, beyond the spread of the runs (…)."
    why = "The draft model, draft length 4, prefetch to layer 1, MRS cache won at 24.0 ms/token, 1.50× plain."
    choice = TuneChoice(1, 4, 24, 41.7, "draft", sure, policy="mrs", why=why)
    prediction = SimpleNamespace(curve=curve)
    lines = tune_summary(
        SimpleNamespace(measured=measured, choice=choice, reused=False, prediction=prediction)
    )
    text = "\n".join(lines)
    assert any(
        "plain decoding" in line and "36.0" in line and "35.0–37.5, 2 runs; predicted 40.0" in line
        for line in lines
    )
    assert any(
        line.strip().startswith("self-speculation, draft length 4") and "predicted 28.0" in line
        for line in lines
    )
    assert "MRS cache" in text and "not predicted" in text  # a policy the analytic model does not cover
    assert text.index("  the draft model:") < text.index("  self-speculation:")  # grouped by drafter
    assert lines[-3] == (
        "chosen: the draft model, draft length 4, prefetch to layer 1, MRS cache; 24 cached experts: "
        "41.7 tok/s expected"
    )
    assert lines[-2:] == [sure, why]


def test_fit_says_where_a_model_on_disk_would_live_as_the_picker_says_it(capsys, monkeypatch):
    """`python -m engine fit MODEL` reads the headers and estimates with the picker's estimator: the
    demo fits a 24 GiB computer; on a 2 GiB one it is too big, in words naming the usable RAM and
    what converting its BF16 experts to int4 would need."""
    from engine.cli import main
    from engine.model import fit_estimate
    from engine.model.fit_estimate import GIB
    from engine.resources import demo_model_dir

    monkeypatch.setattr(fit_estimate, "machine_memory", lambda: (24 * GIB, None))
    assert main(["fit", str(demo_model_dir()), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = report["model"]
    assert model["convertible"] and model["expert_bytes"] > 4 * model["resident_bytes"] > 0
    assert report["fit"]["summary"].startswith("Fits (CPU only): ~") and report["fit"]["level"] == "good"
    monkeypatch.setattr(fit_estimate, "machine_memory", lambda: (2 * GIB, None))
    assert main(["fit", str(demo_model_dir())]) == 1
    line = capsys.readouterr().out.strip()
    assert (
        line.startswith(f"{demo_model_dir()}: Too big: needs ~")
        and "even with its experts as int4, lossy" in line
    )
    assert "about 1.7 GiB of this computer's 2.0 GiB RAM can hold a model" in line
    assert main(["fit", str(demo_model_dir().parent / "no-such-model")]) == 2
