"""The BLAS kernel as gpipe sees it from Python: gpipe.blas_kernel(), and at import a warning where
OpenBLAS runs a generic kernel, silenced by GPIPE_BLAS_CORETYPE=keep; a value it does not take raises."""
import os
import subprocess
import sys

import gpipe


def run_python(code, **env):
    environment = dict(os.environ, **env)
    for name, value in env.items():
        if value is None:
            del environment[name]
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=environment,
                          capture_output=True, text=True, timeout=120)


def test_the_kernel_of_this_process():
    kernel = gpipe.blas_kernel()
    assert kernel.running, "the tests run with OpenBLAS (scripts/install-deps.sh installs it)"
    coretype = os.environ.get("OPENBLAS_CORETYPE", "")
    assert kernel.coretype == coretype
    assert kernel.chosen_by == ("OPENBLAS_CORETYPE" if coretype else "OpenBLAS")
    assert kernel.generic == bool(kernel.advice)  # the C++ check's own rule (blas_test tests it on made-up CPUs)
    assert not kernel.generic or f"export OPENBLAS_CORETYPE={kernel.best}" in kernel.advice.replace("Export", "export")
    assert gpipe.blas_gflops() > 0.1


def test_a_kernel_set_by_the_user_is_not_warned_of_and_keep_silences():
    for env in ({"OPENBLAS_CORETYPE": "Prescott", "GPIPE_BLAS_CORETYPE": None},
                {"OPENBLAS_CORETYPE": None, "GPIPE_BLAS_CORETYPE": "keep"}):
        done = run_python("import gpipe; print(gpipe.blas_kernel().running)", **env)
        assert done.returncode == 0, (env, done.stderr)
        assert "OPENBLAS_CORETYPE=" not in done.stderr, done.stderr


def test_a_blas_setting_gpipe_does_not_take_is_refused_at_import():
    done = run_python("import gpipe", GPIPE_BLAS_CORETYPE="fastest")
    assert done.returncode != 0
    assert "GPIPE_BLAS_CORETYPE=fastest is neither auto, keep nor one of OpenBLAS's kernels" in done.stderr, done.stderr
