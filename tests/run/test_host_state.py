"""The host state a checkpoint keeps is read back field by field, or refused in one line."""

import math

import pytest

from podsjax.run.run_state import HostState


def test_a_checkpoint_s_host_state_round_trips_and_an_older_one_keeps_defaults():
    state = HostState(data_position=12, elapsed_train_s=3.5, last_eval_s=2.0, best_step=4,
                      best_accuracy=float("nan"), log_sizes={"metrics.jsonl": 10})
    back = HostState.from_json(state.to_json())
    assert back.data_position == 12 and back.log_sizes == {"metrics.jsonl": 10} and math.isnan(back.best_accuracy)
    assert HostState.from_json({"data_position": 3, "field_of_a_later_version": 1}) == HostState(data_position=3)


@pytest.mark.parametrize("values,message", [
    ({"data_position": "5"}, "data_position must be an integer >= 0; got '5'"),  # had failed deep in the loop
    ({"data_position": 2.0}, "data_position must be an integer >= 0; got 2.0"),
    ({"nonfinite_in_a_row": True}, "nonfinite_in_a_row must be an integer >= 0; got True"),
    ({"best_step": -1}, "best_step must be an integer >= 0; got -1"),
    ({"elapsed_train_s": None}, "elapsed_train_s must be a number; got None"),
    ({"best_accuracy": "0.5"}, "best_accuracy must be a number; got '0.5'"),
    ({"log_sizes": {"metrics.jsonl": -1}}, "log_sizes must map log names to sizes in bytes"),
    ({"log_sizes": [1]}, "log_sizes must map log names to sizes in bytes"),
])
def test_a_damaged_host_state_is_named_in_one_line(values, message):
    with pytest.raises(ValueError, match=f"host state: {message}"):
        HostState.from_json(values)


def test_host_state_that_is_no_object_is_refused():
    with pytest.raises(ValueError, match="a checkpoint's host state is a JSON object; got list"):
        HostState.from_json([1, 2])
