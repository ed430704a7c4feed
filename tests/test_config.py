import dataclasses

import pytest

from fp8compile import Fp8Config, make_config
from fp8compile.config import parse_option


def test_defaults_are_block_recipe_with_dispatch_at_32():
    c = Fp8Config()
    assert (c.recipe, c.e8m0, c.batch_invariant, c.small_m, c.backends, c.skip) == (
        "block",
        False,
        False,
        32,
        None,
        (),
    )


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fp8Config().e8m0 = True


def test_unknown_option_names_the_valid_options_and_suggests_the_close_one():
    message = r"unknown fp8compile option\(s\) \['e8mo'\].*did you mean 'e8m0'.*valid options: recipe, e8m0"
    with pytest.raises(TypeError, match=message):
        make_config(e8mo=True)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"recipe": "mxfp8"}, "valid recipes: block"),
        ({"small_m": -1}, "small_m must be an int >= 0"),
        ({"small_m": True}, "small_m must be an int >= 0"),
        ({"e8m0": "yes"}, "e8m0 must be True or False"),
        ({"backends": ["cutlass"]}, "valid backends: .*deep_gemm.*reference"),
        ({"backends": ["reference", "reference"]}, "twice"),
        ({"backends": []}, "at least one"),
        ({"skip": [1]}, "strings only"),
    ],
)
def test_bad_values_are_clear_errors(options, error):
    with pytest.raises((TypeError, ValueError), match=error):
        make_config(**options)


def test_single_strings_become_tuples():
    c = make_config(skip="lm_head", backends="reference")
    assert c.skip == ("lm_head",) and c.backends == ("reference",)


def test_dict_config_and_keyword_overrides_merge():
    c = make_config({"e8m0": True, "small_m": 16}, small_m=8)
    assert (c.e8m0, c.small_m) == (True, 8)
    assert c.replace(batch_invariant=True).batch_invariant and not c.batch_invariant


def test_debug_dir_defaults_to_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8COMPILE_DEBUG_DIR", str(tmp_path))
    assert Fp8Config().debug_dir == str(tmp_path)
    monkeypatch.delenv("FP8COMPILE_DEBUG_DIR")
    assert Fp8Config().debug_dir is None


@pytest.mark.parametrize(
    "text, option",
    [
        ("large_m=1536", ("large_m", 1536)),
        ("large_m=None", ("large_m", None)),
        ("autotune=True", ("autotune", True)),
        ("split_kv=false", ("split_kv", False)),
        ("inductor_launch=none", ("inductor_launch", None)),
        ("fast_accum=none", ("fast_accum", None)),
        ("fast_accum=false", ("fast_accum", False)),
        ("backends=cublas, deep_gemm", ("backends", ("cublas", "deep_gemm"))),
        ("skip=", ("skip", ())),
        ("act_amax_ub=448", ("act_amax_ub", 448.0)),
        ("recipe=rowwise", ("recipe", "rowwise")),
    ],
)
def test_a_command_line_option_is_typed_by_what_its_key_takes(text, option):
    assert parse_option(text) == option
    key, value = option
    base = {"recipe": "rowwise"} if key == "act_amax_ub" else {}  # a bound on dynamic scales
    assert getattr(make_config(base, **{key: value}), key) == value  # a config takes it as it is


@pytest.mark.parametrize(
    "text, error",
    [
        ("large=3", "did you mean 'large_m'"),
        ("large_m", "KEY=VALUE"),
        ("autotune=yes", "autotune takes true or false"),
        ("small_m=x", "small_m takes an integer"),
        ("large_m=auto", "large_m takes an integer or none"),
        ("act_amax=1", "fp8compile.calibrate"),
    ],
)
def test_a_bad_command_line_option_says_what_its_key_takes(text, error):
    with pytest.raises(ValueError, match=error):
        parse_option(text)
