"""The commands answer before the training stack is imported when they can: a config the parser refuses (an unknown
key or option, a value of the wrong type) is refused in about a second, in the full parse's own words
(`hgpo_trl.commands.quick_check`); and every message names the command the user ran (`hgpo-eval`, not `evaluate.py`)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from trl import ModelConfig

from hgpo_trl.commands.arguments import EVAL_SECTIONS, TRAIN_SECTIONS, ConfigError, _accepted, section_fields
from hgpo_trl.commands.parser import SectionParser
from hgpo_trl.commands.quick_check import hgpo_config_fields, refuse_early
from hgpo_trl.commands.train import parse
from hgpo_trl.config import HGPOConfig
from hgpo_trl.fields import HGPOFields
from tests.test_bad_configs import ROWS, config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "accelerate" not in p.parts)
HEAVY = ("torch", "transformers.training_args", "trl.trainer.grpo_config", "hgpo_trl.config")
# test_bad_configs' rows that need only the fields' names and types: refused before the imports.
EARLY = {"unknown-key", "unknown-key-far", "unknown-option", "estimator-option-name", "estimator-option-in-yaml",
         "env-not-mapping", "float-for-int", "list-for-float", "word-for-float", "quoted-word-for-int",
         "word-for-bool", "word-on-command-line", "list-for-dict"}


def test_hgpo_configs_fields_read_from_the_sources_are_the_classes():
    fields, options = hgpo_config_fields()
    real = section_fields((HGPOConfig,))
    assert list(fields) == list(real)  # every field, in the order the type check reads them
    assert {name: _accepted(hint) for name, (_, hint) in fields.items()} == \
        {name: _accepted(hint) for name, (_, hint) in real.items()}
    assert all(section == "HGPOConfig" for section, _ in fields.values())
    full = SectionParser((*TRAIN_SECTIONS, HGPOConfig, ModelConfig), "train.py")
    ours = SectionParser((*TRAIN_SECTIONS, HGPOFields, ModelConfig), "train.py")
    assert {o for a in full._actions for o in a.option_strings} == \
        {o for a in ours._actions for o in a.option_strings} | options
    assert "--no_dataloader_pin_memory" in options  # a TrainingArguments bool that defaults to True


@pytest.mark.parametrize(("row", "text", "extra", "setup"), [r[:4] for r in ROWS], ids=[r[0] for r in ROWS])
def test_the_early_check_refuses_as_the_full_parse_does_or_leaves_it_to_it(tmp_path, monkeypatch, row, text, extra,
                                                                           setup):
    if setup is not None:
        setup(monkeypatch, tmp_path)
    argv = ["--config", config(tmp_path, text), *extra]
    with pytest.raises(ConfigError) as full:
        parse(argv)
    if row in EARLY:
        with pytest.raises(ConfigError) as early:
            refuse_early(argv, TRAIN_SECTIONS, "train.py")
        assert str(early.value) == str(full.value)
    else:  # a value out of range, a missing file or package: the full parse's
        refuse_early(argv, TRAIN_SECTIONS, "train.py")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_passes_the_early_check(path):
    refuse_early(["--config", str(path), "--use_vllm", "false", "--report_to", "none", "tensorboard", "--rehearse"],
                 TRAIN_SECTIONS, "train.py")
    refuse_early(["--config", str(path), "--policy", "random", "expert", "--seeds", "1", "2"], EVAL_SECTIONS,
                 "evaluate.py")


@pytest.mark.parametrize(("text", "message"), [
    ("train_iterations: twenty\n", r"HGPOConfig\.train_iterations must be None, int, got 'twenty'"),
    ("history_lenght: 4\n", r"history_lenght \(did you mean history_length\?\); .*\(python train\.py --help-all"),
])
def test_train_py_refuses_a_bad_config_before_importing_the_training_stack(tmp_path, text, message):
    (tmp_path / "c.yaml").write_text(f"model_name_or_path: tiny\n{text}")
    code = ("import runpy, sys; sys.argv = ['train.py', '--config', sys.argv[1]]\ntry:\n"
            "    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit as stop:\n"
            f"    print('EXIT', stop.code, 'HEAVY', sorted(m for m in {HEAVY} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.yaml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "EXIT 2 HEAVY []", (done.stdout, done.stderr[-2000:])
    assert re.fullmatch(f"train\\.py: configuration error: .*{message}.*\n", done.stderr), done.stderr


def test_hgpo_eval_names_itself(tmp_path, monkeypatch, capsys):
    (tmp_path / "c.yaml").write_text("model_name_or_path: tiny\nhistory_lenght: 4\n")
    hgpo_eval = Path(sys.executable).with_name("hgpo-eval")
    done = subprocess.run([str(hgpo_eval), "--config", str(tmp_path / "c.yaml")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == ("hgpo-eval: configuration error: Unknown arguments from config file "
                           f"{tmp_path / 'c.yaml'}: history_lenght (did you mean history_length?); every key must be "
                           "a field (hgpo-eval --help-all lists them)\n")
    # A problem only the full parse sees, and the help, in the same words.
    from hgpo_trl.commands.evaluate import main

    monkeypatch.setattr(sys, "argv", [str(hgpo_eval)])
    with pytest.raises(SystemExit):
        main(["--config", str(ROOT / "configs" / "quickstart.yaml"), "--model_name_or_path", "tiny", "--num_envs", "0"])
    assert capsys.readouterr().err.startswith("hgpo-eval: configuration error: EvalArguments.num_envs must be")
    main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: hgpo-eval [--config FILE.yaml]") and "hgpo-eval --help-all lists every" in text
    assert "evaluate.py" not in text
