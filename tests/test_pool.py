"""Environment batches: the worker pool plays like the in-process batch, and faults stay local."""

import functools
import gc
import multiprocessing
import os
import signal
import sys
import time
import warnings

import pytest

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.keydoor import KeyDoorEnv
from hgpo_trl.envs.pool import InProcessEnvs, StepResult, WorkerPoolEnvs, default_num_workers, make_env_batch

pytestmark = pytest.mark.timeout(60)

KEYDOOR = functools.partial(make_env, "keydoor", max_steps=8)
TASK = {"room1": "library", "room2": "kitchen", "color1": "red", "color2": "blue", "gold": "red"}
GOLD_PATH = ["take red key", "go to hall", "go to vault", "open red door"]


class FaultyEnv(KeyDoorEnv):
    """Keydoor that misbehaves as its task says: `fault` is "raise", "hang" or "exit", at step `fault_step`
    (0: in reset). The task picks the faulty environment, since one factory builds them all."""

    def reset(self, task):
        self._fault, self._fault_step = task.get("fault"), task.get("fault_step", 0)
        self._misbehave(0)
        return super().reset(task)

    def step(self, action):
        self._misbehave(self._steps + 1)
        return super().step(action)

    def _misbehave(self, step):
        if self._fault is None or step != self._fault_step:
            return
        if self._fault == "raise":
            raise RuntimeError(f"injected at step {step}")
        if self._fault == "hang":
            time.sleep(600)
        if self._fault == "exit":
            os._exit(3)


def faulty_tasks(n, **faults):
    """`n` copies of TASK; `faults` maps "env<i>" to (fault, fault_step)."""
    tasks = [dict(TASK) for _ in range(n)]
    for name, (fault, step) in faults.items():
        tasks[int(name.removeprefix("env"))].update(fault=fault, fault_step=step)
    return tasks


def new_children(before):
    return [p for p in multiprocessing.active_children() if p not in before]


@pytest.fixture
def pool():
    """A factory of 2-worker pools of FaultyEnv, all closed after the test."""
    made = []

    def make(num_envs=4, **options):
        made.append(WorkerPoolEnvs(FaultyEnv, num_envs, num_workers=2, **options))
        return made[-1]

    yield make
    for batch in made:
        batch.close()


def assert_plays_gold_path(batch, n):
    """Training goes on: every environment resets and wins."""
    results = batch.reset([TASK] * n)
    assert all(r.fault is None and not r.terminated for r in results)
    for action in GOLD_PATH:
        results = batch.step(dict.fromkeys(range(n), action))
    assert all(r.fault is None and r.terminated and r.reward == 10.0 and r.info["won"] for r in results.values())


def test_worker_pool_matches_in_process():
    rows = list(make_tasks("keydoor", "train", num_rooms=3, num_colors=3).select(range(6)))
    script = [  # subsets of indices, invalid (None) and inadmissible actions included
        {0: "go to hall", 1: None, 2: f"take {rows[2]['color1']} key", 3: f"take {rows[3]['color2']} key", 5: "x"},
        {2: "go to hall", 3: "go to hall", 4: f"take {rows[4]['color1']} key"},
        {2: "go to vault", 3: "go to vault", 0: f"take {rows[0]['color2']} key"},
        {3: f"open {rows[3]['color2']} door", 2: f"open {rows[2]['color2']} door", 1: "go to hall"},
    ]
    local = InProcessEnvs(KEYDOOR, 6)
    with WorkerPoolEnvs(KEYDOOR, 6, num_workers=2) as remote:
        assert len(remote) == len(local) == 6 and remote.num_workers == 2
        assert remote.reset(rows) == local.reset(rows)
        for actions in script:
            expected = local.step(actions)
            got = remote.step(actions)
            assert list(got) == sorted(actions)
            assert got == expected
        assert any(r.terminated for r in got.values()) and remote.faults == local.faults == 0
        args = ("Find the gold.", [("obs", "act")], "Now.", ["go to hall"], 1)
        assert remote.render_prompt(5, *args) == local.render_prompt(5, *args)
        assert remote.render_prompt(5, *args) == KeyDoorEnv().render_prompt(*args)
    local.close()


@pytest.mark.parametrize("kind", ["in_process", "pool"])
def test_raise_faults_only_that_env(kind, pool):
    batch = InProcessEnvs(FaultyEnv, 4) if kind == "in_process" else pool()
    results = batch.reset(faulty_tasks(4, env1=("raise", 2), env3=("raise", 0)))
    assert results[3] == StepResult("", 0.0, True, False, {}, "RuntimeError: injected at step 0")
    assert [r.fault is None for r in results] == [True, True, True, False]
    batch.step({0: GOLD_PATH[0], 1: GOLD_PATH[0], 2: GOLD_PATH[0]})
    results = batch.step({0: GOLD_PATH[1], 1: GOLD_PATH[1], 2: GOLD_PATH[1]})
    assert results[1].fault == "RuntimeError: injected at step 2" and results[1].terminated
    assert results[1].reward == 0.0
    assert results[0] == results[2] and results[0].fault is None and results[0].observation == "You are in the hall."
    assert batch.step({3: "go to hall"})[3].fault.startswith("RuntimeError: the environment was lost")
    assert batch.faults == 3
    assert_plays_gold_path(batch, 4)  # the faulty environments were rebuilt
    assert batch.faults == 3
    batch.close()


def test_hang_times_out_and_restarts_the_worker(pool):
    batch = pool(step_timeout=1.0, reset_timeout=30.0)
    batch.reset(faulty_tasks(4, env0=("hang", 1)))
    first = {p.pid for p in multiprocessing.active_children()}
    tick = time.perf_counter()
    results = batch.step(dict.fromkeys(range(4), GOLD_PATH[0]))
    assert time.perf_counter() - tick < 5.0
    assert [r.fault for r in results.values()] == ["timed out after 1.0 s"] * 2 + [None] * 2
    assert all(r.terminated for r in list(results.values())[:2])
    assert results[2].observation == "You are in the library. You take the red key."
    assert batch.faults == 2
    assert len({p.pid for p in multiprocessing.active_children()} - first) == 1  # worker 0 replaced
    assert_plays_gold_path(batch, 4)
    assert batch.faults == 2


def test_one_worker_is_a_worker_process_whose_step_timeout_holds():
    """env_workers=1 (and the default on a node with fewer cores than training processes) once stepped the
    environments in the trainer process, where no timeout can hold: a hung step hung the run."""
    with make_env_batch(FaultyEnv, 2, num_workers=1, step_timeout=0.5, reset_timeout=30.0) as batch:
        assert isinstance(batch, WorkerPoolEnvs) and batch.num_workers == 1
        batch.reset(faulty_tasks(2, env1=("hang", 1)))
        tick = time.perf_counter()
        results = batch.step(dict.fromkeys(range(2), GOLD_PATH[0]))
        assert time.perf_counter() - tick < 5.0
        assert [r.fault for r in results.values()] == ["timed out after 0.5 s"] * 2  # one worker: both its envs


def test_in_process_environments_warn_that_timeouts_cannot_hold():
    with pytest.warns(UserWarning, match=r"env_workers=0.*env_step_timeout and env_reset_timeout cannot be enforced"):
        make_env_batch(KEYDOOR, 2, num_workers=0, step_timeout=1.0, reset_timeout=2.0).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_env_batch(KEYDOOR, 2, num_workers=0).close()  # no timeout asked for: nothing to say


def test_default_workers_count_this_node_s_processes(monkeypatch):
    """The default worker count shares this node's cores among this node's training processes, not the run's."""
    from hgpo_trl.envs.pool import local_process_count

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert local_process_count(4) == 4  # a launcher that does not say: all of them (the fewest workers)
    monkeypatch.setenv("LOCAL_SIZE", "8")  # DeepSpeed's launcher (accelerate's multi-node DeepSpeed default)
    assert local_process_count(16) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun, accelerate launch
    assert local_process_count(16) == 2  # 16 processes in the run, 2 of them on this node


def test_exiting_worker_is_restarted(pool):
    batch = pool(num_envs=5)  # shares: envs 0-1 and 2-4
    batch.reset(faulty_tasks(5, env3=("exit", 2)))
    batch.step(dict.fromkeys(range(5), GOLD_PATH[0]))
    results = batch.step(dict.fromkeys(range(5), GOLD_PATH[1]))
    assert [r.fault for r in results.values()] == [None] * 2 + ["worker died (exit code 3)"] * 3
    assert batch.faults == 3
    assert_plays_gold_path(batch, 5)


def test_killed_worker_is_noticed_without_timeout(pool):
    before = multiprocessing.active_children()
    batch = pool()
    batch.reset([TASK] * 4)
    victim = new_children(before)[0]
    os.kill(victim.pid, signal.SIGKILL)
    results = batch.step(dict.fromkeys(range(4), GOLD_PATH[0]))
    faults = [i for i, r in results.items() if r.fault is not None]
    assert faults in ([0, 1], [2, 3])
    assert results[faults[0]].fault == f"worker died (exit code {-signal.SIGKILL})"
    assert batch.faults == 2
    assert victim not in multiprocessing.active_children()
    assert_plays_gold_path(batch, 4)


def test_close_and_garbage_collection_leave_no_children():
    before = multiprocessing.active_children()
    batch = WorkerPoolEnvs(KEYDOOR, 4, num_workers=2)
    batch.reset([TASK] * 4)
    assert len(new_children(before)) == 2
    batch.close()
    batch.close()
    assert new_children(before) == []
    with pytest.raises(RuntimeError, match="closed"):
        batch.step({0: "take red key"})
    batch = WorkerPoolEnvs(KEYDOOR, 4, num_workers=2)
    assert len(new_children(before)) == 2
    del batch
    gc.collect()
    assert new_children(before) == []


def test_bad_arguments_and_batch_choice():
    batch = InProcessEnvs(KEYDOOR, 2)
    with pytest.raises(ValueError, match="at most one task per environment"):
        batch.reset([TASK] * 3)
    assert len(batch.reset([TASK])) == 1  # fewer tasks reset the first environments only
    with pytest.raises(IndexError, match=r"\[2\]"):
        batch.step({2: "go to hall"})
    with pytest.raises(ValueError, match="num_workers"):
        WorkerPoolEnvs(KEYDOOR, 2, num_workers=0)
    assert isinstance(make_env_batch(KEYDOOR, 2, num_workers=0), InProcessEnvs)
    assert default_num_workers(local_processes=10**6) == 1
    with make_env_batch(KEYDOOR, 1, num_workers=4) as pooled:
        assert isinstance(pooled, WorkerPoolEnvs) and pooled.num_workers == 1  # never more workers than envs


def test_a_scheduler_s_sigint_or_sigterm_to_every_process_leaves_the_workers_playing(pool):
    """A terminal's Ctrl-C reaches the whole process group, a scheduler's SIGTERM (SLURM) every process of the job:
    the training process stops at the end of its iteration (hgpo_trl.training.interrupts), so the workers must play on
    until then, not fault the iteration's episodes."""
    before = multiprocessing.active_children()
    batch = pool()
    batch.reset([TASK] * 4)
    for worker in new_children(before):
        os.kill(worker.pid, signal.SIGINT)
        os.kill(worker.pid, signal.SIGTERM)
    time.sleep(0.2)
    results = batch.step(dict.fromkeys(range(4), GOLD_PATH[0]))
    assert all(r.fault is None for r in results.values()) and batch.faults == 0


class SpawningEnv(KeyDoorEnv):
    """Keydoor whose reset starts a helper process (as an environment may: a server, an engine) and reports how
    that process takes SIGTERM."""

    def reset(self, task):
        import subprocess

        probe = "import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"
        default = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
        observation, info = super().reset(task)
        return observation, {**info, "helper_sigterm_default": default == "True"}


def test_an_environment_s_own_processes_still_stop_on_sigterm():
    """The worker ignores a scheduler's SIGTERM by a handler of its own, not by SIG_IGN, which a process the
    environment starts would inherit (and then never stop on terminate())."""
    batch = WorkerPoolEnvs(SpawningEnv, 1, num_workers=1)
    try:
        (result,) = batch.reset([TASK])
        assert result.fault is None and result.info["helper_sigterm_default"]
    finally:
        batch.close()
