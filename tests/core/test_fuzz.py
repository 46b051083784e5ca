"""Property-based fuzz of SchedulerConfig: every value, given as an argument or through
COMMSCHED_<FIELD>, is either accepted with the documented meaning or refused at
construction with a ValueError naming the argument (or variable) and the fix; no
thread is started and nothing is left behind either way."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commsched.config import ENV_PREFIX, ORDERINGS, SchedulerConfig

FIELDS = ("partition_bytes", "credit_bytes", "ordering", "cross_iteration", "timeout_s", "timeline")
FIX_WORDS = {"partition_bytes": "positive", "credit_bytes": "positive", "ordering": "use one of",
             "cross_iteration": "True/False", "timeout_s": "greater than 0", "timeline": "file path"}

values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                   st.text(max_size=12), st.sampled_from(["4MiB", "1mb", " 7 ", "-1", "0", "1e3", "inf", "nan",
                                                          "dynamic", "FIFO", "yes", "off", "2gib", "1.5k"]),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


def check(field: str, value, source: str, build) -> None:
    before = set(threading.enumerate())
    try:
        config = build()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert source in message, f"{source}={value!r}: the error does not name it: {message}"
        assert FIX_WORDS[field] in message, f"{source}={value!r}: the error does not say the fix: {message}"
    else:
        got = getattr(config, field)
        if field in ("partition_bytes", "credit_bytes"):
            assert isinstance(got, int) and not isinstance(got, bool) and got >= 1
        elif field == "ordering":
            assert got in ORDERINGS
        elif field == "cross_iteration":
            assert isinstance(got, bool)
        elif field == "timeout_s":
            assert isinstance(got, float) and 0 < got < float("inf")
        else:
            assert got is None or (isinstance(got, str) and got)
    assert set(threading.enumerate()) == before  # nothing started, nothing left


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=values)
def test_every_argument_value_is_accepted_as_documented_or_refused_naming_the_argument_and_fix(field, value):
    check(field, value, field, lambda: SchedulerConfig(**{field: value}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=st.text(max_size=12) | st.sampled_from(["4MiB", "-3", "0", "nan",
                                                                                   "static", "maybe", "1e-9"]))
def test_every_environment_value_is_accepted_or_refused_naming_the_variable_and_fix(field, value, monkeypatch):
    if "\0" in value:
        return  # an environment variable cannot hold NUL
    var = ENV_PREFIX + field.upper()
    with monkeypatch.context() as m:
        m.setenv(var, value)
        check(field, value, var, SchedulerConfig)


def test_a_dict_where_a_value_belongs_names_the_field():
    with pytest.raises(ValueError, match="partition_bytes"):
        SchedulerConfig(partition_bytes={"a": 1})
