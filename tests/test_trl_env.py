"""TRL's environment_factory classes played a tool call a step (envs/trl_env.py): the class as TRL reads it, its
episodes, the groups GiGPO/HGPO form on it, training with the Qwen2.5 chat template and the tiny quickstart path."""

import asyncio
import json
import random
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from hgpo_trl.advantages import compute_advantages
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import TRLEnv, make_env
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.envs.trl_calls import read_call, written_call
from hgpo_trl.models.tiny import make_tiny
from hgpo_trl.rollout.actions import FORMAT_INSTRUCTIONS
from hgpo_trl.rollout.generation import encode_prompt
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout
from hgpo_trl.trainer import HGPOTrainer

QWEN25 = Path(__file__).resolve().parents[2] / "shared" / "data" / "qwen2.5-tokenizer"
needs_qwen = pytest.mark.skipif(not QWEN25.is_dir(), reason=f"the offline Qwen2.5 tokenizer is read from {QWEN25}")
RESETS: list[dict] = []  # every reset's keyword arguments, whoever called it (TRL or the adapter)


class Corridor:
    """A TRL environment class, as TRL's docs write one: walk to the goal cell of a corridor."""

    def __init__(self):
        self.position, self.goal, self.done, self.reached = 0, 0, False, False

    def reset(self, goal: int, **kwargs) -> str:  # seeded from the row's goal column: every rollout starts alike
        RESETS.append({"goal": goal, **kwargs})
        self.position, self.goal, self.done, self.reached = 0, goal, False, False
        return f"You are at cell 0. The goal is cell {goal}."

    @property
    def cells_walked(self) -> int:  # a property: never a tool (TRL lists functions only)
        return abs(self.position)

    def move(self, direction: Literal["left", "right"]) -> str:
        """Move one cell.

        Args:
            direction: which way to go.
        """
        if direction == "left" and self.position == 0:
            raise ValueError("a wall is there")  # TRL answers it with {'error': ...}
        self.position += 1 if direction == "right" else -1
        self.done = self.reached = self.position == self.goal
        return f"You are at cell {self.position}."

    def get_reward(self) -> float:
        return 10.0 if self.reached else 0.0


class KeyedCorridor(Corridor):
    """The same, with a state key: steps at one cell group together whatever path led there."""

    @property
    def state_key(self) -> str:
        return f"cell {self.position}"


class Unseeded(Corridor):
    def reset(self, goal: int, **kwargs) -> str:
        return super().reset(random.randint(1, 10**6))


class Undescribed(Corridor):
    def jump(self, height):
        return "jumped"


ROWS = [{"prompt": [{"role": "user", "content": "Reach the goal."}], "goal": goal} for goal in (2, 3)]


def play(env, calls):
    return [env.step(call) for call in calls]


def test_calls_are_read_in_both_formats():
    assert read_call('<tool_call>\n{"name": "move", "arguments": {"direction": "right"}}\n</tool_call>', "json") \
        == ("move", {"direction": "right"})
    assert read_call('{"name": "move", "parameters": "{\\"direction\\": \\"left\\"}"}', "json") == \
        ("move", {"direction": "left"})
    assert read_call('move(direction="right")', "call") == ("move", {"direction": "right"})
    assert read_call('move ( direction = " right " )', "call") == ("move", {"direction": " right "})
    assert read_call("I reached it.", "json") is None and read_call("I reached it.", "call") is None
    for text, fmt in [('<tool_call>{"name": "move", "arguments": {</tool_call>', "json"), ("move(direction=", "call"),
                      ("move(__import__('os'))", "call")]:
        with pytest.raises(ValueError, match="^unreadable tool call") as error:
            read_call(text, fmt)
        assert "\n" not in str(error.value)
    assert written_call("move", {"direction": "left"}, "call") == "move(direction='left')"


def test_a_trl_class_plays_a_tool_call_a_step():
    env = make_env("trl", environment_factory=Corridor, max_steps=4)
    observation, info = env.reset(ROWS[0])
    assert observation == "You are at cell 0. The goal is cell 2." and info["task"].startswith("Reach the goal.\nTools:")
    assert set(env._tools_now) == {"move"}  # cells_walked (a property) and get_reward are no tools
    assert info["admissible_actions"] == ["move(direction='left')", "move(direction='right')"]
    wall, right, plain = play(env, ["move(direction='left')", 'move ( direction = " right " )', "jump()"])
    assert wall[0] == "{'error': 'a wall is there'}" and wall[4]["invalid_move"] and wall[1:4] == (0.0, False, False)
    assert right[:4] == ("You are at cell 1.", 0.0, False, False) and not right[4]["invalid_move"]
    assert plain[0] == "{'error': 'Tool jump not found.'}" and plain[4]["invalid_move"]
    # The done flag ends the episode, get_reward() is the last step's reward.
    assert play(env, ["move(direction='right')"])[0][1:4] == (10.0, True, False)
    assert env.step("move(direction='right')")[2] and env._steps == 4  # (a finished episode takes no call)
    # max_steps truncates, get_reward() scored there; an answer without a tool call ends the episode.
    env.reset(ROWS[1])
    assert [r[1:4] for r in play(env, ["move(direction='right')"] * 2 + ["move(direction='left')"] * 2)][-1] == \
        (0.0, False, True)
    env.reset(ROWS[1])
    assert env.step("The goal is too far.")[:4] == ("", 0.0, True, False)
    assert env.step(None)[0] == ""  # an output that did not parse: nothing sent


class Counter:
    """Async tools and reward, a step reward, and no done member: only an answer without a call ends it."""

    def reset(self, **row) -> None:
        self.count = 0

    async def add(self, amount: int) -> str:
        """Add to the count.

        Args:
            amount: how much.
        """
        self.count += amount
        return f"count {self.count}"

    @property
    def step_reward(self) -> float:
        return 0.5

    async def get_reward(self) -> float:
        return float(self.count)


def test_async_tools_step_rewards_and_an_answer_ending_the_episode():
    env = make_env("trl", environment_factory=Counter, done=None, max_steps=5)
    assert env.reset({"prompt": "Count to 4."})[0] == ""  # (reset returned None: no first observation)
    assert env.step("add(amount='3')")[:4] == ("count 3", 0.5, False, False)  # "3" typed as the schema's integer

    async def in_a_running_loop():  # as in a notebook, where asyncio.run cannot nest
        return env.step("add(amount=1)")

    assert asyncio.run(in_a_running_loop())[:4] == ("count 4", 0.5, False, False)
    assert env.step("Four.")[:4] == ("", 4.0, True, False)  # get_reward() at the end, awaited


def test_a_dict_of_classes_routes_rows_by_their_environment_column():
    env = TRLEnv({"plain": Corridor, "keyed": KeyedCorridor})
    _, info = env.reset({"environment": "keyed", **ROWS[0]})
    assert info["anchor"] == "cell 0" and "environment" not in RESETS[-1]
    assert env.reset({"environment": "plain", **ROWS[0]})[1]["anchor"] != "cell 0"
    with pytest.raises(ValueError, match="the row's environment 'other' is none of environment_factory's"):
        env.reset({"environment": "other", **ROWS[0]})


@pytest.mark.parametrize(("options", "message"), [
    ({"environment_factory": Undescribed},
     r"^environment_factory Undescribed: tool 'jump' cannot be described \(.*\); give it type hints"),
    ({"environment_factory": "tests.nowhere:Corridor"},
     r"^environment_factory: cannot import 'tests.nowhere:Corridor' \(write it as module:Class\)"),
    ({}, r"^environment 'trl' needs env_kwargs environment_factory"),
    ({"environment_factory": Corridor, "tool_format": "xml"}, r"^tool_format must be one of"),
])
def test_bad_classes_are_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        make_env("trl", **options)
    assert "\n" not in str(error.value)


def test_an_unseeded_reset_is_said_once():
    env = make_env("trl", environment_factory=Unseeded)
    with pytest.warns(UserWarning, match="two resets of one task row started differently .* seed reset from a column"):
        env.reset(ROWS[0])
        env.reset(ROWS[0])


@pytest.mark.parametrize(("factory", "anchors"), [(Corridor, 6), (KeyedCorridor, 2)])
def test_gigpo_and_hgpo_groups_form_on_a_trl_class(factory, anchors):
    """The worked example of docs/byo_env.md: 4 scripted rollouts of one task. Steps in one state share its anchor:
    by default the reset text and the calls so far (one path), with a state_key the cell (any path to it)."""
    paths = [["right", "right"], ["right", "right"], ["right", "left", "right", "right"], ["left", "right", "right"]]
    live = [0, 1, 2, 3]

    def scripted(prompts, infos):
        return [Completion(f"<think> </think>move(direction='{paths[i][info['step']]}')")
                for i, info in zip(live, infos, strict=True)]

    envs = make_env_batch(lambda: TRLEnv(factory), 4, 0)
    rollout = run_rollout(envs, ROWS[:1], 4, scripted, RolloutSettings(action_mode="tool", max_steps=6),
                          scripted=True, on_episode_end=lambda episode: live.remove(episode.traj))
    envs.close()
    assert [e.won for e in rollout.episodes] == [True] * 4 and [e.steps for e in rollout.episodes] == [2, 2, 4, 3]
    batch = rollout.step_batch()
    assert len(set(batch.obs)) == anchors and len(set(batch.obs[:4])) == 1  # (the rows come turn by turn)
    assert [r.valid for r in rollout.steps if r.traj == 3] == [False, True, True]  # the wall: an invalid move
    for estimator in ("gigpo", "hgpo"):
        assert np.all(np.isfinite(compute_advantages(estimator, batch)))
    assert rollout.steps[0].prompt.startswith("Reach the goal.\nTools:\n- move(direction: left | right): Move one")


# A template that shows tools but writes a call as `CALL name key=value`, no JSON: TRL accepts it for tool calling.
OTHER_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
                  "CALL {{ c['function']['name'] }}{% for k, v in c['function']['arguments'].items() %} {{ k }}={{ v }}"
                  "{% endfor %}{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")


@needs_qwen
def test_auto_asks_for_json_calls_only_where_the_template_writes_them():
    from trl.chat_template_utils import supports_tool_calling

    from hgpo_trl.envs.trl_calls import writes_json_calls
    from hgpo_trl.models.tiny import build_tiny_tokenizer

    qwen25, qwen3 = (AutoTokenizer.from_pretrained(QWEN25.parent / name) for name in ("qwen2.5-tokenizer",
                                                                                      "qwen3-tokenizer"))
    plain, other = build_tiny_tokenizer(["x"]), build_tiny_tokenizer(["x"])
    other.chat_template = OTHER_TEMPLATE
    assert supports_tool_calling(other) and not supports_tool_calling(plain)
    assert [writes_json_calls(t) for t in (qwen25, qwen3, plain, other)] == [True, True, False, False]


@needs_qwen
def test_a_trl_class_trains_with_the_qwen25_chat_template(tmp_path):
    """HGPOTrainer(environment_factory=...) as GRPOTrainer takes it: the tools in Qwen2.5's own system prompt,
    two iterations of HGPO on the tiny model."""
    model, tokenizer = make_tiny("trl", tokenizer=QWEN25, hidden_size=16, num_layers=1, num_heads=2)
    args = HGPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                      tasks_per_device=1, max_completion_length=6, max_env_steps=2, action_mode="tool",
                      estimator="hgpo", learning_rate=1e-2, train_iterations=2, logging_steps=1, report_to="none",
                      use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(ROWS),
                          environment_factory=Corridor)
    assert trainer.env_factory.keywords["tool_format"] == "json"
    assert [t["function"]["name"] for t in trainer.chat_template_kwargs["tools"]] == ["move"]
    prompt = tokenizer.decode(encode_prompt(tokenizer, "Reach the goal.", trainer.chat_template_kwargs))
    assert '<tools>\n{"type": "function", "function": {"name": "move"' in prompt and "<tool_call>" in prompt
    trainer.train()
    logged = [h for h in trainer.state.log_history if "env/success_rate" in h]
    assert len(logged) == 2 and all(np.isfinite(h["loss"]) for h in logged)


@needs_qwen
def test_trl_reads_the_class_as_the_adapter_does(tmp_path, monkeypatch):
    """The same class through TRL's own GRPOTrainer: the same tools, the same tool schemas in the chat template,
    the same reset arguments, and TRL's parser reads the adapter's json call as the adapter does."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import parse_response

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # (environment_factory is experimental in TRL 1.16)
    model, tokenizer = make_tiny("trl", tokenizer=QWEN25, hidden_size=16, num_layers=1, num_heads=2)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, report_to="none", use_cpu=True, save_strategy="no",
                      disable_tqdm=True, max_steps=1)
    trl_trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(ROWS), environment_factory=Corridor)
    trainer_args = HGPOConfig(output_dir=str(tmp_path / "hgpo"), per_device_train_batch_size=2, num_generations=2,
                              tasks_per_device=1, max_completion_length=4, action_mode="tool", report_to="none",
                              use_cpu=True, save_strategy="no", disable_tqdm=True, train_iterations=1)
    ours = HGPOTrainer(model=model, args=trainer_args, processing_class=tokenizer,
                       train_dataset=Dataset.from_list(ROWS), environment_factory=Corridor)
    env = ours.env_factory()
    assert [t.__name__ for t in trl_trainer._env_tools[None]] == [s["function"]["name"] for s in env.schemas[None]]
    assert trl_trainer.reward_func_names == ["Corridor"]  # get_reward: TRL's reward, our last step's
    messages = [{"role": "user", "content": "Reach the goal."}]
    assert tokenizer.apply_chat_template(messages, tools=trl_trainer._env_tools[None], tokenize=False,
                                         add_generation_prompt=True) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **ours.chat_template_kwargs)
    RESETS.clear()
    trl_trainer._generate_and_score_completions(ROWS)  # TRL's rollouts: each resets the class with its row
    trl_resets = [dict(r) for r in RESETS]
    RESETS.clear()
    for row in ROWS:
        env.reset(row)
    assert trl_resets == RESETS and len(RESETS) == 2 and RESETS[0]["prompt"] == ROWS[0]["prompt"]
    call = written_call("move", {"direction": "right"}, "json")
    parser = trl_trainer.processing_class  # (TRL gave it Qwen2.5's response schema)
    prompt_ids = parser.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    parsed = parse_response(parser, parser(call + "<|im_end|>", add_special_tokens=False)["input_ids"], prompt_ids)
    function = parsed["tool_calls"][0]["function"]
    assert (function["name"], function["arguments"]) == read_call(call, "json")


def test_train_py_builds_the_tiny_model_for_a_trl_class_and_trains(tmp_path):
    """The quickstart's CPU path for a TRL class named in YAML: `model_name_or_path: tiny` builds its word-level
    vocabulary from the tools' schema, the reset texts and the tool results; a short warm start, one iteration."""
    from hgpo_trl.commands.train import main

    rows = {split: [{"prompt": "Reach the goal.", "goal": goal} for goal in goals]
            for split, goals in (("train", [2, 3]), ("valid", [1]))}
    config = tmp_path / "c.yaml"
    config.write_text(f"""model_name_or_path: tiny
output_dir: {tmp_path}/out
report_to: none
use_cpu: true
env_name: trl
env_kwargs: {{environment_factory: "tests.test_trl_env:Corridor"}}
task_kwargs: {{rows: {json.dumps(rows)}}}
action_mode: tool
estimator: gigpo
tiny_hidden_size: 32
tiny_num_layers: 1
tiny_num_heads: 2
warmstart_steps: 2
warmstart_batch_size: 8
tasks_per_device: 2
num_generations: 2
per_device_train_batch_size: 8
max_completion_length: 12
max_env_steps: 4
train_iterations: 1
logging_steps: 1
disable_tqdm: true
plots: false
save_strategy: "no"
""")
    main(["--config", str(config)])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["iterations"] == 1 and summary["config"]["trainer"]["env_name"] == "trl"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert {"move", "direction", "left", "right", "goal", "cell", "wall", "error"} <= set(tokenizer.get_vocab())
    # Every word of a prompt is known: the tool mode's instruction included.
    assert tokenizer.unk_token_id not in tokenizer(FORMAT_INSTRUCTIONS["tool"])["input_ids"]


@needs_qwen
def test_hgpo_eval_plays_a_trl_class_in_the_format_the_model_trained_with(tmp_path):
    """hgpo-eval takes the tool format and tools from the model's chat template as the trainer does: json for
    Qwen2.5 (before, it played the call format, whose prompts list the tools, to a model trained on json)."""
    from hgpo_trl.commands.evaluate import main as hgpo_eval

    config = tmp_path / "eval.yaml"
    config.write_text(f"""model_name_or_path: tiny
tiny_tokenizer: {QWEN25}
tiny_hidden_size: 16
tiny_num_layers: 1
tiny_num_heads: 2
output_dir: {tmp_path}/run
report_to: none
use_cpu: true
disable_tqdm: true
env_name: trl
env_kwargs: {{environment_factory: "tests.test_trl_env:Corridor"}}
task_kwargs: {{rows: {json.dumps({split: [{"prompt": "Reach the goal.", "goal": 2}] for split in ("train", "valid")})}}}
action_mode: tool
max_env_steps: 2
max_completion_length: 4
trajectory_dump_every: 1
""")
    hgpo_eval(["--config", str(config), "--eval_output_dir", str(tmp_path / "eval"), "--seeds", "1"])
    [dump] = (tmp_path / "eval" / "trajectories").glob("model_valid_seed1.jsonl")
    prompts = [json.loads(line)["prompt"] for line in dump.read_text().splitlines() if '"prompt"' in line]
    assert prompts and all(p.startswith("Reach the goal.\n\nStep 0.") for p in prompts[:1])
    assert not any("Tools:" in p for p in prompts)  # json: the chat template shows the tools, not the prompt
