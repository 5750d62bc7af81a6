"""The lock-step rollout with scripted policies (no model): prompts, memory, invalid outputs, records."""

from functools import partial

import numpy as np
import pytest

from hgpo_trl.advantages import compute_advantages
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.keydoor import KeyDoorTask
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout


def optimal_action(prompt: str) -> str:
    """Read the keydoor prompt like an expert: take the gold key, walk, open the door of the key held."""
    task = prompt.split("It is behind the ")[1].split(" door")[0]
    now = prompt.split("Now: ")[1].split("\n")[0]
    if now.startswith("You are in the entrance"):
        return f"take {task} key"
    if "You take the" in now:
        return "go to hall"
    if now.startswith("You are in the hall"):
        return "go to vault"
    held = prompt.split("You take the ")[1].split(" key")[0]
    return f"open {held} door"


def scripted(choose):
    calls = []

    def policy(prompts):
        calls.append(list(prompts))
        return [Completion(text=choose(p)) for p in prompts]

    policy.calls = calls
    return policy


def play(policy, group_size=3, num_tasks=2, **settings):
    tasks = list(make_tasks("keydoor", "train", num_tasks=num_tasks))
    envs = InProcessEnvs(partial(make_env, "keydoor"), num_tasks * group_size)
    settings = RolloutSettings(**{"action_mode": "plain", "max_steps": 6, **settings})
    return run_rollout(envs, tasks, group_size, policy, settings)


def test_optimal_policy_wins_every_episode_in_four_steps():
    rollout = play(scripted(optimal_action))
    assert all(e.won and e.steps == 4 and e.total_reward == 10.0 and e.terminated for e in rollout.episodes)
    assert len(rollout.steps) == 6 * 4 and rollout.turns == 4
    assert [r.step for r in rollout.steps if r.traj == 0] == [0, 1, 2, 3]
    # The key and the door are choices of two; the walks to the hall and the vault are forced.
    assert [r.forced for r in rollout.steps if r.traj == 0] == [False, True, True, False]
    assert {r.group for r in rollout.steps} == {0, 1} and {r.traj for r in rollout.steps} == set(range(6))


def test_an_invalid_output_on_a_forced_step_is_no_forced_step():
    # At the hall ('go to vault' alone listed) the first answer is nonsense: that choice is trained (its penalty).
    halls = []

    def choose(prompt):
        if prompt.split("Now: ")[1].startswith("You are in the hall"):
            halls.append(prompt)
            if len(halls) == 1:
                return "dance"
        return optimal_action(prompt)

    rollout = play(scripted(choose), group_size=2, num_tasks=4, invalid_action="noop", max_steps=5, history_length=3,
                   admissible_only=True)
    invalid = [r for r in rollout.steps if not r.valid]
    assert invalid and not any(r.forced for r in invalid)
    assert all(r.forced for r in rollout.steps if r.valid and r.action in ("go to hall", "go to vault"))


def test_one_policy_call_per_turn_for_all_live_environments():
    policy = scripted(optimal_action)
    play(policy, group_size=4, num_tasks=2)
    assert [len(c) for c in policy.calls] == [8, 8, 8, 8]


def test_prompts_show_the_last_h_pairs_and_only_parsed_actions():
    policy = scripted(lambda p: "<think>long reasoning</think><action>" + optimal_action(p) + "</action>")
    rollout = play(policy, group_size=1, num_tasks=1, action_mode="tags", history_length=2)
    last = rollout.steps[-1]
    assert last.shown_history == 2 and rollout.steps[0].shown_history == 0
    assert "go to hall" in last.prompt and "go to vault" in last.prompt
    assert "reasoning" not in last.prompt  # memory keeps the action, never the reasoning
    assert last.prompt.count("\n> ") == 2  # two remembered observations
    assert "<action>" in last.prompt  # the format instruction of tags mode


def test_invalid_output_is_a_noop_penalised_and_counted():
    outputs = iter(["", *(["go to hall"] * 100)])  # the first output is empty: invalid
    rollout = play(scripted(lambda p: next(outputs)), group_size=1, num_tasks=1, max_steps=3)
    first, second = rollout.steps[0], rollout.steps[1]
    assert not first.valid and first.action is None and first.reward == 0.0
    assert second.observation == "Nothing happens." and "Actions: take " in second.prompt  # the env did nothing
    assert rollout.episodes[0].invalid == 1 and rollout.episodes[0].truncated
    batch = rollout.step_batch()
    assert batch.valid.tolist() == [False, True, True]
    returns_penalised = compute_advantages("grpo", batch, norm="mean_norm")  # a single trajectory: all zero
    assert np.all(returns_penalised == 0.0)


def test_invalid_output_can_end_the_episode():
    rollout = play(scripted(lambda p: "<think>"), group_size=2, num_tasks=1, invalid_action="end_episode")
    assert all(e.steps == 1 and e.invalid == 1 and e.terminated and not e.won for e in rollout.episodes)


def test_invalid_output_memory_shows_its_tail():
    outputs = iter(["I think I should open the red door maybe", "go to kitchen", "go to hall"])
    rollout = play(scripted(lambda p: next(outputs)), group_size=1, num_tasks=1, max_steps=2,
                   action_mode="tags")
    assert "open the red door maybe" in rollout.steps[1].prompt


def test_execute_sends_penalised_actions_and_the_tail_of_an_output_without_one():
    """invalid_action="execute" (as released): an action without <think> is carried out and penalised; an output
    with no action block sends its last characters, which the memory shows as the action taken."""
    def answers():
        outputs = iter(["<action>TAKE {} KEY</action>", "I Will Go To The Hall, Then Open The Door",
                        "<think>x</think><action>go to hall</action>"])
        return lambda prompt: next(outputs).format(prompt.split("It is behind the ")[1].split(" door")[0])

    executed = play(scripted(answers()), group_size=1, num_tasks=1, max_steps=3, action_mode="tags",
                    invalid_action="execute")
    take, tail, walk = executed.steps
    assert (take.action, take.valid, take.malformed) == (optimal_action(take.prompt), False, True)
    assert f"You take the {take.action.removeprefix('take ')}." in tail.observation  # carried out
    assert (tail.action, tail.valid) == ("o the hall, then open the door", False)
    assert (walk.action, walk.valid) == ("go to hall", True)
    assert f"< {take.action}\n" in walk.prompt and f"< {tail.action}\n" in walk.prompt
    assert executed.episodes[0].invalid == 2 and executed.step_batch().valid.tolist() == [False, False, True]
    skipped = play(scripted(answers()), group_size=1, num_tasks=1, max_steps=3, action_mode="tags")
    assert skipped.steps[0].action is None and skipped.steps[1].observation == "Nothing happens."
    with pytest.raises(ValueError, match="needs action_mode 'tags'"):
        RolloutSettings(invalid_action="execute", action_mode="plain")


def test_step_batch_feeds_the_estimators():
    rollout = play(scripted(optimal_action), group_size=4)
    batch = rollout.step_batch()
    assert len(batch) == len(rollout.steps)
    adv = compute_advantages("hgpo", batch)
    assert adv.shape == (len(batch),) and np.all(adv == 0.0)  # every rollout identical: nothing to prefer


def test_lockstep_keeps_calling_the_policy_while_any_process_is_live():
    policy = scripted(optimal_action)
    turns = []
    tasks = list(make_tasks("keydoor", "train", num_tasks=1))
    run_rollout(InProcessEnvs(partial(make_env, "keydoor"), 1), tasks, 1, policy, RolloutSettings(action_mode="plain"),
                keep_going=lambda live: (turns.append(live) or len(turns) <= 6))
    assert turns[:5] == [1, 1, 1, 1, 0] and [len(c) for c in policy.calls] == [1, 1, 1, 1, 0, 0]


def test_mismatched_environments_and_settings_are_refused():
    tasks = list(make_tasks("keydoor", "train", num_tasks=2))
    with pytest.raises(ValueError, match="need 4 environments for 2 tasks x 2 rollouts, got 3"):
        run_rollout(InProcessEnvs(partial(make_env, "keydoor"), 3), tasks, 2, scripted(optimal_action),
                    RolloutSettings())
    with pytest.raises(ValueError, match="invalid_action must be one of"):
        RolloutSettings(invalid_action="retry")


def test_aliased_vault_mixes_contexts_that_hgpo_separates():
    # Half the rollouts take the wrong key: the vault observation is shared, its value is not.
    task = KeyDoorTask("library", "kitchen", "red", "blue", "red")
    row = {"room1": "library", "room2": "kitchen", "color1": "red", "color2": "blue", "gold": "red"}
    count = iter(range(10_000))

    def half_wrong(prompt):
        action = optimal_action(prompt)
        if action.startswith("take "):
            return "take blue key" if next(count) % 2 else "take red key"
        return action

    envs = InProcessEnvs(partial(make_env, "keydoor"), 4)
    rollout = run_rollout(envs, [row], 4, scripted(half_wrong), RolloutSettings(action_mode="plain"))
    vault = [r for r in rollout.steps if r.step == 3]
    assert len({r.observation for r in vault}) == 1 and sorted(r.reward for r in vault) == [3.0, 3.0, 10.0, 10.0]
    batch = rollout.step_batch()
    gigpo_step = compute_advantages("gigpo", batch, norm="mean_norm") - compute_advantages("grpo", batch, norm="mean_norm")
    hgpo = compute_advantages("hgpo", batch, norm="mean_norm", depth=2, alpha=1e3)
    vault_rows = [i for i, r in enumerate(rollout.steps) if r.step == 3]
    # GiGPO's anchor group at the vault mixes 10 and 3 (+-3.5); HGPO's level-2 groups are consistent (0).
    assert np.allclose(np.abs(gigpo_step[vault_rows]), 3.5) and np.allclose(hgpo[vault_rows], 0.0, atol=1e-9)
    assert task.gold == "red"
