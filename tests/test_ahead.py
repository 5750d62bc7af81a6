"""Generation beside training (issue 57), the thread and its bound (hgpo_trl/rollout/ahead.py), with a scripted
play in place of a server: an iteration starts only once the weights are recent enough, nothing is dropped or
reordered, the thread's failure reaches the trainer, and a stop ends a rollout in flight. The trainer with a real
vLLM server: tests/test_vllm_cpu.py."""

import threading
import time

import pytest

from hgpo_trl.rollout.ahead import RolloutsAhead, RolloutsStopped


class Trainer:
    """A trainer's side, scripted: it takes iteration k's rollout, then 'trains' it (optimizer step k + 1) and
    pushes those weights, as HGPOTrainer does with one optimizer step an iteration."""

    def __init__(self, max_staleness: int, iterations: int, play=None):
        self.started: dict[int, int] = {}  # iteration -> the weights' step when its rollout started
        self.max_staleness, self.iterations = max_staleness, iterations
        self.ahead = RolloutsAhead(play or self.play, first=0, last=iterations, max_staleness=max_staleness)

    def play(self, iteration: int) -> str:
        self.started[iteration] = self.ahead.version()
        return f"rollout {iteration}"

    def run(self, iterations: int) -> list[str]:
        self.ahead.pushed(0)
        self.ahead.start()
        taken = []
        for k in range(iterations):
            taken.append(self.ahead.take(k))
            # Training is slow: before its weights are pushed, the thread has started every iteration it may.
            ahead_as_far_as_allowed = min(k + 1 + self.max_staleness, self.iterations)
            while len(self.started) < ahead_as_far_as_allowed:
                time.sleep(0.005)
            self.ahead.pushed(k + 1)
        self.ahead.stop()
        return taken


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_each_iteration_starts_only_with_weights_at_most_max_staleness_steps_older_than_its_update(max_staleness):
    trainer = Trainer(max_staleness, iterations=8)
    assert trainer.run(8) == [f"rollout {k}" for k in range(8)]  # every iteration, in order, none dropped
    # Iteration k is trained at optimizer step k (its update moves the weights from k to k + 1).
    staleness = {k: k - version for k, version in trainer.started.items()}
    assert staleness == {k: min(k, max_staleness) for k in range(8)}  # all the room it has, no more
    if max_staleness == 0:  # the synchronous schedule: each iteration with the weights that train it
        assert trainer.started == {k: k for k in range(8)}


def test_the_thread_waits_for_the_bound_instead_of_playing_ahead():
    trainer = Trainer(max_staleness=1, iterations=5)
    trainer.ahead.pushed(0)
    trainer.ahead.start()
    time.sleep(0.3)
    assert sorted(trainer.started) == [0, 1] and trainer.ahead.admission_seconds > 0.0  # 2 needs step 1's weights
    trainer.ahead.stop()


def test_a_failed_rollout_reaches_the_trainer_and_a_stop_ends_one_in_flight():
    def failing(iteration):
        raise ConnectionError("the vLLM server at http://127.0.0.1:1 did not answer")

    trainer = Trainer(max_staleness=1, iterations=3, play=failing)
    trainer.ahead.pushed(0)
    trainer.ahead.start()
    with pytest.raises(ConnectionError, match="did not answer"):
        trainer.ahead.take(0)
    trainer.ahead.stop()

    entered, closed = threading.Event(), []

    def endless(iteration):  # a rollout that waits on its server until the stop is seen (as ServerStream does)
        entered.set()
        while not ahead.stopping:
            time.sleep(0.01)
        raise RolloutsStopped("stopped")

    ahead = RolloutsAhead(endless, first=0, last=3, max_staleness=1, on_stop=lambda: closed.append(True))
    ahead.pushed(0)
    ahead.start()
    assert entered.wait(5)
    ahead.stop()
    assert not ahead._thread.is_alive() and closed == [True]


def test_a_failed_weight_push_is_raised_by_the_next_take_even_where_that_rollout_is_ready():
    """The trainer's push to a server that is gone (`push_weights` hands its line to `push_failed`): the next take
    raises it, the first failure kept, even where the thread had played that iteration (training it would push to
    the same server again)."""
    trainer = Trainer(max_staleness=1, iterations=4)
    trainer.ahead.pushed(0)
    trainer.ahead.start()
    assert trainer.ahead.take(0) == "rollout 0"
    while 1 not in trainer.ahead._ready:  # (iteration 1 plays with step 0's weights; 2 waits for step 1's)
        time.sleep(0.005)
    trainer.ahead.push_failed(RuntimeError("the vLLM server at http://127.0.0.1:1 did not answer hgpo_load_weights"))
    trainer.ahead.push_failed(RuntimeError("a later failure"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="did not answer hgpo_load_weights"):
            trainer.ahead.take(1)
    trainer.ahead.stop()
    assert sorted(trainer.started) == [0, 1]


@pytest.mark.parametrize(("options", "refusal"), [
    ({"vllm_mode": "colocate"}, "must be false unless use_vllm is true with vllm_mode 'server'"),
    ({"rollout_mode": "auto"}, "with rollout_mode 'continuous'"),
    ({"step_batching": "all_steps"}, "each iteration is one optimizer step"),
    ({"dynamic_sampling": True}, "without dynamic_sampling"),
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 4}, "steps_per_generation x num_iterations"),
])
def test_async_generation_is_refused_in_one_line_where_its_bound_cannot_hold(options, refusal):
    from hgpo_trl.config import HGPOConfig

    settings = {"use_vllm": True, "vllm_mode": "server", "rollout_mode": "continuous", **options}
    with pytest.raises(ValueError) as err:
        HGPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, async_generation=True, **settings)
    assert str(err.value).startswith("HGPOConfig.async_generation must be false unless") and refusal in str(err.value)
    with pytest.raises(ValueError, match=r"^HGPOConfig.max_staleness must be an integer >= 0"):
        HGPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, max_staleness=-1)
    with pytest.raises(ValueError, match=r"^HGPOConfig.vllm_request_timeout must be a number of seconds > 0"):
        HGPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, vllm_request_timeout=0)
