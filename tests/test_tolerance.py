"""The `parity` marker (tests/tolerance.py) finds the tests that compare by the suite's rule, and only
those: `.ci/run` reruns exactly these under an AVX2 cap."""
import importlib.util
import textwrap

import test_gpu_check
import test_parallel
from tolerance import uses_rule


def _module(tmp_path, source: str):
    path = tmp_path / "sample_tests.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location("sample_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_marker_follows_the_rule_by_name_and_through_a_helper(tmp_path):
    mod = _module(tmp_path, """
        from tolerance import assert_close, assert_parity

        def check(a, b):
            assert_parity(a, b)

        def test_direct():
            assert_close(1.0, 1.0)

        def test_through_a_helper():
            check([], [])

        def test_a_field_named_like_the_rule():
            row = {"loss_rel_diff": 0.0, "grad_rel_diff_max": 0.0}
            assert row["loss_rel_diff"] < 1e-6

        def test_nothing():
            assert 1 + 1 == 2
    """)
    assert uses_rule(mod.test_direct, mod) and uses_rule(mod.test_through_a_helper, mod)
    assert not uses_rule(mod.test_a_field_named_like_the_rule, mod)  # (a substring match said yes)
    assert not uses_rule(mod.test_nothing, mod)


def test_the_suites_own_tests_are_marked_as_they_compare():
    # tools/gpu_check's dry run reads `loss_rel_diff` fields of a compile-vs-eager bench: not the rule
    assert not uses_rule(test_gpu_check.test_the_gpu_call_runs_dry_on_the_cpu, test_gpu_check)
    assert uses_rule(test_parallel.test_llama_layout_matches_single_process, test_parallel)


def test_a_key_named_but_never_logged_is_not_taken_as_compared():
    """A run whose validation never ran logs no val_loss: named, it fails; by default (loss, grad
    norm and val_loss where validation ran) the run still compares its losses."""
    import pytest
    from tolerance import assert_parity
    run = [{"step": 1, "loss": 5.0, "grad_norm": 2.0}, {"step": 2, "loss": 4.0, "grad_norm": 1.5}]
    assert_parity(run, [dict(r) for r in run])
    assert_parity(run, [dict(r) for r in run], keys=("loss", "grad_norm"))
    with pytest.raises(AssertionError, match="'val_loss' is logged at none of the steps compared"):
        assert_parity(run, [dict(r) for r in run], keys=("loss", "val_loss"))
    with pytest.raises(AssertionError, match="'loss' is logged at none"):
        assert_parity([{"step": 1}], [{"step": 1}])
    with pytest.raises(AssertionError, match="step 2 loss"):
        assert_parity(run, [run[0], dict(run[1], loss=4.1)])
