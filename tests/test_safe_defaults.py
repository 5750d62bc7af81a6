"""Safe defaults (issue 7): no remote code unless asked, nothing evaluated, unpickled or shelled from input."""

import re
from pathlib import Path

from hgpo_trl.commands.train import parse

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("hgpo_trl/**/*.py"), *ROOT.glob("envs/**/*.py"), ROOT / "train.py"])
# Calls that would run or deserialise text a model, an environment or a config file controls.
UNSAFE = re.compile(r"(?<![\w.])(eval|exec|compile)\(|\bpickle\.|\bmarshal\.|\bshelve\.|yaml\.load\(|"
                    r"yaml\.unsafe_load|shell\s*=\s*True|os\.system\(|trust_remote_code\s*=\s*True|torch\.load\(")


def test_the_scan_sees_the_sources_and_can_fail():
    assert len(SOURCES) > 20 and ROOT / "hgpo_trl" / "rollout" / "actions.py" in SOURCES
    for bad in ("eval(text)", "pickle.loads(b)", "yaml.load(f)", "subprocess.run(c, shell=True)",
                "AutoModel.from_pretrained(p, trust_remote_code=True)", "torch.load(path)"):
        assert UNSAFE.search(bad), bad
    for fine in ("trainer.evaluate()", "model.eval()", "yaml.safe_load(f)", "re.compile(r'x')"):
        assert not UNSAFE.search(fine), fine


def test_no_source_evaluates_unpickles_or_shells_out():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in SOURCES for number, line in enumerate(path.read_text().splitlines(), 1)
             if UNSAFE.search(line.split("#")[0]) and not line.strip().startswith(("#", '"', "'"))]
    assert not found, "\n".join(found)


def test_remote_code_is_off_unless_the_config_asks(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: tiny\noutput_dir: out\nuse_cpu: true\n")
    _, args, _ = parse(["--config", str(config)])
    assert args.trust_remote_code is False  # TrainingArguments' field, which load_model forwards
