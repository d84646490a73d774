"""``ringcomm.run`` (Horovod's ``horovod.run``): a function on N ranks, results back in rank order."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import ringcomm
from conftest import ROOT, WORKERS, job_env

sys.path.insert(0, str(WORKERS))
import run_fn_targets as targets  # noqa: E402

from ringcomm.errors import InvalidInputError  # noqa: E402
from ringcomm.launch.run_fn import RunFunctionError, payload  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("RINGCOMM_")]:
        monkeypatch.delenv(key)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [1, 3])
def test_results_come_back_in_rank_order(np_):
    results = ringcomm.run(targets.rank_sum, args=(2,), kwargs={"offset": 0.5}, num_proc=np_)
    total = sum(2.0 * r for r in range(np_)) + 0.5
    assert results == [(r, np_, total) for r in range(np_)]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_hosts_and_output_filename_mean_what_the_launcher_flags_mean(tmp_path):
    results = ringcomm.run(targets.rank_sum, args=(1,), num_proc=2, hosts="localhost:2",
                           output_filename=str(tmp_path / "out"))
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank.0", "rank.1"]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_horovod_spelling_np_and_use_gloo(monkeypatch):
    with pytest.warns(DeprecationWarning, match="np is deprecated"):
        results = ringcomm.run(targets.settings_seen, np=2, use_gloo=True, start_timeout=77)
    assert results == [77.0, 77.0]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_failing_rank_is_named_with_its_exception():
    with pytest.raises(RunFunctionError, match=r"rank 1 raised KeyError: 'no such key on rank 1'") as info:
        ringcomm.run(targets.fails_on, args=(1,), num_proc=2)
    assert isinstance(info.value, RuntimeError)  # what horovod.run raises
    assert "Traceback" in str(info.value)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_an_unpicklable_result_is_an_error_of_that_rank(monkeypatch):
    with pytest.raises(RunFunctionError, match="rank 0 raised"):
        ringcomm.run(targets.returns_unpicklable, num_proc=1)


def test_local_functions_need_cloudpickle(monkeypatch):
    monkeypatch.setitem(sys.modules, "cloudpickle", None)

    def local():
        return 1

    for func in (local, lambda: 1):
        with pytest.raises(InvalidInputError, match="top level of a module or of the script"):
            payload(func, (), {})


def test_interactive_main_functions_are_refused_without_cloudpickle(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    main = types.ModuleType("__main__")  # like a REPL's: no __file__, no __spec__
    exec("def typed_in():\n    return 1\n", main.__dict__)
    main.typed_in.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(InvalidInputError, match="interactive session"):
        payload(main.typed_in, (), {})


@pytest.mark.parametrize("kwargs, message", [
    ({"min_num_proc": 2}, "elastic"),
    ({"max_np": 4}, "elastic"),
    ({"hosts": "a:1", "hostfile": "f"}, "not both"),
    ({"use_gloo": True, "use_mpi": True}, "exclude each other"),
    ({"mpi_args": "--bind-to none"}, "no mpirun"),
    ({"num_proc": 0}, "-np must be at least 1"),
])
def test_arguments_that_cannot_work(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        with pytest.warns() if "max_np" in kwargs else _nothing():
            ringcomm.run(targets.fails_on, args=(9,), **kwargs)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SCRIPT = """
import sys
sys.modules["cloudpickle"] = None      # the standard pickle only
import ringcomm as horovod

class Point:
    def __init__(self, x):
        self.x = x

def where(p):
    import os
    return Point(p.x + int(os.environ["RINGCOMM_RANK"]))

if __name__ == "__main__":
    print([p.x for p in horovod.run(where, args=(Point(10),), num_proc=2)])
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_functions_and_classes_of_the_main_script_travel_by_reference(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80,
                         env=job_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[10, 11]"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_an_unguarded_script_is_told_to_guard_its_call(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace('if __name__ == "__main__":\n    print', 'if True:\n    print'))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80,
                         env=job_env(), cwd=ROOT)
    assert out.returncode != 0
    assert "if __name__ == '__main__'" in out.stderr
