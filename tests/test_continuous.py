"""The continuous rollout against the lock-step one: scripted policies on keydoor give the same records, episodes,
faults and progress calls, whatever the completions' lengths and the environments' latencies."""

import functools
import importlib.util
import os
import signal
import time
import zlib

import pytest

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.keydoor import KeyDoorEnv
from hgpo_trl.envs.pool import InProcessEnvs, WorkerPoolEnvs
from hgpo_trl.rollout.continuous import PolicyStream, run_continuous
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout
from tests.test_pool import FaultyEnv, faulty_tasks
from tests.test_rollout import optimal_action, scripted

pytestmark = pytest.mark.timeout(120)


def mixed_answer(prompt: str) -> str:
    """Deterministic in the prompt: mostly the expert's action in tags, sometimes a wrong key, an output without
    tags (invalid) or an inadmissible action, so that episodes differ in length and end in every way."""
    try:
        action = optimal_action(prompt)
    except IndexError:  # the window no longer shows the task or the key taken
        action = "go to hall"
    draw = zlib.crc32(prompt.encode()) % 7
    if draw == 0:
        return "I would rather not say"
    if draw == 1 and action.startswith("take "):
        action = "take " + ("blue" if "red" in action else "red") + " key"
    if draw == 2:
        action = "dance"
    return f"<think>t</think><action>{action}</action>"


class TimedStream:
    """A scripted stream whose requests take uneven numbers of engine steps (1 to 4, from the episode and step),
    as completions of uneven lengths do; it logs the (episode, step) order in which requests were submitted."""

    def __init__(self, answer):
        self.answer, self.waiting, self.submitted = answer, {}, []

    def submit(self, key, prompt, step):
        self.waiting[key] = [prompt, 1 + zlib.crc32(f"{key}/{step}".encode()) % 4]
        self.submitted.append((key, step))

    def finished(self):
        for request in self.waiting.values():
            request[1] -= 1
        done = [(key, Completion(self.answer(prompt))) for key, (prompt, left) in self.waiting.items() if left == 0]
        for key, _ in done:
            del self.waiting[key]
        return done


class SlowKeyDoor(KeyDoorEnv):
    """Keydoor whose steps take 0 to 30 ms, drawn from the step's state (ALFWorld's steps vary so)."""

    def step(self, action):
        time.sleep(zlib.crc32(f"{self._steps}{action}".encode()) % 4 * 0.01)
        return super().step(action)


def both(envs_factory, tasks, group_size, stream, policy, **settings):
    """(lock-step, continuous) rollouts of the same tasks, each with its calls to on_turn and on_episode_end."""
    settings = RolloutSettings(**{"action_mode": "tags", "max_steps": 5, **settings})
    played = []
    for run in ("lockstep", "continuous"):
        turns, ends = [], []
        options = {"on_turn": lambda t, live, turns=turns: turns.append((t, live)),
                   "on_episode_end": lambda e, ends=ends: ends.append(e.traj)}
        with envs_factory() as envs:
            if run == "lockstep":
                rollout = run_rollout(envs, tasks, group_size, policy, settings, **options)
            else:
                rollout = run_continuous(envs, tasks, group_size, stream, settings, **options)
        played.append((rollout, turns, sorted(ends)))
    return played


class SleepyKeyDoor(KeyDoorEnv):
    """Keydoor whose steps take 0.3 s: an answer is still in its worker's pipe while the engine steps on."""

    def step(self, action):
        time.sleep(0.3)
        return super().step(action)


class CtrlCStream(PolicyStream):
    """Completes one episode's request per engine step, in key order, and is interrupted by a Ctrl-C (a real SIGINT
    to this process) at its engine step `at`."""

    def __init__(self, policy, at: int):
        super().__init__(policy)
        self.at, self.steps = at, 0

    def finished(self):
        self.steps += 1
        if self.steps == self.at:
            signal.raise_signal(signal.SIGINT)
        first = min(self._waiting)
        return list(zip([first], self.policy([self._waiting.pop(first)]), strict=True))


def test_a_rollout_interrupted_with_steps_in_flight_leaves_the_next_one_clean():
    """Ctrl-C while episode 0's step is in its worker and the engine generates episode 1's completion: the next
    rollout in the same pool plays from its own resets (the interrupted step's answer must not answer them)."""
    tasks, settings = list(make_tasks("keydoor", "train", num_tasks=2)), RolloutSettings(action_mode="plain", max_steps=5)
    policy = scripted(optimal_action)
    with WorkerPoolEnvs(SleepyKeyDoor, 2, num_workers=2) as envs:  # (one environment a worker: a reply of one)
        with pytest.raises(KeyboardInterrupt):
            run_continuous(envs, tasks, 1, CtrlCStream(policy, at=2), settings)
        again = run_continuous(envs, tasks, 1, PolicyStream(policy), settings)
        assert envs.faults == 0
    clean = run_rollout(InProcessEnvs(functools.partial(make_env, "keydoor"), 2), tasks, 1, policy, settings)
    assert again.steps == clean.steps and again.episodes == clean.episodes
    assert all(e.won for e in again.episodes)


class CtrlCKeyDoor(KeyDoorEnv):
    """Keydoor whose first step of a whole test (`flag`: a file made once) sends its trainer process a Ctrl-C (a real
    SIGINT) and then takes 1 s, so that the trainer is waiting on it."""

    def __init__(self, flag: str, **kwargs):
        super().__init__(**kwargs)
        self.flag = flag

    def step(self, action):
        try:
            os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return super().step(action)
        time.sleep(0.3)  # (the trainer waits on its environments by now)
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(1.0)
        return super().step(action)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lockstep", "continuous"])
def test_after_a_ctrl_c_during_evaluate_the_trainer_s_environments_evaluate_again(tmp_path, tiny_tokenizer, mode):
    """A notebook's Ctrl-C while evaluate() waits on the environment workers, then evaluate() again: the same
    trainer evaluates as on fresh workers (neither a closed pool nor the interrupted steps' answers)."""
    from hgpo_trl.models.tiny import build_tiny_model
    from tests.test_trainer import make_config, make_trainer

    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    args = make_config(tmp_path, rollout_mode=mode, env_workers=2, eval_temperature=0.0, action_mode="tags",
                       invalid_action="execute")  # (every turn steps the environment, whatever the model writes)
    trainer = make_trainer(model, tiny_tokenizer, args,
                           env_factory=functools.partial(CtrlCKeyDoor, str(tmp_path / "signalled")))
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.evaluate()
        assert (tmp_path / "signalled").exists()
        again = trainer.evaluate()
        trainer.close_environments()
        fresh = trainer.evaluate()
    finally:
        trainer.close_environments()
    keys = ("eval_success_rate", "eval_episode_reward", "eval_episode_length", "eval_faulted", "eval_tasks")
    assert {k: again[k] for k in keys} == {k: fresh[k] for k in keys} and again["eval_faulted"] == 0


@pytest.mark.parametrize("invalid_action", ["noop", "end_episode", "execute"])
def test_continuous_and_lockstep_give_the_same_records(invalid_action):
    tasks = list(make_tasks("keydoor", "train", num_tasks=8))
    (lockstep, turns, ends), (continuous, continuous_turns, continuous_ends) = both(
        lambda: InProcessEnvs(functools.partial(make_env, "keydoor"), 16), tasks, 2,
        PolicyStream(scripted(mixed_answer)), scripted(mixed_answer), invalid_action=invalid_action)
    assert continuous.steps == lockstep.steps and continuous.episodes == lockstep.episodes
    assert continuous.turns == lockstep.turns and continuous_ends == ends
    # As many progress calls; the live count is the one when the first episode starts the turn (lock-step's:
    # when all have played the one before).
    assert [t for t, _ in continuous_turns] == [t for t, _ in turns] and continuous_turns[0] == turns[0]
    episodes = lockstep.episodes  # the cases the records cover: every ending, invalid outputs, max_env_steps
    assert {e.won for e in episodes} == {True, False} and any(e.invalid for e in episodes)
    assert any(e.truncated for e in episodes) or invalid_action == "end_episode"


def test_uneven_completions_and_environment_latencies_keep_each_episode_in_order():
    tasks = list(make_tasks("keydoor", "train", num_tasks=8))
    stream = TimedStream(mixed_answer)
    (lockstep, _, _), (continuous, _, _) = both(
        lambda: WorkerPoolEnvs(SlowKeyDoor, 16, num_workers=2), tasks, 2, stream, scripted(mixed_answer))
    assert continuous.steps == lockstep.steps and continuous.episodes == lockstep.episodes
    for traj in range(16):  # each episode's steps 0, 1, ... in order, its prompts showing its own history
        steps = [r for r in continuous.steps if r.traj == traj]
        assert [r.step for r in steps] == list(range(len(steps)))
    # Played out of turn: some episode asked for its step t + 1 before another asked for its step t.
    order = {request: n for n, request in enumerate(stream.submitted)}
    assert any(order[(a, t + 1)] < order[(b, t)] for (a, t) in order for (b, s) in order if s == t and (a, t + 1) in order)


@pytest.mark.slow
def test_faults_and_a_hang_abort_the_same_episodes_as_in_lockstep():
    """Worker 0 (environments 0, 1) hangs and times out, environment 2 raises, 3 fails its reset, worker 2 (4, 5)
    dies: in both modes the same episodes fail with the same faults, and the others' steps are the same."""
    tasks = faulty_tasks(6, env0=("hang", 2), env2=("raise", 2), env3=("raise", 0), env4=("exit", 3))
    factory = functools.partial(WorkerPoolEnvs, FaultyEnv, 6, num_workers=3, step_timeout=1.0)
    (lockstep, _, _), (continuous, _, _) = both(factory, tasks, 1, PolicyStream(scripted(optimal_action)),
                                                 scripted(optimal_action), action_mode="plain")
    assert continuous.steps == lockstep.steps and continuous.episodes == lockstep.episodes
    faults = [e.fault for e in lockstep.episodes]
    assert faults[:4] == ["timed out after 1.0 s"] * 2 + ["RuntimeError: injected at step 2",
                                                          "RuntimeError: injected at step 0"]
    assert faults[4].startswith("worker died") and faults[5] == faults[4]


def test_rollout_mode_picks_continuous_where_the_backend_streams_and_refuses_it_where_it_cannot(monkeypatch):
    # (imported here: the worker processes above import this module, and need no training stack)
    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.config_checks import check_trainer_inputs

    monkeypatch.setattr("hgpo_trl.rollout.vllm_cpu.cpu_build", lambda: True)  # (the config's checks, not vLLM itself)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: name == "vllm" or find_spec(name, *args))
    config = functools.partial(HGPOConfig, output_dir="/tmp/unused", report_to="none", use_cpu=True)
    assert not config().plays_continuously(4) and config(rollout_mode="continuous").plays_continuously(0)
    # auto: where colocated vLLM streams and there is time to win back: environments in workers, or completions
    # longer than a few tokens; not the quickstart's (in process, 6 tokens), where lock-step was faster (issue 55)
    assert config(use_vllm=True).plays_continuously(0)  # (TRL's max_completion_length: 256)
    assert config(use_vllm=True, max_completion_length=6).plays_continuously(2)
    assert not config(use_vllm=True, max_completion_length=6).plays_continuously(0)
    assert not config(use_vllm=True, rollout_mode="lockstep").plays_continuously(2)
    assert not config(use_vllm=True, vllm_enable_sleep_mode=True).plays_continuously(2)
    with pytest.raises(ValueError) as err:
        config(use_vllm=True, vllm_enable_sleep_mode=True, rollout_mode="continuous")
    assert str(err.value).startswith("HGPOConfig.rollout_mode must be 'lockstep' or 'auto' with colocated vLLM's "
                                     "vllm_tensor_parallel_size > 1 or vllm_enable_sleep_mode")
    # A server takes each process's requests one by one (issue 57: refused before, when TRL's collective call was
    # its only client)
    assert config(use_vllm=True, vllm_mode="server", rollout_mode="continuous").plays_continuously(0)
    assert config(use_vllm=True, vllm_mode="server", max_completion_length=6).plays_continuously(2)
    with pytest.raises(ValueError, match=r"^HGPOConfig.rollout_mode must be one of \('auto', 'lockstep', 'continuous'"):
        config(rollout_mode="async")
    with pytest.raises(ValueError, match=r"^HGPOConfig.rollout_mode must be 'lockstep' or 'auto' .* ZeRO-3 or FSDP"):
        check_trainer_inputs(config(rollout_mode="continuous"), False, {"zero_optimization": {"stage": 3}}, fsdp=False)
    check_trainer_inputs(config(rollout_mode="continuous"), False, {"zero_optimization": {"stage": 2}}, fsdp=False)
    # FSDP as the trainer sees it (Trainer.is_fsdp_enabled): set through an accelerate config file it leaves
    # args.fsdp empty, which the check read. (On a CPU accelerate never enables FSDP: a launch can't show it here.)
    with pytest.raises(ValueError, match=r"^HGPOConfig.rollout_mode must be 'lockstep' or 'auto' .* ZeRO-3 or FSDP"):
        check_trainer_inputs(config(rollout_mode="continuous"), False, None, fsdp=True)
    check_trainer_inputs(config(rollout_mode="continuous"), False, None, fsdp=False)


def test_the_trainer_plays_continuously_with_transformers_and_trains_as_in_lockstep(tmp_path, tiny_tokenizer):
    """rollout_mode continuous through HGPOTrainer with transformers' generate (PolicyStream): with environments
    in process each generate call holds the live episodes in lock-step's order, so the same seed samples the same
    rollout and the iteration's metrics and updated weights are lock-step's."""
    import torch

    from hgpo_trl.models.tiny import build_tiny_model
    from tests.test_trainer import make_config, make_trainer

    played = {}
    for mode in ("lockstep", "continuous"):
        model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
        trainer = make_trainer(model, tiny_tokenizer, make_config(tmp_path / mode, rollout_mode=mode,
                                                                  train_iterations=1))
        assert trainer.args.plays_continuously(trainer._env_workers) == (mode == "continuous")
        trainer.train()
        (log,) = [h for h in trainer.state.log_history if "env/success_rate" in h]
        played[mode] = ({k: log[k] for k in ("env/success_rate", "env/episode_length", "steps/collected", "loss")},
                        [p.detach().clone() for p in model.parameters()])
    assert played["continuous"][0] == played["lockstep"][0] and played["lockstep"][0]["steps/collected"] > 8
    assert all(torch.equal(a, b) for a, b in zip(played["continuous"][1], played["lockstep"][1], strict=True))
