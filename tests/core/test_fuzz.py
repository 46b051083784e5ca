"""Property-based fuzz of SchedulerConfig: every value, given as an argument or through
COMMSCHED_<FIELD>, is either accepted with the documented meaning or refused at
construction with a ValueError naming the argument (or variable) and the fix; no
thread is started and nothing is left behind either way."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commsched.config import ENV_PREFIX, ORDERINGS, SchedulerConfig

FIELDS = ("partition_bytes", "credit_bytes", "fusion_bytes", "ordering", "cross_iteration", "timeout_s", "timeline")
FIX_WORDS = {"partition_bytes": "positive", "credit_bytes": "positive", "fusion_bytes": "byte count",
             "ordering": "use one of",
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
        elif field == "fusion_bytes":
            assert isinstance(got, int) and not isinstance(got, bool) and got >= 0
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


# ---------------------------------------------------------------- profile and topology files
def _model_files(tmp_path_factory) -> dict:
    from commsched.costmodel.profile import Profile
    from commsched.costmodel.topology import Topology
    from commsched.costmodel.zoo import zoo_profile

    folder = tmp_path_factory.mktemp("files")
    profile, topology = folder / "profile.json", folder / "topology.json"
    zoo_profile("resnet50").to_json(str(profile))
    Topology.described("2x4", "100Gbit", "25Gbit").to_json(str(topology))
    return {"profile": (Profile, profile.read_text()), "topology": (Topology, topology.read_text())}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    return _model_files(tmp_path_factory)


def _write(folder, text: str) -> str:
    import uuid

    path = folder / f"{uuid.uuid4().hex}.json"
    path.write_text(text)
    return str(path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["profile", "topology"]), cut=st.floats(0.0, 0.9999))
def test_a_truncated_profile_or_topology_file_is_a_value_error_naming_the_file(kind, cut, model_files,
                                                                                tmp_path_factory):
    cls, text = model_files[kind]
    path = _write(tmp_path_factory.getbasetemp(), text[:int(len(text) * cut)])
    with pytest.raises(ValueError) as exc_info:
        cls.from_json(path)
    assert path in str(exc_info.value) and "truncated" in str(exc_info.value)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["profile", "topology"]), pick=st.randoms(use_true_random=False),
       value=st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                       st.text(max_size=4), st.just([]), st.just({}), st.just({"a": 1})))
def test_a_field_of_another_type_is_accepted_or_a_value_error_never_a_raw_traceback(kind, pick, value, model_files,
                                                                                     tmp_path_factory):
    cls, text = model_files[kind]
    doc = json.loads(text)
    leaves, stack = [], [doc]
    while stack:  # every (container, key) below the top, to replace one
        node = stack.pop()
        for key, child in (node.items() if isinstance(node, dict) else enumerate(node)):
            leaves.append((node, key))
            if isinstance(child, (dict, list)):
                stack.append(child)
    node, key = pick.choice(leaves)
    node[key] = value
    path = _write(tmp_path_factory.getbasetemp(), json.dumps(doc))
    try:  # a KeyError, TypeError or AttributeError from inside would fail the test
        cls.from_json(path)
    except ValueError:
        pass  # its words are not pinned: a bad numel still gives int()'s own message (a core gap)


@pytest.mark.parametrize("kind, other", [("profile", "topology"), ("topology", "profile")])
def test_a_file_of_the_other_schema_is_a_value_error_naming_both_schemas(kind, other, model_files, tmp_path):
    cls, _ = model_files[kind]
    path = _write(tmp_path, model_files[other][1])
    with pytest.raises(ValueError, match=rf"not a commsched {kind} \(schema 'commsched-{other}/1', "
                                         rf"expected 'commsched-{kind}/1'\)"):
        cls.from_json(path)


@pytest.mark.parametrize("kind", ["profile", "topology"])
def test_a_schema_error_names_the_file_too(kind, model_files, tmp_path):
    cls, _ = model_files[kind]
    path = _write(tmp_path, json.dumps({"schema": "something-else/2"}))
    with pytest.raises(ValueError) as exc_info:
        cls.from_json(path)
    assert path in str(exc_info.value)


def test_an_infinite_count_in_a_model_file_is_a_value_error(tmp_path):
    """Found by the fuzz above (a numel of inf: int() raised OverflowError from inside from_dict)."""
    import json

    from commsched.costmodel.profile import Profile

    data = {"schema": "commsched-profile/1",
            "layers": [{"name": "l", "forward_s": 0.1, "backward_s": 0.2,
                        "tensors": [{"name": "w", "numel": float("inf")}]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="p.json: the profile is missing or mistypes a field"):
        Profile.from_json(str(path))
