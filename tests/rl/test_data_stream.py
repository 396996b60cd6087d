"""A step's prompts are different examples, across an epoch's end too, and the stream resumes from its position."""

import pytest

from podsjax.data.datasets import Example
from podsjax.rl.prompt_source import DataStream


def _examples(count):
    return [Example(f"question {i}", str(i)) for i in range(count)]


@pytest.mark.parametrize("size,step", [(5, 2), (7, 3), (10, 4), (6, 6)])
def test_every_step_draws_different_examples_and_every_epoch_holds_each_once_more(size, step):
    # A step that ran into the next epoch had drawn one example twice (5 examples, steps of 2: [1, 1]).
    stream = DataStream(_examples(size), seed=0)
    steps = [stream.take(step) for _ in range(30)]
    assert all(len({id(e) for e in drawn}) == step for drawn in steps)
    seen = [e.answer for drawn in steps for e in drawn]
    assert set(seen) == {str(i) for i in range(size)}


def test_a_resumed_stream_draws_what_the_running_one_draws():
    running = DataStream(_examples(5), seed=3)
    for _ in range(4):
        running.take(2)
    resumed = DataStream(running.examples, seed=3, position=running.position)
    assert [e.answer for e in resumed.take(2)] == [e.answer for e in running.take(2)]


def test_a_draw_that_avoids_what_a_step_holds_never_repeats_it():
    stream = DataStream(_examples(4), seed=1)
    first = stream.take_indices(2)
    more = stream.take_indices(2, avoid=first)
    assert sorted(first + more) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot draw 2 more different examples from 4, 3 of them drawn already"):
        stream.take_indices(2, avoid=first + more[:1])


def test_a_list_that_holds_one_example_several_times_still_draws():
    # Told apart by identity, the copies had looked drawn already: the draw never ended.
    one = Example("question", "1")
    assert len(DataStream([one] * 5, seed=0).take(3)) == 3
