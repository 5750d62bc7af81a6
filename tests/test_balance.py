"""balance_steps' plan (hgpo_trl.training.balance): the released fill, equal-size sets with balanced token counts (ours, and
verl's Karmarkar-Karp against a reading of it), the released row order and token-spread metrics, and the rows'
round trip through the packed arrays the all-gather carries. tests/test_distributed.py runs it on 2 processes."""

from types import SimpleNamespace

import numpy as np
import pytest

from hgpo_trl.rollout.lockstep import Completion, StepRecord
from hgpo_trl.training.balance import PARTITIONS, balanced_rows, fill_rows, own_rows, token_spread
from tests import reference
from tests.test_trainer import make_config, make_trainer


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(5))
def test_partition_sizes_differ_by_one_at_most_and_token_sums_by_one_row(partition, parts, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 2_000, size=int(rng.integers(0, 200)))
    sets = PARTITIONS[partition](lengths, parts)
    assert len(sets) == parts
    assert sorted(np.concatenate(sets).tolist()) == list(range(len(lengths)))  # every row once
    sizes = [len(s) for s in sets]
    assert max(sizes) - min(sizes) <= 1 and all(np.all(np.diff(s) > 0) for s in sets)
    sums = [int(lengths[s].sum()) for s in sets]
    if len(lengths):
        assert max(sums) - min(sums) <= lengths.max()
    assert [s.tolist() for s in PARTITIONS[partition](lengths, parts)] == [s.tolist() for s in sets]  # deterministic


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(8))
def test_karmarkar_karp_splits_as_verls_equal_size_partition(parts, seed):
    """The sets verl's _balance_batch hands rank 0, 1, ... (tests/reference.py reads the released function), on
    random lengths and on lengths with many ties, which verl breaks by row position."""
    rng = np.random.default_rng(seed)
    rows = parts * int(rng.integers(1, 80))
    lengths = rng.integers(50, 2_000, rows) if seed % 2 else 100 * rng.integers(1, 4, rows)
    ours = PARTITIONS["karmarkar_karp"](lengths, parts)
    assert [s.tolist() for s in ours] == reference.released_balanced_partitions(lengths.tolist(), parts)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_partition_balances_what_rollout_order_would_not(partition):
    # Process 0 played long episodes, process 1 short ones: split in rollout order, one set holds all the tokens.
    lengths = np.r_[np.full(40, 1_500), np.full(8, 300)]
    sets = PARTITIONS[partition](lengths, 2)
    assert [len(s) for s in sets] == [24, 24]
    assert [int(lengths[s].sum()) for s in sets] == [31_200, 31_200]
    # global_seqlen/* as released (log_seqlen_unbalance): the sums of the rows split in order, then as balanced.
    in_order = [24 * 1_500, 16 * 1_500 + 8 * 300]
    assert token_spread(lengths, sets) == {
        "global_seqlen/min": min(in_order), "global_seqlen/max": max(in_order),
        "global_seqlen/minmax_diff": 9_600, "global_seqlen/balanced_min": 31_200,
        "global_seqlen/balanced_max": 31_200, "global_seqlen/mean": 31_200}


def test_fill_copies_random_rows_up_to_the_multiple_as_released():
    rows = fill_rows(13, 8, "duplicate", np.random.default_rng(0))
    assert len(rows) == 16 and rows[:13].tolist() == list(range(13))
    assert len(set(rows[13:].tolist())) == 3  # drawn without replacement
    assert fill_rows(16, 8, "duplicate", np.random.default_rng(0)).tolist() == list(range(16))
    assert fill_rows(13, 8, "pad", np.random.default_rng(0)).tolist() == list(range(13))
    assert len(fill_rows(3, 16, "duplicate", np.random.default_rng(0))) == 16  # more copies than rows
    assert fill_rows(0, 8, "duplicate", np.random.default_rng(0)).tolist() == []


def step(i: int, prompt: list[int], completion: list[int], logprobs=None, t: int = 0) -> StepRecord:
    return StepRecord(group=0, traj=i, step=t, observation="o", prompt="p",
                      completion=Completion("text", prompt, completion, logprobs), action="a", reward=0.0,
                      shown_history=0)


def test_one_process_trains_every_row_with_its_tokens_and_log_probabilities():
    steps = [step(0, [5, 6, 7], [8], [-0.5]), step(1, [5], [9, 10], [-1.0, None]), step(2, [151_000], [3], [0.0])]
    single = SimpleNamespace(num_processes=1, process_index=0)
    rows = balanced_rows(single, steps, np.array([0.1, 0.2, 0.3]), fill_multiple=4, fill="duplicate", seed=(0, 0))
    assert rows.balanced and rows.num_ids == 3 and rows.copies == 1 and len(rows.completions) == 4
    for row, i, advantage in zip(rows.completions, rows.ids, rows.advantages, strict=True):
        original = steps[i].completion
        assert (row.prompt_ids, row.completion_ids) == (original.prompt_ids, original.completion_ids)
        assert advantage == [0.1, 0.2, 0.3][i]
        assert np.allclose(row.logprobs, [np.nan if x is None else x for x in original.logprobs], equal_nan=True)
    mixed = balanced_rows(single, [step(0, [1], [2]), step(1, [3], [4, 5], [-0.1, -0.2])], np.zeros(2),
                          fill_multiple=1, fill="pad", seed=(0, 0))
    assert [c.logprobs for c in mixed.completions] == [None, [-0.1, -0.2]] and mixed.copies == 0
    with pytest.raises(ValueError, match="1 sampling log-probabilities for 2 tokens"):
        balanced_rows(single, [step(0, [1], [2, 3], [-0.1])], np.zeros(1), fill_multiple=1, fill="pad", seed=(0, 0))
    assert own_rows(steps, np.zeros(3)).ids.tolist() == [0, 1, 2] and not own_rows(steps, np.zeros(3)).balanced


def test_balanced_rows_take_the_released_batch_order():
    """A rollout lists its steps turn by turn; the released batch (gather_rollout_data) lists each trajectory's
    steps in turn, and _balance_batch keeps that order within each rank's set: the rows, their advantages and
    ids follow (trajectory, step) order, whatever order the steps came in."""
    turns = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    steps = [step(traj, [traj] * 3, [t], t=t) for traj, t in turns]
    single = SimpleNamespace(num_processes=1, process_index=0)
    for partition in PARTITIONS:
        rows = balanced_rows(single, steps, np.arange(5.0), fill_multiple=1, fill="pad", seed=(0, 0),
                             partition=partition)
        assert [(c.prompt_ids[0], c.completion_ids[0]) for c in rows.completions] == sorted(turns)
        assert rows.advantages.tolist() == [0.0, 2.0, 4.0, 1.0, 3.0] and rows.ids.tolist() == [0, 1, 2, 3, 4]
        assert rows.token_spread == token_spread([4] * 5, [np.arange(5)])


def test_a_balanced_run_logs_the_token_spread_of_the_released_partition(tmp_path, tiny_model, tiny_tokenizer):
    args = make_config(tmp_path, step_batching="all_steps", per_device_train_batch_size=4, mini_batch_size=8,
                       invalid_action="noop", train_iterations=1, balance_steps=True,
                       balance_partition="karmarkar_karp", fill_last_micro_batch="duplicate")
    trainer = make_trainer(tiny_model, tiny_tokenizer, args)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "global_seqlen/mean" in h)
    # One process: its set is the whole filled batch, in order and balanced alike.
    assert log["global_seqlen/min"] == log["global_seqlen/max"] == log["global_seqlen/balanced_max"] \
        == log["global_seqlen/mean"] > 0 and log["global_seqlen/minmax_diff"] == 0
