"""OpenEnv environments (envs/openenv_env.py, extra openenv): an Environment in this process, and the same one
served on 127.0.0.1 by OpenEnv's own server, played through the rollout; a server that is down or late is a step
fault in one line. Without the extra the adapter says which to install, in one line."""

import os
import random
import subprocess
import sys
import time
import urllib.request
from importlib.util import find_spec

import pytest

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.base import MissingExtraError
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout

needs_openenv = pytest.mark.skipif(find_spec("openenv") is None, reason="needs the openenv extra (openenv-core)")

if find_spec("openenv") is not None:
    from openenv.core import Action, Environment, Observation, State

    class GuessAction(Action):
        guess: str

    class GuessObservation(Observation):
        log: str  # the whole game so far, as OpenEnv's TextArena server writes it

    class Guess(Environment[GuessAction, GuessObservation, State]):
        """Guess a number from 1 to 8, told higher or lower: seeded by reset, its bounds the state."""

        SUPPORTS_CONCURRENT_SESSIONS = True  # (a server then keeps one per rollout, up to max_concurrent_envs)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.target, self.low, self.high = random.Random(seed).randint(1, 8), 1, 8
            self.steps, self.log = 0, "Guess a number from 1 to 8."
            return GuessObservation(log=self.log)

        def step(self, action, timeout_s=None, **kwargs):
            if action.guess == "wait":
                time.sleep(3)  # a server that answers late
            self.steps += 1
            guess = int(action.guess) if action.guess.isdigit() else 0
            hit = guess == self.target
            if not hit and 1 <= guess <= 8:
                self.low, self.high = (max(self.low, guess + 1), self.high) if guess < self.target else \
                    (self.low, min(self.high, guess - 1))
            self.log += f" {guess}: {'right' if hit else 'higher' if guess < self.target else 'lower'}."
            return GuessObservation(log=self.log, done=hit, reward=1.0 if hit else 0.0)

        @property
        def state(self):
            return State(step_count=self.steps, low=self.low, high=self.high)


def bisect(prompts, infos):
    """A scripted player: the middle of the bounds the observation so far implies (read from the state key)."""
    import json

    out = []
    for info in infos:
        bounds = json.loads(info["anchor"])
        out.append(Completion(str((bounds["low"] + bounds["high"]) // 2)))
    return out


def play(env_kwargs, seeds=(0, 1)):
    envs = make_env_batch(lambda: make_env("openenv", **env_kwargs), 2 * len(seeds), 0)
    try:
        return run_rollout(envs, make_tasks("openenv", "train", seeds=list(seeds)), 2, bisect,
                           RolloutSettings(action_mode="plain", max_steps=5), scripted=True)
    finally:
        envs.close()


def test_without_the_extra_the_adapter_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)  # (an import of it fails, as when it is not installed)
    with pytest.raises(MissingExtraError, match=r"^OpenEnv environments need the openenv extra"):
        make_env("openenv", environment="tests.test_openenv:Guess")
    with pytest.raises(ValueError, match="^openenv needs env_kwargs environment .* or base_url"):
        make_env("openenv")


@needs_openenv
def test_an_openenv_environment_plays_in_process():
    rollout = play({"environment": Guess, "cumulative": True, "task": "Find the number."})
    assert all(e.won and e.terminated for e in rollout.episodes) and rollout.episodes[0].steps <= 3
    first, second = rollout.steps[0], rollout.steps[4]  # the rows come turn by turn
    assert first.observation == "Guess a number from 1 to 8." and first.anchor == '{"high": 8, "low": 1}'
    assert second.observation in ("4: higher.", "4: lower.")  # only the new part of the cumulative log
    assert rollout.steps[0].prompt.startswith("Find the number.") and len({s.anchor for s in rollout.steps[:2]}) == 1
    with pytest.raises(ValueError, match="^openenv: give action_field"):
        make_env("openenv", environment=Guess, action_field=None, to_action=None, action_class=Action)


@pytest.fixture
def server(free_port):
    """OpenEnv's own server of Guess on 127.0.0.1, started and stopped by the test."""
    code = ("import uvicorn; from openenv.core import create_fastapi_app; "
            "from tests.test_openenv import Guess, GuessAction, GuessObservation; "
            f"uvicorn.run(create_fastapi_app(Guess, GuessAction, GuessObservation, max_concurrent_envs=4), "
            f"host='127.0.0.1', "
            f"port={free_port}, log_level='warning')")
    process = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                               cwd=os.path.dirname(os.path.dirname(__file__)))
    url = f"http://127.0.0.1:{free_port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                assert process.poll() is None, "the server stopped"
                time.sleep(0.2)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=30)


@needs_openenv
@pytest.mark.slow
def test_an_openenv_server_plays_and_a_late_or_dead_one_is_a_fault(server):
    url, process = server
    rollout = play({"base_url": url, "action_field": "guess", "cumulative": True})
    assert [e.fault for e in rollout.episodes] == [None] * 4 and all(e.won for e in rollout.episodes)
    assert rollout.steps[0].anchor == '{"high": 8, "low": 1}' and rollout.steps[4].observation.endswith("er.")
    env = make_env("openenv", base_url=url, action_field="guess", timeout=1.0)
    env.reset({"seed": 0})
    with pytest.raises(RuntimeError, match=rf"^the OpenEnv server at {url} did not answer step \(") as late:
        env.step("wait")
    env.close()
    process.terminate()
    process.wait(timeout=30)
    envs = make_env_batch(lambda: make_env("openenv", base_url=url, action_field="guess", timeout=2.0), 1, 0)
    fault = envs.reset([{"seed": 0}])[0].fault
    envs.close()
    assert fault.startswith(f"RuntimeError: the OpenEnv server at {url} did not answer") and "\n" not in fault
    assert "\n" not in str(late.value)
