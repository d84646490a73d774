"""One rank of :func:`ringcomm.run`: fetch the pickled function, run it, store its return value or its error.

Started by the launcher as ``python -m ringcomm.launch._run_task``; the rendezvous address, the job's
secret and the rank come from the ``RINGCOMM_*`` variables every worker gets.  When the function
lives in the caller's main script, that script is imported first under the name ``__mp_main__``
(and made ``__main__``), as :mod:`multiprocessing` does, so pickle finds it by reference.
"""

from __future__ import annotations

import os
import pickle
import runpy
import sys
import traceback
import types
from typing import Any

from ..net.rendezvous import kv_get, kv_set
from .run_fn import ERROR_KEY, PAYLOAD_KEY, RESULT_KEY


def _import_main(main: dict[str, str]) -> None:
    """Make the caller's ``__main__`` importable here, as ``__mp_main__`` and ``__main__``."""
    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module
    if "module" in main:
        namespace = runpy.run_module(main["module"], run_name="__mp_main__", alter_sys=True)
    else:
        namespace = runpy.run_path(main["path"], run_name="__mp_main__")
    module.__dict__.update(namespace)


def main() -> int:
    address = os.environ["RINGCOMM_RENDEZVOUS_ADDR"]
    secret = bytes.fromhex(os.environ["RINGCOMM_SECRET"])
    rank = int(os.environ["RINGCOMM_RANK"])
    timeout = float(os.environ.get("RINGCOMM_START_TIMEOUT", "60"))
    try:
        job = pickle.loads(kv_get(address, secret, PAYLOAD_KEY, timeout))
        sys.path[:0] = [p for p in job["sys_path"] if p not in sys.path]
        if job["main"]:
            _import_main(job["main"])
        func, args, kwargs = pickle.loads(job["blob"])
        result: Any = func(*args, **kwargs)
        value = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller, named by rank
        text = "".join(traceback.format_exception(exc))
        sys.stderr.write(text)
        kv_set(address, secret, ERROR_KEY.format(rank=rank), text.encode(), timeout=30.0)
        return exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code else 1
    kv_set(address, secret, RESULT_KEY.format(rank=rank), value, timeout=30.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
