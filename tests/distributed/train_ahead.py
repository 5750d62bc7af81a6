"""Generation beside training under two processes, for tests/vllm_cpu_runs.py (in vLLM's CPU venv):
`python -m accelerate.commands.launch --config_file configs/accelerate/cpu_2proc.yaml train_ahead.py OUT URL MODEL`.

Three HGPO iterations of the tiny model at MODEL played ahead (`async_generation`, max_staleness 1) on the vLLM
server at URL, each process with its own thread and requests, the weights pushed by both after every optimizer step;
then one greedy evaluation (both processes' requests, the thread stopped). Each process writes OUT/rank{i}.json:
per rollout it trained, its tasks (the rows the thread played: small keydoor's task ids repeat), its task groups
and its steps' staleness; the logged metrics, a parameter checksum, whether a thread that plays ahead is left, and
(the main process) the weights the server holds.
Collectives time out after 60 s (ddp_timeout): a process left waiting fails the run instead of hanging it.
"""

import json
import os
import sys
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from accelerate import PartialState

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.rollout.vllm_cpu import VERSION_METHOD, call_server
from hgpo_trl.trainer import HGPOTrainer
from hgpo_trl.training import dynamic_sampling

GAME = {"env_name": "keydoor", "action_mode": "plain", "max_env_steps": 5, "max_completion_length": 4,
        "vllm_max_model_length": 512, "report_to": "none", "bf16": False, "use_cpu": True,
        "env_kwargs": {"key_reward": 1.0}}


def main(out: str, url: str, model: str) -> None:
    args = HGPOConfig(output_dir=os.path.join(out, "run"), per_device_train_batch_size=16, num_generations=4,
                      tasks_per_device=2, invalid_action="end_episode", learning_rate=1e-2, train_iterations=3,
                      logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, ddp_timeout=60,
                      use_vllm=True, vllm_mode="server", rollout_mode="continuous", vllm_server_base_url=url,
                      vllm_server_timeout=300, async_generation=True, max_staleness=1, **GAME)
    trainer = HGPOTrainer(model=model, args=args, train_dataset=make_tasks("keydoor", "train", num_tasks=16),
                          eval_dataset=make_tasks("keydoor", "valid", num_tasks=4))
    rollouts, take = [], dynamic_sampling.take_rollout

    def recording_take(trainer):
        rollout = take(trainer)
        rank, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
        rollouts.append({"tasks": trainer._task_sampler.iteration_tasks(trainer._iteration, rank, processes),
                         "groups": len({s.group for s in rollout.steps}),
                         "staleness": sorted({trainer.state.global_step - s.completion.version
                                              for s in rollout.steps})})
        return rollout

    dynamic_sampling.take_rollout = recording_take
    trainer.train()
    evaluated = trainer.evaluate()
    state = PartialState()
    served = call_server(trainer.vllm_generation.vllm_client, VERSION_METHOD) if state.is_main_process else None
    ours = ("env/", "adv/", "steps/", "async/")
    record = {"world": state.num_processes, "global_step": trainer.state.global_step, "rollouts": rollouts,
              "checksum": float(sum(p.double().sum() for p in trainer.model.parameters())),
              "logs": [{k: v for k, v in h.items() if k.startswith(ours)} for h in trainer.state.log_history
                       if "steps/collected" in h],
              "eval_tasks": evaluated["eval_tasks"], "served": served,
              "thread_left": trainer._ahead is not None or any(t.name == "rollouts-ahead" for t in threading.enumerate())}
    with open(os.path.join(out, f"rank{state.process_index}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
