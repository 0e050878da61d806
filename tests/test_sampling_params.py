import pytest

from atom.sampling_params import SamplingParams


def test_defaults_and_stop_strings():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p) == (1.0, -1, 1.0)
    assert (params.max_tokens, params.n, params.stop_strings) == (64, 1, [])
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"temperature": -0.1}, ValueError, "temperature must be >= 0"),
        ({"temperature": float("nan")}, TypeError, "temperature"),
        ({"top_k": 0}, ValueError, r"top_k must be -1 \(off\) or >= 1"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
        ({"stop": [1]}, TypeError, "stop must be"),
        ({"stop": [""]}, ValueError, "empty string"),
        ({"seed": "7"}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
        ({"seed": 2**64}, ValueError, r"seed must be an integer in \[0, 2\*\*63 - 1\]"),
        ({"seed": 2**63}, ValueError, "seed"),
        ({"seed": -1}, ValueError, "seed"),
        ({"n": "1"}, TypeError, "n must be an int"),
        ({"n": 2}, ValueError, "only n=1 is supported"),
    ],
)
def test_bad_values_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_seed_bounds_are_accepted():
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
