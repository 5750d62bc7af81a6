"""The run's random streams (hgpo_trl.runtime.seeds): one per (seed, rank, purpose), never seed + rank, under which rank 1
of seed 0 drew what rank 0 of seed 1 drew and seed-averaged results on several GPUs were correlated."""

import itertools

import numpy as np
import torch

from hgpo_trl.rollout.sampler import TaskSampler
from hgpo_trl.runtime.seeds import integer_seed, seed_process, stream
from tests.test_trainer import make_config, make_trainer

GRID = list(itertools.product(range(4), range(4)))  # 4 seeds x 4 ranks


def test_no_two_seed_and_rank_pairs_share_a_stream():
    sub_sampling = {tuple(stream(seed, "sub_sampling", rank).random(4)) for seed, rank in GRID}
    generation = set()
    for seed, rank in GRID:
        seed_process(seed, rank)
        generation.add((tuple(torch.rand(4).tolist()), tuple(np.random.random(4))))  # noqa: NPY002 (the global generator is what is seeded)
    assert len(sub_sampling) == len(generation) == len(GRID)
    # Nor does a purpose share another's: the generation seeds are none of the sub-sampling streams' seeds.
    assert len({integer_seed(s, p, r) for s, r in GRID for p in ("generation", "sub_sampling")}) == 2 * len(GRID)


def test_dynamic_sampling_s_task_stream_is_its_own_for_every_seed():
    """Its stream was seed + 1_000_003: the iterations' stream of the run with that seed."""
    orders = {tuple(TaskSampler(range(64), 4, 1, seed=seed).extra_tasks(0, 0, 1)) for seed in range(4)}
    iterations = {tuple(TaskSampler(range(64), 4, 1, seed=seed).iteration_tasks(0, 0, 1)) for seed in range(4)}
    assert len(orders) == 4 and not orders & iterations


def test_the_trainer_samples_and_sub_samples_on_its_process_s_streams(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, seed=5))
    drawn = torch.rand(4), trainer._sample_rng.random(4)
    expected_sub_sampling = seed_process(5, 0).random(4)
    assert torch.equal(drawn[0], torch.rand(4)) and np.array_equal(drawn[1], expected_sub_sampling)
