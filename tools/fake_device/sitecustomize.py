"""Run any ringcomm_torch program with every tensor on the fake device, on CPUs:

    PYTHONPATH=tools/fake_device FAKE_DEVICE=ipc RINGCOMM_DEVICE_IPC_MIN_BYTES=0 \\
        ringcomm-run -np 2 python -m pytest test_torch.py

With ``FAKE_DEVICE=ipc`` (or ``pinned``) set, each Python process that starts with this folder
on its path treats every tensor as a device tensor served by one
:class:`ringcomm_torch.device.FakeOps` (``ipc``: its model of CUDA IPC, so single tensors take the
shared arena and the optimizer's buckets are reduced "on the device"; ``pinned``: through pinned
host memory).  Horovod's own ``test_torch.py``, run so, checks the CUDA paths' semantics against
Horovod's without a GPU.  Without ``FAKE_DEVICE`` nothing changes.
"""

import os

if os.environ.get("FAKE_DEVICE"):
    import ringcomm_torch.device as _device

    _device._override = _device.FakeOps(ipc=os.environ["FAKE_DEVICE"] == "ipc")
