"""tests/numerics.py, the one way the tests compare floats, and the rule that every test file
goes through it (see its docstring)."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest
import torch

import numerics

TESTS = pathlib.Path(__file__).resolve().parent
HELPER_FILES = {"numerics.py", pathlib.Path(__file__).name}  # they name the patterns themselves

# A bitwise comparison of tensors, or a tolerance of exactly zero, written without the helper.
RAW_EQUAL = re.compile(r"\btorch\s*\.\s*equal\s*\(|\.equal\s*\(|\barray_equal\s*\(")
NUMBER = r"(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)(?:[eE][+-]?\d+)?(?![\w.])"
ZERO_TOL = re.compile(rf"\b(atol|rtol|abs_tol|rel_tol)\s*=\s*({NUMBER})")


def raw_bitwise(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each raw bitwise comparison in a file's text."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        zero = any(float(m.group(2).replace("_", "")) == 0 for m in ZERO_TOL.finditer(line))
        if RAW_EQUAL.search(line) or zero:
            found.append((number, line.strip()))
    return found


def test_no_test_file_compares_bitwise_without_the_helper():
    """Bitwise equality is for copies, the same computation on the same shapes and integer or
    bool tensors, through numerics.assert_same, which says so; everything else through
    numerics.assert_close. A raw torch.equal / atol=0 / rtol=0 in a test file is neither."""
    files = sorted(p for p in TESTS.glob("*.py") if p.name not in HELPER_FILES)
    assert any(p.name == "test_inference.py" for p in files)  # the scan sees the test files
    offenders = [f"{p.name}:{n}: {line}" for p in files for n, line in raw_bitwise(p.read_text())]
    assert not offenders, ("compare through tests/numerics.py (assert_close, or assert_same "
                           "for a copy, the same computation or integers):\n"
                           + "\n".join(offenders))


@pytest.mark.parametrize("line", [
    "assert torch.equal(a, b)", "assert a.equal(b)", "np.array_equal(x, y)",
    "torch.testing.assert_close(a, b, atol=0, rtol=0)", "assert_close(a, b, rtol=0.0, atol=1e-5)",
    "torch.allclose(a, b, atol = 0.)", "math.isclose(a, b, rel_tol=0e0)", "f(abs_tol=0)"])
def test_the_scan_finds_raw_bitwise_comparisons(line):
    assert raw_bitwise(line) == [(1, line)]


@pytest.mark.parametrize("line", [
    "numerics.assert_same(a, b)", "numerics.assert_close(a, b, factor=4)",
    "torch.testing.assert_close(a, b, atol=1e-5, rtol=0.01)", "allclose(a, b, atol=0.5)",
    "f(atol=01e-3)", "equality(a, b)"])
def test_the_scan_leaves_tolerances_alone(line):
    assert raw_bitwise(line) == []


def one_ulp_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("inf")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_assert_close_accepts_a_few_ulps_and_rejects_a_real_error(dtype):
    x = torch.linspace(-3, 3, 61, dtype=torch.float64).to(dtype)
    numerics.assert_close(one_ulp_up(x), x)
    numerics.assert_close(one_ulp_up(one_ulp_up(x)), x)
    assert numerics.close(one_ulp_up(x), x)
    eps = torch.finfo(dtype).eps
    wrong = x.clone()
    wrong[7] += 100 * eps * (1 + abs(float(x[7])))  # one entry off by far more than rounding
    with pytest.raises(AssertionError):
        numerics.assert_close(wrong, x)
    assert not numerics.close(wrong, x)
    assert numerics.close(wrong, x, factor=100)  # unless a long computation allows that much


def test_the_tolerance_follows_the_coarser_dtype():
    assert numerics.tolerance(torch.float64) == (16 * 2.0 ** -52, 16 * 2.0 ** -52)
    assert numerics.tolerance(torch.float32, torch.float64) == numerics.tolerance(torch.float32)
    assert numerics.tolerance(torch.float32, factor=4)[0] == 4 * numerics.tolerance(
        torch.float32)[0]
    assert numerics.tolerance(torch.int64, torch.bool) == (0.0, 0.0)
    assert numerics.tolerance(torch.bfloat16, torch.float32) == (2 * 2.0 ** -7, 2 * 2.0 ** -7)
    with pytest.raises(ValueError, match="factor must be >= 1"):
        numerics.tolerance(torch.float32, factor=0.5)


def test_dtype_names_the_precision_of_a_converted_result():
    """A float32 result compared as float64: judged by float32's rounding when told."""
    exact = torch.linspace(0, 1, 11, dtype=torch.float64)
    from_float32 = exact.float().double() * (1 + 2 * torch.finfo(torch.float32).eps)
    assert not numerics.close(from_float32, exact)
    numerics.assert_close(from_float32, exact, dtype=torch.float32)


def test_assert_close_checks_shape_and_dtype_and_takes_nan_as_nan():
    x = torch.tensor([1.0, float("nan"), float("-inf")])
    numerics.assert_close(x, x.clone())
    with pytest.raises(AssertionError):
        numerics.assert_close(x, x.double())
    with pytest.raises(AssertionError):
        numerics.assert_close(x[:2], x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_assert_same_rejects_one_ulp(dtype):
    x = torch.randn(5, 7, dtype=dtype, generator=torch.Generator().manual_seed(0))
    numerics.assert_same(x, x.clone())
    numerics.assert_same(x[:, 2:], x.clone()[:, 2:])
    with pytest.raises(AssertionError):
        numerics.assert_same(one_ulp_up(x), x)
    moved = x.clone()
    moved[3, 4] = one_ulp_up(moved[3, 4])  # one entry, one ulp
    with pytest.raises(AssertionError):
        numerics.assert_same(moved, x)


def test_assert_same_on_integers_bools_and_lists():
    numerics.assert_same(torch.arange(5), torch.tensor([0, 1, 2, 3, 4]))
    numerics.assert_same(torch.ones(2, 2, dtype=torch.bool).tril(), torch.tensor(
        [[True, False], [True, True]]))
    numerics.assert_same([2.0 ** -k for k in range(3)], [1.0, 0.5, 0.25])
    with pytest.raises(AssertionError):
        numerics.assert_same(torch.arange(5), torch.arange(1, 6))
    with pytest.raises(AssertionError):
        numerics.assert_same(torch.arange(5), torch.arange(5.0))  # the dtype too


# --- tools/test_matrix.py: the fast tests under each numerical setting ------------------------

def test_the_matrix_reads_pytests_summary():
    import test_matrix
    assert test_matrix.counts("...\n24 failed, 2266 passed, 79 deselected, 5 warnings in 478.41s"
                              " (0:07:58)\n") == {"failed": 24, "passed": 2266}
    assert test_matrix.counts("1 passed, 2 errors in 3.0s") == {"passed": 1, "error": 2}
    assert test_matrix.counts("3 skipped, 1 xfailed in 0.1s") == {"skipped": 3, "xfailed": 1}
    assert test_matrix.counts("3 passed here, but no summary") == {}


def test_the_matrix_refuses_an_unknown_setting(capsys):
    import test_matrix
    with pytest.raises(SystemExit):
        test_matrix.main(["--settings", "native,mkl-avx512"])
    assert "unknown setting(s) ['mkl-avx512']" in capsys.readouterr().err


def test_the_matrix_runs_each_setting_chosen_with_the_arguments_passed(tmp_path, capsys,
                                                                       monkeypatch):
    import test_matrix
    selected = ["tests/test_numerics.py", "-k", "assert_same_rejects_one_ulp"]
    assert test_matrix.main(["--settings", "native", "--logs", str(tmp_path), *selected]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "-k assert_same_rejects_one_ulp" in lines[0]
    assert lines[1].startswith("ok   native ") and "2 passed, 0 failed, 0 error" in lines[1]
    assert [p.name for p in tmp_path.iterdir()] == ["native.log"]
    # The other settings' runs go to a stand-in that replies as pytest does (checked against
    # pytest by the run above and by "nothing selected" below): one real pytest is enough to
    # show the command works, and each setting's variables are checked where they are passed.
    started = []
    replies = {"mkl-compatible": (0, "\n2 passed, 2948 deselected in 5.10s\n"),
               # nothing selected is a failure, not a pass: pytest's exit code 5, with its
               # summary line
               "omp-1": (5, "\n2950 deselected in 5.02s\n")}

    def pytest_stand_in(command, env, **kwargs):
        setting = "omp-1" if env.get("OMP_NUM_THREADS") else "mkl-compatible"
        started.append((setting, command, env))
        code, out = replies[setting]
        return subprocess.CompletedProcess(command, code, out, "")

    monkeypatch.setattr(test_matrix.subprocess, "run", pytest_stand_in)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # the caller's own setting is cleared
    assert test_matrix.main(["--settings", "mkl-compatible", "--logs", str(tmp_path),
                             *selected]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("ok   mkl-compatible  MKL_CBWR=COMPATIBLE") and "2 passed" in line
    assert test_matrix.main(["--settings", "omp-1", "--logs", str(tmp_path),
                             "-k", "no_such_test"]) == 1
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("FAIL omp-1 ") and "(pytest exit code 5)" in line, line
    (_, compatible, compatible_env), (_, command, env) = started
    assert compatible[-3:] == selected and compatible_env["MKL_CBWR"] == "COMPATIBLE"
    assert command[-2:] == ["-k", "no_such_test"] and env["OMP_NUM_THREADS"] == "1"
    for setting_env in (compatible_env, env):
        assert "ATEN_CPU_CAPABILITY" not in setting_env
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mkl-compatible.log", "native.log", "omp-1.log"]
