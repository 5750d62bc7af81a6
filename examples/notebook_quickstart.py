# %% [markdown]
# # hgpo-trl from Python: build, train, plot
#
# The Python API in notebook cells (`# %%`: VS Code, PyCharm and Jupyter with jupytext open it as a notebook).
# It runs offline on a CPU in about a minute: a tiny model built in-process, the built-in keydoor environment,
# a short supervised warm start (the model must learn the answer format first), a few HGPO iterations and the
# learning curve. `make demo` runs the full quickstart, which trains until the agent succeeds.

# %%
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a tiny model is far faster on one thread
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads anything

from functools import partial

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.reporting import plot_learning
from hgpo_trl.tiny import build_tiny_model, build_tiny_tokenizer
from hgpo_trl.trainer import HGPOTrainer
from hgpo_trl.warmstart import environment_corpus, warm_start

OUTPUT = os.environ.get("NOTEBOOK_OUTPUT", "outputs/notebook")

# %% [markdown]
# ## The environment and its tasks
# One dataset row per task; `make_env` builds one environment, `reset(task)` starts an episode.

# %%
pools = {"num_rooms": 6, "num_colors": 6}
train_tasks = make_tasks("keydoor", "train", **pools)
eval_tasks = make_tasks("keydoor", "valid", **pools)
env = make_env("keydoor")
observation, info = env.reset(train_tasks[0])
print(len(train_tasks), "training tasks,", len(eval_tasks), "validation tasks")
print(observation, info["admissible_actions"])

# %% [markdown]
# ## A tiny model, and a warm start on random admissible actions
# The word-level tokenizer is trained on the environment's text; the warm start teaches the answer format and a
# uniform choice among the admissible actions (nothing about which one is good).

# %%
tokenizer = build_tiny_tokenizer(environment_corpus(env, list(train_tasks)))
model = build_tiny_model(tokenizer, hidden_size=128, num_layers=2, num_heads=4)
print(warm_start(model, tokenizer, partial(make_env, "keydoor"), list(train_tasks), steps=40,
                 output_dir=f"{OUTPUT}/warmstart"))

# %% [markdown]
# ## HGPO
# Each iteration plays `tasks_per_device` tasks `num_generations` times; every step is a sample with its own
# hierarchical advantage.

# %%
args = HGPOConfig(
    output_dir=OUTPUT, use_cpu=True, report_to="none", save_strategy="no", seed=0,
    env_name="keydoor", max_env_steps=8, action_mode="plain", admissible_only=True, invalid_action="noop",
    tasks_per_device=4, num_generations=8, per_device_train_batch_size=64, max_completion_length=6,
    estimator="hgpo", history_length=2, learning_rate=3e-4, lr_scheduler_type="constant", beta=0.0,
    train_iterations=4, logging_steps=1, eval_strategy="steps", eval_steps=2, eval_temperature=0.0,
    eval_max_tasks=32,
)
trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_tasks,
                      eval_dataset=eval_tasks)
trainer.train()

# %% [markdown]
# ## The learning curve

# %%
for entry in trainer.state.log_history:
    if "env/success_rate" in entry:
        print(f"iteration {entry['step']}: success {entry['env/success_rate']:.2f}, "
              f"HGPO steps with level-2 peers {entry['hgpo/level2_with_peers']:.2f}")
path = plot_learning(trainer.state.log_history, f"{OUTPUT}/learning.png")
print("plot:", path)
# In Jupyter: from IPython.display import Image; Image(str(path))
