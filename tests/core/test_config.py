"""SchedulerConfig: defaults, precedence (explicit > COMMSCHED_* env > default), validation, immutability."""

import dataclasses
import re
from pathlib import Path

import pytest

from commsched import SchedulerConfig
from commsched.config import read_environment

pytestmark = pytest.mark.timeout(30)

ENV_VARS = ["COMMSCHED_PARTITION_BYTES", "COMMSCHED_CREDIT_BYTES", "COMMSCHED_ORDERING",
            "COMMSCHED_CROSS_ITERATION", "COMMSCHED_TIMEOUT_S", "COMMSCHED_TIMELINE", "COMMSCHED_FUSION_BYTES",
            "COMMSCHED_THREAD_NICE"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def test_defaults_match_the_documented_values():
    cfg = SchedulerConfig()
    assert cfg.partition_bytes == 4 << 20
    assert cfg.credit_bytes == 16 << 20
    assert cfg.fusion_bytes == 256 << 10
    assert cfg.ordering == "dynamic"
    assert cfg.cross_iteration is True
    assert cfg.timeout_s == 300.0
    assert cfg.timeline is None
    assert cfg.direct_start is False  # measured slower on the contended bench (docs/tuning.md)


def test_environment_overrides_every_default(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMSCHED_PARTITION_BYTES", "1MiB")
    monkeypatch.setenv("COMMSCHED_CREDIT_BYTES", "12345")
    monkeypatch.setenv("COMMSCHED_ORDERING", " Static ")
    monkeypatch.setenv("COMMSCHED_CROSS_ITERATION", "off")
    monkeypatch.setenv("COMMSCHED_TIMEOUT_S", "2.5")
    monkeypatch.setenv("COMMSCHED_TIMELINE", str(tmp_path / "t.json"))
    monkeypatch.setenv("COMMSCHED_DIRECT_START", "yes")
    cfg = SchedulerConfig()
    assert cfg.partition_bytes == 1 << 20
    assert cfg.credit_bytes == 12345
    assert cfg.ordering == "static"
    assert cfg.cross_iteration is False
    assert cfg.timeout_s == 2.5
    assert cfg.timeline == str(tmp_path / "t.json")
    assert cfg.direct_start is True


def test_explicit_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("COMMSCHED_PARTITION_BYTES", "1000")
    monkeypatch.setenv("COMMSCHED_ORDERING", "fifo")
    monkeypatch.setenv("COMMSCHED_CROSS_ITERATION", "0")
    cfg = SchedulerConfig(partition_bytes=2000, ordering="dynamic", cross_iteration=True)
    assert (cfg.partition_bytes, cfg.ordering, cfg.cross_iteration) == (2000, "dynamic", True)


def test_explicit_argument_wins_even_when_the_environment_value_is_invalid(monkeypatch):
    monkeypatch.setenv("COMMSCHED_CREDIT_BYTES", "lots")
    assert SchedulerConfig(credit_bytes=64).credit_bytes == 64


@pytest.mark.parametrize("text, expected", [
    ("4194304", 4194304), ("4MiB", 4 << 20), ("4 mib", 4 << 20), ("1mb", 1_000_000),
    ("2k", 2000), ("3KiB", 3072), ("1GiB", 1 << 30), ("1.5MiB", 3 << 19), ("64b", 64),
])
def test_size_strings_with_units_are_parsed(text, expected):
    assert SchedulerConfig(partition_bytes=text).partition_bytes == expected


def test_empty_timeline_means_no_timeline(monkeypatch):
    monkeypatch.setenv("COMMSCHED_TIMELINE", "")
    assert SchedulerConfig().timeline is None


def test_pathlike_timeline_is_stored_as_a_string(tmp_path):
    assert SchedulerConfig(timeline=tmp_path / "x.json").timeline == str(tmp_path / "x.json")


def _check_message(exc_info, field, value, allowed_pattern):
    message = str(exc_info.value)
    assert field.lower() in message.lower(), message
    assert repr(value) in message, message
    assert re.search(allowed_pattern, message, re.I), message


@pytest.mark.parametrize("field, value, allowed", [
    ("partition_bytes", 0, r"positive"),
    ("partition_bytes", -4, r"positive"),
    ("credit_bytes", 0, r"positive"),
    ("credit_bytes", -1, r"positive"),
    ("partition_bytes", "0.4", r"positive"),
    ("partition_bytes", "four", r"positive integer"),
    ("partition_bytes", "4 parsecs", r"positive integer"),
    ("credit_bytes", 1.5, r"positive integer"),
    ("credit_bytes", True, r"positive integer"),
    ("ordering", "random", r"dynamic, static, fifo"),
    ("ordering", 3, r"dynamic, static, fifo"),
    ("cross_iteration", "maybe", r"True/False"),
    ("cross_iteration", 1, r"True/False"),
    ("timeout_s", 0, r"greater than 0"),
    ("timeout_s", -3, r"greater than 0"),
    ("timeout_s", float("inf"), r"finite"),
    ("timeout_s", float("nan"), r"greater than 0"),
    ("timeout_s", "soon", r"greater than 0"),
    ("timeline", 42, r"path"),
])
def test_invalid_explicit_value_raises_value_error_naming_field_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError) as exc_info:
        SchedulerConfig(**{field: value})
    _check_message(exc_info, field, value, allowed)


@pytest.mark.parametrize("field, value, allowed", [
    ("partition_bytes", "abc", r"positive integer"),
    ("partition_bytes", "-5", r"positive integer"),
    ("credit_bytes", "0", r"positive"),
    ("ordering", "priority", r"dynamic, static, fifo"),
    ("cross_iteration", "perhaps", r"true/false"),
    ("timeout_s", "ten", r"greater than 0"),
    ("timeout_s", "-1", r"greater than 0"),
])
def test_invalid_environment_value_raises_value_error_naming_the_variable(monkeypatch, field, value, allowed):
    var = "COMMSCHED_" + field.upper()
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as exc_info:
        SchedulerConfig()
    _check_message(exc_info, field, value, allowed)
    assert var in str(exc_info.value)


def test_config_is_frozen():
    cfg = SchedulerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.credit_bytes = 1  # type: ignore[misc]


def test_configs_with_equal_fields_are_equal_and_replace_revalidates():
    assert SchedulerConfig(credit_bytes=10) == SchedulerConfig(credit_bytes="10")
    cfg = dataclasses.replace(SchedulerConfig(), ordering="fifo")
    assert cfg.ordering == "fifo"
    with pytest.raises(ValueError):
        dataclasses.replace(cfg, partition_bytes=0)


def test_read_environment_returns_only_commsched_fields():
    env = {"COMMSCHED_ORDERING": "fifo", "COMMSCHED_BOGUS": "1", "ORDERING": "static"}
    assert read_environment(env) == {"ordering": "fifo"}


def test_only_config_reads_the_environment():
    core = Path(__import__("commsched").config.__file__).resolve().parent
    offenders = []
    for path in sorted(core.rglob("*.py")):
        rel = path.relative_to(core).as_posix()
        if rel == "config.py" or rel.startswith("bench/") or rel == "cli.py":
            continue  # the benchmark tools and the CLI are programs, not the library
        text = path.read_text(encoding="utf-8")
        if re.search(r"os\.environ|getenv\(", text):
            offenders.append(rel)
    assert offenders == [], f"these core modules read the environment outside config.read_environment: {offenders}"


@pytest.mark.parametrize("value, expected", [(0, 0), ("0", 0), ("off", 0), (" OFF ", 0), ("256KiB", 256 << 10),
                                             (1 << 20, 1 << 20), ("1mb", 10**6)])
def test_fusion_bytes_takes_a_byte_count_or_zero_for_off(value, expected):
    assert SchedulerConfig(fusion_bytes=value).fusion_bytes == expected


def test_fusion_bytes_from_the_environment_and_its_errors_name_the_variable_and_the_fix(monkeypatch):
    monkeypatch.setenv("COMMSCHED_FUSION_BYTES", "off")
    assert SchedulerConfig().fusion_bytes == 0
    monkeypatch.setenv("COMMSCHED_FUSION_BYTES", "lots")
    with pytest.raises(ValueError, match=r"COMMSCHED_FUSION_BYTES='lots' is not a fusion threshold.*or 0 \(or 'off'\)"):
        SchedulerConfig()
    with pytest.raises(ValueError, match=r"fusion_bytes=-1 is not a fusion threshold"):
        SchedulerConfig(fusion_bytes=-1)
    with pytest.raises(ValueError, match=r"fusion_bytes=True"):
        SchedulerConfig(fusion_bytes=True)


def test_thread_nice_is_a_nice_increment_from_0_to_19_explicit_or_from_the_environment(monkeypatch):
    assert SchedulerConfig().thread_nice == 0
    assert SchedulerConfig(thread_nice=19).thread_nice == 19
    monkeypatch.setenv("COMMSCHED_THREAD_NICE", " 10 ")
    assert SchedulerConfig().thread_nice == 10
    monkeypatch.setenv("COMMSCHED_THREAD_NICE", "low")
    with pytest.raises(ValueError, match=r"COMMSCHED_THREAD_NICE='low' must be a whole number from 0 to 19"):
        SchedulerConfig()
    for bad in (-1, 20, 2.5, True, "5.0"):
        with pytest.raises(ValueError, match=r"thread_nice=.* must be a whole number from 0 to 19"):
            SchedulerConfig(thread_nice=bad)
