"""A 6-iteration HGPO run that checkpoints every other iteration:
`python train_or_die.py OUT [straight=DIR] [signal_at=N] [signal=SIGINT] [signal_rank=R] [resume=1] [iterations=N]
[pause_at=N]`.

4 tasks, 2 an iteration: a pass over them every 2 iterations, so a kill after iteration 3 falls in the second
pass. 8 samples drawn from each iteration's steps (sub-sampling), trajectory dumps every iteration.

straight=DIR: first the whole run into DIR, uninterrupted, in this process (the reference: one launch fewer
than a process of its own; the run into OUT starts from a new model, trainer and seed all the same).
signal_at=N: process `signal_rank` (0) sends itself `signal` (SIGINT) as iteration N's rollout starts (mid-run,
mid-iteration): the run stops at the end of iteration N with a checkpoint there.
pause_at=N: every process, as iteration N's rollout starts, writes its pid to OUT/paused-rankR and waits for the
file OUT/go: a test signals the processes from outside while each is inside iteration N, whatever its speed.
Every process writes OUT/exit-rankR at its exit, after every other exit handler: whether its process group was still
up (torch 2.13's teardown could abort on a gloo one).
resume=1: continue from the latest checkpoint in OUT. At the end a run's folder holds final.pt, the parameters
(process 0's), unless a signal stopped it.
"""

import atexit
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers.trainer_utils import get_last_checkpoint

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.trainer import HGPOTrainer
from tests.conftest import keydoor_corpus


def main(out: str, extra: list[str]) -> None:
    options = dict(arg.split("=", 1) for arg in extra)
    # (registered first, run last)
    atexit.register(lambda: Path(out, f"exit-rank{os.environ.get('RANK', '0')}").write_text(
        str(torch.distributed.is_initialized())))
    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    if "straight" in options:
        train(options["straight"], tokenizer, resume=False)
    train(out, tokenizer, resume=options.get("resume") == "1", iterations=int(options.get("iterations", 6)),
          signal_at=int(options.get("signal_at", 0)), signal_rank=int(options.get("signal_rank", 0)),
          number=getattr(signal, options.get("signal", "SIGINT")), pause_at=int(options.get("pause_at", 0)))


def train(out: str, tokenizer, resume: bool, iterations: int = 6, signal_at: int = 0, signal_rank: int = 0,
          number: int = signal.SIGINT, pause_at: int = 0) -> None:
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    args = HGPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4, tasks_per_device=2,
                      max_completion_length=4, max_env_steps=5, action_mode="plain", invalid_action="noop",
                      learning_rate=1e-2, train_iterations=iterations, logging_steps=1, report_to="none", use_cpu=True,
                      save_every_iterations=2, seed=0, disable_tqdm=True, trajectory_dump_every=1, ddp_timeout=60)
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer,
                          train_dataset=make_tasks("keydoor", "train", num_rooms=4, num_colors=4).select(range(4)))
    play = trainer._play

    def playing(tasks, *rest, **options):
        if trainer._iteration + 1 == signal_at and trainer.accelerator.process_index == signal_rank:
            os.kill(os.getpid(), number)
        if trainer._iteration + 1 == pause_at:
            pause(Path(out), trainer.accelerator.process_index)
        return play(tasks, *rest, **options)

    trainer._play = playing
    trainer.train(resume_from_checkpoint=get_last_checkpoint(out) if resume else None)
    if trainer.accelerator.is_main_process and not trainer.signal_stop.signal_name:
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, os.path.join(out, "final.pt"))


def pause(out: Path, rank: int) -> None:
    (out / f"paused-rank{rank}").write_text(str(os.getpid()))
    while not (out / "go").exists():  # (signal handlers run between these sleeps)
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
