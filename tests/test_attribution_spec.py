"""``AttributionSpec``, the settings object of ``attribute``: what it refuses, and how ``ntpflow.attribute`` takes it."""

import pytest

import ntpflow
from ntpflow import AttributionSpec, Site


@pytest.mark.parametrize("settings, fragment", [
    ({"reading": "both"}, "unknown reading"),
    ({"reading": "paper", "readout": 64}, "does not combine with --paper"),
    ({"reading": "midpoint", "matrices": True}, "--matrices needs the exact account"),
    ({"block": 0}, "positive number of steps"),
])
def test_settings_that_cannot_be_computed_are_refused_in_one_line(settings, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        AttributionSpec([Site(1, 3)], **settings)
    assert "\n" not in str(err.value)


def test_readout_size_defaults_to_the_batch_and_checks_the_evaluation_set():
    assert AttributionSpec().readout_size(n_eval=512, batch_size=64) == 64
    assert AttributionSpec().readout_size(n_eval=512, batch_size=1024) == 256  # at most DEFAULT_READOUT
    assert AttributionSpec().readout_size(n_eval=40, batch_size=64) == 40  # at most the evaluation set
    assert AttributionSpec(reading="paper").readout_size(n_eval=512, batch_size=64) is None
    with pytest.raises(ValueError, match="2..512"):
        AttributionSpec(readout=513).readout_size(n_eval=512, batch_size=64)


def test_of_takes_a_spec_or_its_settings_not_both():
    spec = AttributionSpec([Site(1, 3)], ["is_majority_<0>"], readout=8)
    assert AttributionSpec.of(spec) is spec
    made = AttributionSpec.of([Site(1, 3)], ["is_majority_<0>"], readout=8, sgd_rows=False)
    assert (made.sites, made.features, made.readout, made.sgd_rows) == ((Site(1, 3),), ("is_majority_<0>",), 8, False)
    with pytest.raises(ValueError, match="not both"):
        AttributionSpec.of(spec, readout=16)
    with pytest.raises(TypeError, match="no setting"):
        AttributionSpec.of([Site(1, 3)], readouts=16)


def test_a_group_takes_no_directions_or_matrices():
    with pytest.raises(ValueError, match="single run"):
        AttributionSpec(matrices=True).check_group()
    AttributionSpec([Site(1, 3)]).check_group()
    assert ntpflow.AttributionSpec is AttributionSpec
