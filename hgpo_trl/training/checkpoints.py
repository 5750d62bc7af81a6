"""Checkpoints that a kill cannot corrupt, holding the trainer's own state beside the Trainer's, and the saved KL
reference of a model built in memory, which a resumed run reads back."""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from transformers import PreTrainedModel
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

STAGING_DIR = ".staging"  # checkpoints are written here, then renamed into output_dir
TRAINER_STATE_FILE = "hgpo_trainer_state_{rank}.json"  # each process's own state, beside trainer_state.json


def save_staged(trainer, trial, write: Callable[[str], None]) -> None:
    """Run `write(folder)` (the Trainer's checkpoint, and ours) with the Trainer's output folder pointed at
    `output_dir/.staging`, then rename the finished checkpoint into place: a run killed mid-save leaves the
    previous checkpoint as the latest, never a half-written one."""
    run_dir = trainer._get_output_dir(trial=trial)
    staging = os.path.join(run_dir, STAGING_DIR)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    if trainer.args.should_save:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
    trainer.accelerator.wait_for_everyone()
    trainer._get_output_dir = lambda trial=None: staging  # the parent writes and rotates there
    try:
        write(os.path.join(staging, name))
    finally:
        del trainer._get_output_dir
    trainer.accelerator.wait_for_everyone()
    # The Trainer recorded the best checkpoint where it wrote it (in staging), and only under step or epoch
    # strategies: point it at the renamed folder, whatever the cadence, and keep that in the saved state.
    best = trainer.state.best_global_step
    if best and (best == trainer.state.global_step or os.path.isdir(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}"))):
        trainer.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
    if trainer.args.should_save:
        final = os.path.join(run_dir, name)
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (a resumed run)
        os.replace(os.path.join(staging, name), final)
        with suppress(OSError):  # the staging folder, now empty, is not left behind
            os.rmdir(staging)
        if best:
            trainer.state.save_to_json(os.path.join(final, TRAINER_STATE_NAME))
        rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
    trainer.accelerator.wait_for_everyone()


def save_in_memory_weights(model, processing_class, args, peft: bool) -> bool:
    """Save the starting weights of a model built (or warm-started) in memory, which no path names, and point the
    model at the folder. Without PEFT (and beta > 0) they are the KL reference, which TRL rebuilds from
    `model.config._name_or_path`: `output_dir/reference_model`. With PEFT they are the base model, which a
    checkpoint (the adapter alone) does not hold and `adapter_config.json` names: `output_dir/base_model`, the
    base of resume, `hgpo-merge` and `hgpo-eval`. A resumed run (`args.resume_from_checkpoint`) reuses the folder
    its start saved: the model passed in to resume is not the one the run started from, and under PEFT the saved
    base's weights are loaded into it. Returns whether it saved the model passed in (a fresh start)."""
    if not isinstance(model, PreTrainedModel):
        return False  # a PEFT model passed in: its disabled adapter, or TRL's "ref" copy, is the reference
    if model.config._name_or_path:  # a path or an id: PEFT names the adapter's base from the model's attribute
        model.name_or_path = model.config._name_or_path
        return False
    path = (Path(args.output_dir) / ("base_model" if peft else "reference_model")).resolve()
    if args.resume_from_checkpoint:
        if not (path / "config.json").is_file():
            what = "the base model" if peft else f"with beta={args.beta}, the KL reference"
            raise ValueError(f"resume_from_checkpoint with a model built in memory: {what} saved when the run "
                             f"started, {path}, is missing (resume into the run's own output_dir)")
        if peft:  # a checkpoint holds the adapter alone
            load_weights(model, path)
    else:
        state = PartialState()
        if state.is_main_process:
            model.save_pretrained(path)
            if processing_class is not None:  # a complete model folder: vLLM and evaluate.py can load it
                processing_class.save_pretrained(path)
        state.wait_for_everyone()
    # (PEFT writes the adapter's base_model_name_or_path from the attribute the model was built with)
    model.config._name_or_path = model.name_or_path = str(path)
    return not args.resume_from_checkpoint


def load_weights(model, folder: Path) -> None:
    """The weights save_pretrained wrote in `folder` into `model`, in place, file by file (no second model in
    memory); a weight tied to a loaded one (the LM head to the embeddings) may be absent."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {p.data_ptr() for name, p in model.named_parameters() if name in state}
    parameters = dict(model.named_parameters(remove_duplicate=False))
    untied = [name for name in missing if name not in parameters or parameters[name].data_ptr() not in loaded]
    if unexpected or untied:
        raise ValueError(f"{folder} does not hold this model's weights (missing {untied[:3]}, unexpected "
                         f"{unexpected[:3]})")


@dataclass
class RunClock:
    """A run's wall time in segments: those of the runs it resumes (each up to its checkpoint, which carries
    them) and its own, counted from `start` (train.py sets the time it started)."""

    start: float = field(default_factory=time.time)
    before: list[float] = field(default_factory=list)

    def segments(self) -> list[float]:
        return [*self.before, round(time.time() - self.start, 1)]


def without_tied_keys(model, load_result):
    """`load_result` of a checkpoint's load less the missing weights tied to a loaded one (the LM head under tied
    embeddings, saved once with its twin), which the Trainer would report as if weights were lost."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    loaded = {p.data_ptr() for name, p in parameters.items() if name not in load_result.missing_keys}
    missing = [k for k in load_result.missing_keys if k not in parameters or parameters[k].data_ptr() not in loaded]
    return load_result._replace(missing_keys=missing) if hasattr(load_result, "_replace") else load_result


def save_checkpoint(trainer, trial, parent_save: Callable[[], None]) -> None:
    """The Trainer's checkpoint (`parent_save()`) plus each process's own run state (the iterations played,
    dynamic sampling's extra batches, the fault streak, its sub-sampling stream, seeded per process, the wall
    time so far), staged (`save_staged`)."""

    def write(folder: str) -> None:
        parent_save()
        write_trainer_state(folder, trainer.accelerator.process_index, {
            "iterations": trainer.completed_iterations, "extra_batches": trainer._iterations.extra_batches,
            "faulty_streak": trainer._faults.count,
            "sample_rng": trainer._sample_rng.bit_generator.state, "wall_seconds": trainer.clock.segments()})

    save_staged(trainer, trial, write)


def load_run_state(trainer, checkpoint: str) -> None:
    """A resumed run continues the iteration count (the stop, the tasks, the schedule, dump names and the
    diagnostics cadence), dynamic sampling's task stream, the fault streak and the sub-sampling stream of
    `checkpoint`: it is the run it continues."""
    state = read_trainer_state(checkpoint, trainer.accelerator.process_index)
    trainer._iteration = state.get("iterations", trainer._iteration)
    trainer._iterations.extra_batches = state.get("extra_batches", 0)
    trainer._faults.count = state.get("faulty_streak", trainer._faults.count)
    if "sample_rng" in state:
        trainer._sample_rng.bit_generator.state = state["sample_rng"]
    trainer.clock.before = state.get("wall_seconds", [])


class ResumeError(ValueError):
    """A checkpoint this run cannot resume (train.py reports it in one line)."""


def check_resume(checkpoint: str | bool | None, args, processes: int, saved_start: bool, model_config) -> str | None:
    """The checkpoint to resume, as Trainer.train takes it, or None. Refused: one that another number of processes
    saved (each saves its own state file; the Trainer's rng_state files in a checkpoint from before): the
    iteration count, the fault streak and the sub-sampling stream are each process's, the task split and the
    samples per iteration follow the process count, and DeepSpeed's partitioned optimizer state loads only on the
    world size that wrote it; then a damaged one (`resumable_checkpoint`; True, or 'true', is the newest in
    output_dir that loads). Refused first: a resume that `args.resume_from_checkpoint` does not announce when the
    trainer saved the model passed in as the run's start (`saved_start`, `save_in_memory_weights`): it would have
    overwritten the run's own. Refused last: a checkpoint of a model of another shape than `model_config`'s
    (`check_model_shape`)."""
    # How the resume is asked for is wrong whatever the checkpoint holds: said before the checkpoint is read.
    if saved_start and checkpoint not in (None, False) and not args.resume_from_checkpoint:
        raise ResumeError(f"train(resume_from_checkpoint={str(checkpoint)!r}): set HGPOConfig.resume_from_checkpoint "
                          "to it too (train.py does), so that the trainer reuses the run's saved reference / base "
                          "model instead of saving the model passed in over it")
    named = isinstance(checkpoint, str | os.PathLike) and str(checkpoint).lower() != "true"
    if named:
        check_processes(checkpoint, processes)
    checkpoint = resumable_checkpoint(checkpoint, args.output_dir)
    if checkpoint is None:
        return None
    if not named:
        check_processes(checkpoint, processes)
    check_model_shape(checkpoint, model_config)
    return checkpoint


# The config fields that set a model's weight shapes (a config's attribute_map names them for other families).
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim")


def check_model_shape(checkpoint: str, model_config) -> None:
    """Refuse a checkpoint whose config.json has another shape than this run's model (another hidden size: a
    `size mismatch` traceback as it loaded; another layer count: the missing layers a warning, then the optimizer's
    "parameter group that doesn't match"). A checkpoint without config.json (a PEFT adapter) is not checked."""
    path = Path(checkpoint, "config.json")
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    differ = []
    for name in SHAPE_FIELDS:
        there, here = saved.get(model_config.attribute_map.get(name, name)), getattr(model_config, name, None)
        if there is not None and here is not None and there != here:
            differ.append(f"{name} {there} there, {here} here")
    if differ:
        raise ResumeError(f"resume_from_checkpoint: {checkpoint} holds a model of another shape than this run's: "
                          f"{'; '.join(differ)}. Resume with the model the run started from (model_name_or_path, "
                          "and tiny_* for the tiny model), or start a new run")


def check_processes(checkpoint: str | os.PathLike, processes: int) -> None:
    """Refuse a checkpoint that another number of processes saved (check_resume)."""
    saved = (len(list(Path(checkpoint).glob(TRAINER_STATE_FILE.format(rank="*"))))
             or len(list(Path(checkpoint).glob("rng_state_*.pth"))) or int(Path(checkpoint, "rng_state.pth").is_file()))
    if saved and saved != processes:
        raise ResumeError(
            f"resume_from_checkpoint: {checkpoint} was saved by {saved} process{'es' * (saved > 1)} and this run has "
            f"{processes}: its per-process state (iterations, task split, sampling streams; under DeepSpeed the "
            f"partitioned optimizer) resumes only on {saved}. Resume with {saved} process{'es' * (saved > 1)}, or "
            f"start a new run from its weights (model_name_or_path: {checkpoint})")


def resumable_checkpoint(checkpoint: str | bool | None, output_dir: str) -> str | None:
    """`checkpoint` checked file by file (`damaged_file`): a damaged one is refused in one line naming the file
    and the newest checkpoint beside it that loads; True (or 'true', as YAML and the command line write it) is
    the newest in `output_dir` that loads, with a line when that is not the newest."""
    if isinstance(checkpoint, str) and checkpoint.lower() == "true":
        checkpoint = True
    if checkpoint is None or checkpoint is False:
        return None
    if checkpoint is True:
        candidates = saved_checkpoints(output_dir)
        if not candidates:
            raise ResumeError(f"resume_from_checkpoint: true: {output_dir} holds no checkpoint-N folder")
        problems = []
        for candidate in candidates:
            if (problem := damaged_file(candidate)) is None:
                if problems and PartialState().is_main_process:
                    print(f"[resume] {problems[0]}: resuming from {candidate}, the newest checkpoint that loads",
                          flush=True)
                return str(candidate)
            problems.append(problem)
        raise ResumeError(f"resume_from_checkpoint: true: no checkpoint in {output_dir} loads ({problems[0]})")
    if (problem := damaged_file(checkpoint)) is not None:
        beside = [c for c in saved_checkpoints(Path(checkpoint).parent) if c != Path(checkpoint)]
        good = next((c for c in beside if damaged_file(c) is None), None)
        raise ResumeError(f"resume_from_checkpoint: {problem}; "
                          + (f"the newest checkpoint beside it that loads is {good}" if good
                             else "no checkpoint beside it loads"))
    return str(checkpoint)


def saved_checkpoints(folder: str | Path) -> list[Path]:
    """The checkpoint-N folders in `folder`, newest (highest N) first."""
    found = [p for p in Path(folder).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True)


WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                 "pytorch_model.bin", "pytorch_model.bin.index.json")


def damaged_file(checkpoint: str | Path) -> str | None:
    """The first part of `checkpoint` that cannot be read back, and why; None when all can. Cheap whatever the
    model's size: a safetensors header, a torch file's zip directory (where a cut file fails), a JSON file; the
    trainer state and the weights must be there."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not (folder / TRAINER_STATE_NAME).is_file():
        return f"{folder / TRAINER_STATE_NAME} is missing"
    sharded = any(folder.glob("global_step*")) or any(folder.glob("pytorch_model_fsdp*"))  # DeepSpeed's, FSDP's
    if not any((folder / name).is_file() for name in WEIGHTS_FILES) and not sharded:
        return f"{folder} holds no model weights ({', '.join(WEIGHTS_FILES[:3])}, ...)"
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        try:
            _read_back(path)
        except Exception as err:  # (each library's own error: the message names the file instead)
            return f"{path} is damaged ({type(err).__name__}: {(str(err).splitlines() or [''])[0]})"
    return None


def _read_back(path: Path) -> None:
    """Read `path`'s structure back (not every byte), raising if it is cut or malformed."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as weights:
            weights.keys()
    elif path.suffix == ".json":
        index = json.loads(path.read_text())
        for shard in set((index.get("weight_map") or {}).values()) if isinstance(index, dict) else ():
            if not (path.parent / shard).is_file():
                raise FileNotFoundError(f"the shard {shard} it lists is missing")
    elif path.suffix in (".pt", ".pth", ".bin"):
        with path.open("rb") as file:
            zipped = file.read(4) == b"PK\x03\x04"  # torch.save's format since torch 1.6
        if zipped:
            zipfile.ZipFile(path).close()
        elif path.stat().st_size == 0:
            raise ValueError("the file is empty")


def write_trainer_state(folder: str | Path, rank: int, state: dict[str, Any]) -> None:
    """Process `rank`'s own state (the iterations played, its random streams) into checkpoint `folder`."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    Path(folder, TRAINER_STATE_FILE.format(rank=rank)).write_text(json.dumps(state, indent=2))


def read_trainer_state(folder: str | Path, rank: int) -> dict[str, Any]:
    """Process `rank`'s state saved in checkpoint `folder`; {} for a checkpoint that has none (another
    number of processes, or a checkpoint from before the trainer kept one)."""
    path = Path(folder, TRAINER_STATE_FILE.format(rank=rank))
    return json.loads(path.read_text()) if path.is_file() else {}


@contextmanager
def cpu_map_location(device: torch.device):
    """The Trainer loads a checkpoint's optimizer onto `args.device` when there are several processes; on CPUs
    that is `cpu:0`, which torch.load cannot restore to ("don't know how to restore data location"), so a
    multi-process CPU run could not resume. Within this context a CPU map_location is plain "cpu"."""
    if device.type != "cpu":
        yield
        return
    load = torch.load

    def load_on_cpu(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = load_on_cpu
    try:
        yield
    finally:
        torch.load = load
