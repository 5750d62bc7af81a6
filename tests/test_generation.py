"""Generate calls that stay in step across processes (issue 18): backends that slice a shared batch by position
get the same prompt count from every process."""

from hgpo_trl.rollout.generation import prompts_per_call, slices_by_position


def test_backends_that_slice_by_position_are_named():
    assert slices_by_position(True, "server", 1)
    # TRL's colocated vLLM with tensor parallelism gathers the group's prompts and slices by the local count.
    assert slices_by_position(True, "colocate", 2)
    assert not slices_by_position(True, "colocate", 1)
    assert not slices_by_position(False, "server", 2)  # transformers' generate: each process its own batch


def test_every_process_sends_the_busiest_ones_count_when_sliced():
    # A tensor-parallel pair with 3 and 1 live episodes: both send 3, so rank 1's slice [3:6] is its own.
    counts = [3, 1]
    assert [prompts_per_call(local, counts) for local in counts] == [3, 3]
    assert prompts_per_call(0, [0, 0]) == 1  # nothing live anywhere, still one call each (lock-step)
    assert [prompts_per_call(local, None) for local in (3, 1, 0)] == [3, 1, 1]
