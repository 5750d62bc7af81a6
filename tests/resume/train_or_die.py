"""A 6-iteration HGPO run that checkpoints every iteration:
`python train_or_die.py OUT [straight=DIR] [kill_after=N] [resume=1] [iterations=N]`.

4 tasks, 2 an iteration: a pass over them every 2 iterations, so a kill after iteration 3 falls in the second
pass. 8 samples drawn from each iteration's steps (sub-sampling), trajectory dumps every iteration.

straight=DIR: first the whole run into DIR, uninterrupted, in this process (the reference: one launch fewer
than a process of its own; the run into OUT starts from a new model, trainer and seed all the same).
kill_after=N: the process SIGKILLs itself right after checkpoint-N is saved (a real kill, mid-run).
resume=1: continue from the latest checkpoint in OUT. At the end a run's folder holds final.pt, the parameters
(process 0's; also under `accelerate launch`, where every process kills itself after the same checkpoint).
"""

import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.trainer import HGPOTrainer
from tests.conftest import keydoor_corpus


class KillAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, extra: list[str]) -> None:
    options = dict(arg.split("=", 1) for arg in extra)
    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    if "straight" in options:
        train(options["straight"], tokenizer, [], resume=False)
    callbacks = [KillAfter(int(options["kill_after"]))] if "kill_after" in options else []
    train(out, tokenizer, callbacks, resume=options.get("resume") == "1", iterations=int(options.get("iterations", 6)))


def train(out: str, tokenizer, callbacks: list, resume: bool, iterations: int = 6) -> None:
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    args = HGPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4, tasks_per_device=2,
                      max_completion_length=4, max_env_steps=5, action_mode="plain", invalid_action="noop",
                      learning_rate=1e-2, train_iterations=iterations, logging_steps=1, report_to="none", use_cpu=True,
                      save_every_iterations=1, seed=0, disable_tqdm=True, trajectory_dump_every=1, ddp_timeout=60)
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, callbacks=callbacks,
                          train_dataset=make_tasks("keydoor", "train", num_rooms=4, num_colors=4).select(range(4)))
    trainer.train(resume_from_checkpoint=get_last_checkpoint(out) if resume else None)
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
